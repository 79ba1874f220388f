"""``hpcfl compare``: run several configs side by side and report them (the main job).

Without arguments it runs the built-in comparison: TCT against FedAvg on Fashion-MNIST with one
class per client, both with 10 communication rounds, in one process. Runs that already finished
are reused, unfinished ones resumed, so an interrupted comparison continues where it stopped.
"""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path

from hpcfl.errors import EXIT_RESUMABLE

DEFAULT_CONFIGS = ("compare_fedavg.yaml", "compare_tct.yaml")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="run configs side by side (default: TCT vs FedAvg on Fashion-MNIST)",
        description=(
            "Run several experiment configs and write a comparison (table + accuracy curves). "
            "With no CONFIG it runs the built-in TCT vs FedAvg comparison on Fashion-MNIST, "
            "one class per client, 10 rounds each. Data comes from --data-root, $HPCFL_DATA, or "
            "~/.cache/hpcfl (downloaded when missing)."
        ),
        epilog="example: hpcfl compare --out runs/compare --data-root ~/data",
    )
    p.add_argument("configs", nargs="*", type=Path, help="YAML configs (default: the built-in pair)")
    p.add_argument(
        "--out", type=Path, default=Path("runs/compare"), help="output directory (default: runs/compare)"
    )
    p.add_argument("--data-root", help="dataset directory (overrides the configs' data_root)")
    p.add_argument(
        "--set",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="override keys in every config",
    )
    p.set_defaults(func=run)


def _config_paths(args: argparse.Namespace) -> list[Path]:
    if args.configs:
        return list(args.configs)
    base = resources.files("hpcfl") / "configs"
    return [Path(str(base / name)) for name in DEFAULT_CONFIGS]


def run(args: argparse.Namespace) -> int:
    from hpcfl.config import load_cli_config  # here: building the parser must not import torch
    from hpcfl.report import markdown_table, write_report
    from hpcfl.runner import StopRequest
    from hpcfl.runner.rundir import DONE
    from hpcfl.sweep.local import run_point, same_config

    # validate all before running any
    cfgs = [load_cli_config(path, args.set, args.data_root) for path in _config_paths(args)]
    stop = StopRequest()
    stop.install()
    run_dirs = []
    for cfg in cfgs:  # each config is a point of a one-axis grid, run as hpcfl sweep runs points
        run_dir = args.out / cfg.name
        run_dirs.append(run_dir)
        if (run_dir / DONE).exists() and same_config(run_dir, cfg):
            print(f"{cfg.name}: already finished in {run_dir}, reusing it")
            continue
        print(f"{cfg.name}: running ({cfg.algorithm}, {cfg.partition}) -> {run_dir}")
        outcome = run_point(cfg, run_dir, record_failures=False, stop=stop)
        if outcome.stopped:
            print(f"stopped by signal; run the same command again to continue ({run_dir})")
            return EXIT_RESUMABLE
    runs = write_report(run_dirs, args.out)
    print(markdown_table(runs), end="")
    print(f"table and plot: {args.out / 'report.md'}, {args.out / 'accuracy.png'}")
    return 0
