"""``hpcfl run CONFIG.yaml``: one federated run, in one process or under mpiexec/srun."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from hpcfl.comm import launched_world_size, launcher_rank
from hpcfl.errors import EXIT_RESUMABLE, CommError, ConfigError, StoppedError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run a federated experiment from a YAML config",
        description=(
            "Run a federated experiment. Works in one process (the default) and unchanged under "
            "`mpiexec -n R` or `srun`, where clients are spread over the ranks. Writes "
            "config.yaml, metrics.jsonl, partition.json/png, checkpoints/ and determinism.json into the "
            "run directory (a checkpoint every `checkpoint_every` rounds: auto, every round, and every "
            "concurrency / K server steps for FedBuff and FedAsync). Bit-identical results (across rank counts and resumes) need the same config "
            "AND the same torch threads per rank (set `threads`: unset, it is the node's cores shared by "
            "its ranks, so 1 process and R ranks differ), `reduction` (float64; with float32 also the same "
            "rank count), `client_batch`, `client_threads` and `device`; determinism.json records what each "
            "rank used and a resume that differs says so. On a CPU, `client_threads: 2` trains 2 clients "
            "at once in one process (faster than 2 torch threads on one small model)."
        ),
        epilog="example: hpcfl run configs/fmnist_fedavg.yaml --set rounds=5 lr=0.05 --run-dir runs/try",
    )
    p.add_argument("config", nargs="?", help="YAML config (omit to use the built-in defaults)")
    p.add_argument(
        "--set",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="override config keys (a.b=1)",
    )
    p.add_argument("--data-root", help="dataset directory (default: $HPCFL_DATA, else ~/.cache/hpcfl)")
    p.add_argument("--run-dir", type=Path, help="output directory (default: runs/<config name>)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--overwrite", action="store_true", help="delete an existing run directory first")
    p.add_argument(
        "--reset-client-states",
        metavar="CLIENTS",
        help="with --resume: re-initialise these clients' states (e.g. 3,17: the ones a damaged "
        "client-state file names) instead of refusing; recorded in metrics.jsonl",
    )
    p.set_defaults(func=run)


def parse_clients(text: str | None) -> list[int]:
    """``--reset-client-states 3,17`` → [3, 17] (None → [])."""
    if text is None:
        return []
    try:
        return sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise ConfigError(
            f"--reset-client-states takes client numbers separated by commas, got {text!r}"
        ) from None


def resume_command(args: argparse.Namespace, run_dir: Path) -> str:
    """The command that continues this run: the same config, ``--set`` overrides and data root."""
    argv = ["hpcfl", "run"] + ([args.config] if args.config else [])
    if args.set:
        argv += ["--set", *args.set]
    if args.data_root:
        argv += ["--data-root", args.data_root]
    return shlex.join([*argv, "--run-dir", str(run_dir), "--resume"])


def run(args: argparse.Namespace) -> int:
    from hpcfl.config import load_cli_config  # here: building the parser must not import torch
    from hpcfl.runner import StopRequest, default_run_dir, run_experiment

    cfg = load_cli_config(args.config, args.set, args.data_root)
    ranks = launched_world_size() if cfg.comm != "local" else 1
    trained = cfg.num_clients - cfg.heldout_clients  # held-out clients train on no rank
    if ranks > trained:  # before any data is read or any rank waits on another
        raise CommError(
            f"{ranks} ranks but only {trained} clients that train: every rank needs at least one client; "
            f"launch with at most {trained} ranks or raise num_clients"
        )
    run_dir = args.run_dir or default_run_dir(cfg)
    stop = StopRequest()
    stop.install()
    try:
        result = run_experiment(
            cfg,
            run_dir,
            resume=args.resume,
            overwrite=args.overwrite,
            stop=stop,
            reset_clients=parse_clients(args.reset_client_states),
        )
    except StoppedError as err:
        if launcher_rank() == 0:
            print(f"hpcfl: {err}; continue with: {resume_command(args, run_dir)}", file=sys.stderr)
        return EXIT_RESUMABLE
    if result.budget_stop is not None:
        if launcher_rank() == 0:
            print(
                f"hpcfl: {result.budget_stop} after round {result.rounds_done}  ->  {run_dir}",
                file=sys.stderr,
            )
        return 0
    if not result.finished:
        if launcher_rank() != 0:
            return EXIT_RESUMABLE
        print(
            f"hpcfl: stopped by signal after round {result.rounds_done} (checkpoint saved); "
            f"continue with: {resume_command(args, run_dir)}",
            file=sys.stderr,
        )
        return EXIT_RESUMABLE
    if result.metrics:
        last = result.metrics[-1]
        print(f"round {last['round']}: test accuracy {last['test_accuracy']:.4f}  ->  {run_dir}")
    return 0
