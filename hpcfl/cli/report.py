"""``hpcfl report RUN_DIR ...``: a table and accuracy curves for one or more runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from hpcfl.report import markdown_table, write_report


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="tables and plots from run directories",
        description="Summarise run directories: report.md, report.csv and accuracy.png (curves per run).",
    )
    p.add_argument("run_dirs", nargs="+", type=Path, help="run directories to compare")
    p.add_argument(
        "--out", type=Path, help="where to write (default: RUN_DIR/plots for one run, ./report otherwise)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = args.out or (args.run_dirs[0] / "plots" if len(args.run_dirs) == 1 else Path("report"))
    runs = write_report(args.run_dirs, out)
    print(markdown_table(runs), end="")
    print(f"plots and tables in {out}")
    return 0
