"""``hpcfl tct-stage2 RUN_DIR``: re-solve TCT's stage 2 on a run's stored features.

The features of a TCT run are the expensive part; stage-2 settings (η2, M, T2, solver, variant,
normalisation) are cheap to sweep. This command reuses ``features.zarr`` — whose attributes prove
it was computed from this run's model, seed, p, logit and scope — and writes each sweep point to
``RUN_DIR/stage2/<settings>/metrics.jsonl``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hpcfl.config import Config, config_from_dict, merge, parse_overrides, read_yaml
from hpcfl.errors import ConfigError, RunDirError

# stage-2 keys that change the features themselves: changing them needs a new run
FEATURE_KEYS = ("p", "seed", "logit", "params", "features", "dtype")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tct-stage2",
        help="re-run TCT stage 2 on a run's stored eNTK features with other settings",
        description=(
            "Re-run TCT stage 2 on the features a TCT run stored, without recomputing them. "
            "Only solver settings may change: stage2.lr, auto_lr, local_steps, rounds, solver, "
            "variant, loss, normalize."
        ),
        epilog="example: hpcfl tct-stage2 runs/tct --set stage2.lr=1e-4 stage2.local_steps=100",
    )
    p.add_argument("run_dir", type=Path, help="directory of a TCT run whose stage 1 finished")
    p.add_argument(
        "--set",
        nargs="+",
        action="extend",
        default=[],
        metavar="stage2.KEY=VALUE",
        help="stage-2 settings to change",
    )
    p.set_defaults(func=run)


def _sweep_config(run_dir: Path, pairs: list[str]) -> tuple[Config, str]:
    if not (run_dir / "config.yaml").exists():
        raise RunDirError(f"{run_dir} holds no run (no config.yaml); pass the directory of a TCT run")
    saved = read_yaml(run_dir / "config.yaml")
    overrides = parse_overrides(pairs)
    extra = set(overrides) - {"stage2"}
    if extra:
        raise ConfigError(f"tct-stage2 changes only stage2.* keys, not {', '.join(sorted(extra))}")
    changed = overrides.get("stage2", {})
    frozen = [k for k in changed if k in FEATURE_KEYS]
    if frozen:
        raise ConfigError(
            f"stage2.{frozen[0]} changes the features themselves; run `hpcfl run` with it instead of tct-stage2"
        )
    cfg = config_from_dict(merge(saved, overrides))
    if cfg.algorithm != "tct":
        raise ConfigError(f"{run_dir} is a {cfg.algorithm} run; tct-stage2 needs a TCT run")
    tag = ",".join(f"{k}={v}" for k, v in sorted(changed.items())) or "as-configured"
    return cfg, tag


def run(args: argparse.Namespace) -> int:
    from hpcfl.comm import get_comm
    from hpcfl.files import append_jsonl, write_jsonl
    from hpcfl.runner.experiment import STAGE1_MODEL, set_threads
    from hpcfl.runner.federation import build_federation
    from hpcfl.runner.progress import Progress
    from hpcfl.runner.rounds import run_rounds
    from hpcfl.tct.pipeline import prepare_stage2

    cfg, tag = _sweep_config(args.run_dir, args.set)
    theta_path = args.run_dir / STAGE1_MODEL
    if not theta_path.exists():
        raise RunDirError(
            f"{args.run_dir} has no {STAGE1_MODEL}: its stage 1 has not finished; resume the run first"
        )
    comm = get_comm(cfg.comm)
    set_threads(cfg, comm)
    fed = build_federation(cfg, comm)
    setup = prepare_stage2(
        fed, torch.load(theta_path, weights_only=True), args.run_dir, cfg.stage2, extract=False
    )
    out = args.run_dir / "stage2" / tag
    metrics = out / "metrics.jsonl"
    if comm.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        write_jsonl(metrics, [])
    progress = Progress(total=cfg.stage2.rounds, enabled=cfg.progress and comm.rank == 0, desc="stage 2")
    last: dict = {}

    def hook(done, server, clients, row):
        if row is not None and comm.rank == 0:
            row["stage2_lr"] = setup.lr
            append_jsonl(metrics, row)
            last.update(row)
        progress.update(done, row)
        return False

    first = cfg.stage1.rounds
    server = setup.initial_server()
    clients = {k: setup.plan.algorithm.init_client(k, server) for k in fed.owned}
    run_rounds(
        setup.plan, server, clients, 0, cfg.stage2.rounds, stage="stage2", round_offset=first, hook=hook
    )
    progress.close()
    if comm.rank == 0 and last:
        print(
            f"stage 2 [{tag}]: test accuracy {last['test_accuracy']:.4f}, train accuracy "
            f"{last['train_accuracy']:.4f} after {cfg.stage2.rounds} rounds (η2 = {setup.lr:.4g}) -> {metrics}"
        )
    return 0
