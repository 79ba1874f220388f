"""``hpcfl report RUN_DIR ...``: a table and accuracy curves for one or more runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpcfl.errors import ConfigError
from hpcfl.report.protocol import DEFAULT_LAST_K, DEFAULT_WINDOW, Protocol


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="tables and plots from run directories",
        description=(
            "Summarise run directories into report.md. Headline, per method (runs that differ only in "
            "seed are one method; SCAFFOLD's form is shown): the mean ± std over seeds of the mean test "
            "accuracy of the last K evaluated rounds, and rounds and MB to a target on a running mean "
            "(methods.csv). Then per run: final and best single-round accuracy; rounds and MB (up + "
            "down) to the target with the speed-up over the FedAvg run of the same partition "
            "(FedPVR Table 2's form); with drift_diversity: true, a layers x rounds heatmap "
            "(drift_diversity.png); with conformal: true, coverage vs set size of the final model "
            "(conformal.png/.csv). Also report.csv, targets.csv and accuracy.png; runs with the same config "
            "but other threads per rank, reduction, client_batch or device (so not bit-identical) get a "
            "note naming the difference. For a sweep directory "
            "(hpcfl sweep): tables in the papers' layout, one row per method and one column per grid "
            "value, of the last-K mean, rounds to the target, final and best accuracy as mean ± std over "
            "seeds (report.md, summary.csv); with --search, the value chosen on the last-K validation mean; "
            "and curves with a ± std band (curves.png), in SWEEP_DIR/report."
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
    p.add_argument(
        "--last",
        type=int,
        default=DEFAULT_LAST_K,
        metavar="K",
        help=f"average the last K evaluated rounds of each run (default {DEFAULT_LAST_K}); a search "
        "chooses on the same last-K mean of validation accuracy",
    )
    p.add_argument(
        "--window",
        type=int,
        default=DEFAULT_WINDOW,
        metavar="W",
        help=f"rounds to target on the running mean of W evaluated rounds (default {DEFAULT_WINDOW}; "
        "1: the first single round)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hpcfl.report import write_report  # here: building the parser must not import matplotlib
    from hpcfl.sweep.plan import is_sweep_dir

    if args.target is not None and not 0 < args.target <= 100:
        raise ConfigError(f"--target is a test accuracy in percent, in (0, 100]; got {args.target:g}")
    protocol = Protocol(last_k=args.last, window=args.window)
    if any(is_sweep_dir(d) for d in args.run_dirs):
        if len(args.run_dirs) != 1:
            raise ConfigError("give one sweep directory at a time (or run directories only)")
        return _sweep(args, protocol)
    out = args.out or (args.run_dirs[0] / "plots" if len(args.run_dirs) == 1 else Path("report"))
    write_report(
        args.run_dirs, out, target=None if args.target is None else args.target / 100, protocol=protocol
    )
    print((out / "report.md").read_text(), end="")
    print(f"plots and tables in {out}")
    from hpcfl.runner.determinism import comparison_notes

    for note in comparison_notes(args.run_dirs):  # same config, other threads/reduction/...: say so
        print(note, file=sys.stderr)
    return 0


def _sweep(args: argparse.Namespace, protocol: Protocol) -> int:
    from hpcfl.sweep.plan import read_sweep
    from hpcfl.sweep.report import write_sweep_report

    sweep = read_sweep(args.run_dirs[0])
    out = args.out or sweep.sweep_dir / "report"
    text = write_sweep_report(
        sweep, out, target=None if args.target is None else args.target / 100, protocol=protocol
    )
    print(text, end="")
    print(f"tables and curves in {out}")
    return 0
