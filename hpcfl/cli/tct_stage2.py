"""``hpcfl tct-stage2 RUN_DIR``: re-solve TCT's stage 2 on a run's stored features.

The features of a TCT run are the expensive part; stage-2 settings (η2, M, T2, solver, variant,
normalisation) are cheap to sweep. This command reuses ``features.zarr`` — whose attributes prove
it was computed from this run's model, seed, p, logit and scope — and writes each sweep point to
``RUN_DIR/stage2/<settings>/metrics.jsonl``.

``--set device=cpu`` re-solves the stage 2 of a GPU run on a machine without one (a login node):
the stores and ``stage1_model.pt`` are device-free, so only the solver's device changes (and the
results then agree with the GPU's to float rounding, not bit for bit); the device joins the tag so
the two sweep points do not overwrite each other.

The run directory may come from someone else: the modules its ``config.yaml`` names under
``imports:`` are imported only with ``--imports`` (they run code), and never from the directory the
command was started in.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from hpcfl.errors import ConfigError, RunDirError

if TYPE_CHECKING:
    from hpcfl.config import Config

# stage-2 keys that change the features themselves: changing them needs a new run
FEATURE_KEYS = ("p", "seed", "head", "logit", "params", "features", "dtype")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tct-stage2",
        help="re-run TCT stage 2 on a run's stored eNTK features with other settings",
        description=(
            "Re-run TCT stage 2 on the features a TCT run stored, without recomputing them. "
            "Only solver settings may change: stage2.lr, auto_lr, local_steps, rounds, solver, "
            "variant, loss, normalize; and device (device=cpu re-solves a GPU run on a CPU node)."
        ),
        epilog="example: hpcfl tct-stage2 runs/tct --set stage2.lr=1e-4 stage2.local_steps=100 device=cpu",
    )
    p.add_argument("run_dir", type=Path, help="directory of a TCT run whose stage 1 finished")
    p.add_argument(
        "--set",
        nargs="+",
        action="extend",
        default=[],
        metavar="stage2.KEY=VALUE",
        help="stage-2 settings to change (and device=cpu|cuda)",
    )
    p.add_argument(
        "--imports",
        action="store_true",
        help="import the modules the run's config.yaml names under imports: (runs their code: only for a "
        "run directory you trust; never from the current directory)",
    )
    p.set_defaults(func=run)


def _sweep_config(run_dir: Path, pairs: list[str], imports: bool = False) -> tuple[Config, str]:
    from hpcfl.config import config_from_dict, merge, parse_overrides, read_yaml  # not at parser build
    from hpcfl.registry import import_modules

    if not (run_dir / "config.yaml").exists():
        raise RunDirError(f"{run_dir} holds no run (no config.yaml); pass the directory of a TCT run")
    saved = read_yaml(run_dir / "config.yaml")
    overrides = parse_overrides(pairs)
    extra = set(overrides) - {"stage2", "device"}
    if extra:
        raise ConfigError(f"tct-stage2 changes only stage2.* keys and device, not {', '.join(sorted(extra))}")
    changed = overrides.get("stage2", {})
    frozen = [k for k in changed if k in FEATURE_KEYS]
    if frozen:
        raise ConfigError(
            f"stage2.{frozen[0]} changes the features themselves; run `hpcfl run` with it instead of tct-stage2"
        )
    # a saved config keeps stage 2 under params:, which outranks a top-level (legacy) stage2: section
    # (only what changes: an empty stage2 mapping under params: would now clear the saved settings)
    changes: dict = {}
    if changed:
        changes = (
            {"params": {"stage2": changed}} if isinstance(saved.get("params"), dict) else {"stage2": changed}
        )
    if "device" in overrides:
        changes["device"] = overrides["device"]
    modules = saved.pop("imports", None) if isinstance(saved, dict) else None
    if imports:
        import_modules(modules, from_cwd=False)
    try:
        cfg = config_from_dict(merge(saved, changes))
    except ConfigError as err:
        if modules and not imports:
            raise ConfigError(
                f"{err} ({run_dir / 'config.yaml'} names imports: {modules}, not imported: pass --imports "
                "if you trust this run directory)"
            ) from None
        raise
    cfg.imports = list(modules or [])  # as saved (imported above only with --imports)
    if cfg.algorithm != "tct":
        raise ConfigError(f"{run_dir} is a {cfg.algorithm} run; tct-stage2 needs a TCT run")
    if cfg.device != "cpu" and "device" not in overrides and not _cuda_visible():
        raise ConfigError(
            f"{run_dir} ran with device: {cfg.device} but no CUDA GPU is visible here; "
            "add --set device=cpu to re-solve its stage 2 on the CPU"
        )
    named = {**changed, **({"device": overrides["device"]} if "device" in overrides else {})}
    tag = ",".join(f"{k}={v}" for k, v in sorted(named.items())) or "as-configured"
    return cfg, tag


def _cuda_visible() -> bool:
    import torch  # not at parser build

    return torch.cuda.is_available()


def run(args: argparse.Namespace) -> int:
    """Hold the run directory's lock (rank 0) for the sweep: it may write features beside a run."""
    from hpcfl.comm import launcher_rank
    from hpcfl.runner.lock import RunLock

    if not args.run_dir.is_dir():
        raise RunDirError(f"{args.run_dir} holds no run (no such directory); pass the directory of a TCT run")
    if launcher_rank() != 0:
        return _sweep(args)
    with RunLock(args.run_dir):
        return _sweep(args)


def _sweep(args: argparse.Namespace) -> int:
    from hpcfl.comm import get_comm
    from hpcfl.runner.experiment import (
        STAGE1_MODEL,
        StopRequest,
        _Bookkeeper,
        drive_stages,
        run_stages,
        set_threads,
    )
    from hpcfl.runner.federation import build_federation

    cfg, tag = _sweep_config(args.run_dir, args.set, args.imports)
    theta_path = args.run_dir / STAGE1_MODEL
    if not theta_path.exists():
        raise RunDirError(
            f"{args.run_dir} has no {STAGE1_MODEL}: its stage 1 has not finished; resume the run first"
        )
    comm = get_comm(cfg.comm, cfg.comm_timeout)
    set_threads(cfg, comm)
    fed = build_federation(cfg, comm)
    stages = run_stages(cfg)
    out = args.run_dir / "stage2" / tag
    if comm.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").unlink(missing_ok=True)
    comm.barrier()
    first = stages[0].rounds
    stop = StopRequest()
    stop.install()
    # the run driver itself, on the later stages only: inputs from the run, outputs under stage2/<tag>
    book = _Bookkeeper(cfg, comm, out, stop, first, first + sum(s.rounds for s in stages[1:]))
    from hpcfl.entk.settings import applied
    from hpcfl.runner.determinism import entk_settings

    with applied(entk_settings(cfg)):  # the config's eNTK settings, should the features be extracted
        drive_stages(fed, stages[1:], args.run_dir, None, book, round_base=first, first_index=1, sweep=True)
    book.progress.close()
    last = book.rows[-1] if book.rows else {}
    if comm.rank == 0 and last:
        print(
            f"stage 2 [{tag}]: test accuracy {last['test_accuracy']:.4f}, train accuracy "
            f"{last['train_accuracy']:.4f} after {cfg.params.stage2.rounds} rounds (η2 = {last['stage2_lr']:.4g}) -> "
            f"{out / 'metrics.jsonl'}"
        )
    return 0
