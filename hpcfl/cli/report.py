"""``hpcfl report RUN_DIR ...``: a table and accuracy curves for one or more runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpcfl.errors import ConfigError
from hpcfl.report import write_report


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="tables and plots from run directories",
        description=(
            "Summarise run directories into report.md: final results; rounds and MB (up + down) to a "
            "target test accuracy with the speed-up over the FedAvg run of the same partition "
            "(FedPVR Table 2's form); with drift_diversity: true, a layers x rounds heatmap "
            "(drift_diversity.png); with conformal: true, coverage vs set size of the final model "
            "(conformal.png/.csv). Also report.csv, targets.csv and accuracy.png; runs with the same config "
            "but other threads per rank, reduction, client_batch or device (so not bit-identical) get a "
            "note naming the difference. For a sweep directory "
            "(hpcfl sweep): tables in the papers' layout, one row per method and one column per grid "
            "value, of final and best accuracy and rounds to the target as mean ± std over seeds "
            "(report.md, summary.csv) and curves with a ± std band (curves.png), in SWEEP_DIR/report."
        ),
    )
    p.add_argument(
        "run_dirs", nargs="+", type=Path, help="run directories to compare, or one sweep directory"
    )
    p.add_argument(
        "--out",
        type=Path,
        help="where to write (default: RUN_DIR/plots for one run, SWEEP_DIR/report, ./report otherwise)",
    )
    p.add_argument(
        "--target",
        type=float,
        metavar="PCT",
        help="target test accuracy in percent for the rounds-to-target table (default: the largest "
        "whole percent every run reaches; FedPVR uses 66 on CIFAR-10)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hpcfl.sweep.plan import is_sweep_dir

    if args.target is not None and not 0 < args.target <= 100:
        raise ConfigError(f"--target is a test accuracy in percent, in (0, 100]; got {args.target:g}")
    if any(is_sweep_dir(d) for d in args.run_dirs):
        if len(args.run_dirs) != 1:
            raise ConfigError("give one sweep directory at a time (or run directories only)")
        return _sweep(args)
    out = args.out or (args.run_dirs[0] / "plots" if len(args.run_dirs) == 1 else Path("report"))
    write_report(args.run_dirs, out, target=None if args.target is None else args.target / 100)
    print((out / "report.md").read_text(), end="")
    print(f"plots and tables in {out}")
    from hpcfl.runner.determinism import comparison_notes

    for note in comparison_notes(args.run_dirs):  # same config, other threads/reduction/...: say so
        print(note, file=sys.stderr)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from hpcfl.sweep.plan import read_sweep
    from hpcfl.sweep.report import write_sweep_report

    sweep = read_sweep(args.run_dirs[0])
    out = args.out or sweep.sweep_dir / "report"
    text = write_sweep_report(sweep, out, target=None if args.target is None else args.target / 100)
    print(text, end="")
    print(f"tables and curves in {out}")
    return 0
