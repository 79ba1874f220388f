"""``hpcfl status RUN_DIR...``: where submitted runs stand (job state, rounds, errors, logs).

Exit status 0 while every run is queued, running or finished, 1 when a job ended without finishing
its run (failed, cancelled, out of time and not requeued), so scripts can poll it.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``status`` sub-command."""
    p = sub.add_parser(
        "status",
        help="state of submitted runs: SLURM job state, rounds done, the error of a failed job",
        description=(
            "Where submitted runs stand: SLURM job state (with the reason a job waits), rounds done, "
            "the error of a failed job and its log. For a sweep directory: a table of its points "
            "(queued, running round r/R, done, failed with the error) and an ETA. Exit 1 when a job "
            "ended without finishing its run (a sweep: when a point failed)."
        ),
        epilog="example: hpcfl status runs/fmnist_fedavg --json",
    )
    p.add_argument(
        "run_dirs",
        nargs="+",
        type=Path,
        metavar="RUN_DIR",
        help="run directories given to hpcfl submit, or sweep directories of hpcfl sweep",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per run instead of text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the status of each run directory."""
    from hpcfl.launch import format_status, run_status
    from hpcfl.launch.status import status_json
    from hpcfl.sweep.plan import is_sweep_dir

    failed = False
    for i, run_dir in enumerate(args.run_dirs):
        if is_sweep_dir(run_dir):
            failed |= _sweep(run_dir, args.json, i)
            continue
        status = run_status(run_dir.resolve())
        failed |= status.failed
        if args.json:
            print(status_json(status))
        else:
            print(("\n" if i else "") + format_status(status))
    return 1 if failed else 0


def _sweep(sweep_dir: Path, as_json: bool, index: int) -> bool:
    """Print a sweep's table (or JSON lines); True when a point failed."""
    from hpcfl.sweep.plan import read_sweep
    from hpcfl.sweep.status import format_sweep_status, status_json, sweep_status

    sweep = read_sweep(sweep_dir)
    statuses = sweep_status(sweep)
    print(
        status_json(statuses) if as_json else ("\n" if index else "") + format_sweep_status(sweep, statuses)
    )
    return any(s.state == "failed" for s in statuses)
