"""``hpcfl sweep CONFIG.yaml --grid key=v1,v2 ...``: a grid of runs, locally or as one SLURM job array.

The grid (``--grid`` axes, a ``--grid-file``, ``--seeds N``) is expanded and every point validated
before anything runs; each point gets a run directory named after its values under the sweep
directory. A point that already finished is skipped and an unfinished one resumed, so running the
same command again after a crash, a stop or a cancelled array completes only what is missing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hpcfl.errors import EXIT_RESUMABLE, ConfigError

if TYPE_CHECKING:
    from hpcfl.sweep.local import PointOutcome
    from hpcfl.sweep.plan import Sweep, SweepPoint

_EPILOG = """\
examples:
  hpcfl sweep configs/fmnist_fedavg.yaml --grid algorithm=fedavg,scaffold,tct \\
      --grid partition=dir:0.1,dir:0.5 --seeds 3 --name table2
  hpcfl sweep my.yaml --grid-file grid.yaml -j 2          # 2 points at a time on this machine
  hpcfl sweep my.yaml --grid algorithm=fedavg,fedprox --grid fedprox.mu=0.01,0.1 --seeds 3 \\
      --executor slurm --array-parallelism 8 --ntasks-per-node 4 --time 2:00:00
  hpcfl sweep my.yaml --grid algorithm=fedavg,scaffold --search lr=0.01,0.03,0.1 --validation 0.01
then: hpcfl status runs/table2    hpcfl report runs/table2

A key whose first part is an algorithm (fedprox.mu, tct.stage2.lr) varies only that algorithm's
points. A grid file holds `grid: {KEY: [V1, V2]}` and optionally `seeds: N`.
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``sweep`` sub-command."""
    from hpcfl.cli.submit import add_resource_options

    p = sub.add_parser(
        "sweep",
        help="a grid of runs (methods x partitions x seeds x hyper-parameters), resumable",
        description=(
            "Run a grid of configs: the Cartesian product of the --grid axes and --seeds, every point "
            "validated first. Locally one after another (or -j N at a time) by default; with "
            "--executor slurm as ONE job array, each task an MPI job of the requested size that "
            "requeues itself on preemption. Finished points are skipped and unfinished ones resumed "
            "when the same command runs again. One sweep at a time per --out (it holds the sweep "
            "directory's lock; a second one is refused naming the holder), and a point another process "
            "is running is left alone as busy (exit 75: run the command again later). "
            "`hpcfl status SWEEP_DIR` and `hpcfl report "
            "SWEEP_DIR` follow and summarise it (mean ± std over seeds)."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", help="base YAML config (omit to use the built-in defaults)")
    p.add_argument(
        "--grid",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=V1,V2",
        help="an axis of the grid (dotted keys; ALGORITHM.param for one algorithm's hyper-parameter)",
    )
    p.add_argument("--grid-file", type=Path, help="YAML with grid: {KEY: [values]} and seeds: N")
    p.add_argument("--seeds", type=int, help="N seeds per point: the config's seed, +1, ..., +N-1")
    p.add_argument("--name", help="the sweep's name (default: <config name>-sweep)")
    p.add_argument("--out", type=Path, help="the sweep directory (default: runs/<name>)")
    p.add_argument(
        "--set",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="override keys of every point",
    )
    p.add_argument("--data-root", help="dataset directory (as the compute nodes see it, for SLURM)")
    s = p.add_argument_group("learning-rate (or other) search on a validation split")
    s.add_argument(
        "--search",
        metavar="KEY=V1,V2",
        help="values to choose among per method and setting, by the mean validation accuracy of the last K "
        "evaluated rounds (hpcfl report --last K, default 5; never the test set)",
    )
    s.add_argument(
        "--validation",
        type=float,
        metavar="FRACTION",
        help="share of each client's training data held out for --search (default 0.01, FedPVR's 1%%)",
    )
    e = p.add_argument_group("execution")
    e.add_argument(
        "--executor",
        default="local",
        choices=("local", "slurm"),
        help="local: on this machine (default); slurm: one job array through submitit",
    )
    e.add_argument("-j", "--parallel", type=int, default=1, help="local: points run at a time (default 1)")
    e.add_argument("--array-parallelism", type=int, help="slurm: array tasks run at a time (default: all)")
    e.add_argument("--dry-run", action="store_true", help="list the points and what would run; run nothing")
    add_resource_options(p)
    p.set_defaults(func=run)


def build_sweep(args: argparse.Namespace) -> Sweep:
    """Axes from the options, then the validated plan (nothing runs yet)."""
    from hpcfl.config import load_cli_config
    from hpcfl.sweep.grid import combine_axes, parse_grid_arg, read_grid_file
    from hpcfl.sweep.plan import plan_sweep
    from hpcfl.sweep.select import search_options

    axes = [parse_grid_arg(text) for text in args.grid]
    seeds = args.seeds
    if args.grid_file is not None:
        file_axes, file_seeds = read_grid_file(args.grid_file)
        axes = file_axes + axes
        seeds = seeds if seeds is not None else file_seeds
    base = load_cli_config(args.config, args.set, args.data_root)
    search, search_axis, extra = search_options(args.search, args.validation)
    if search_axis is not None:
        axes = [*axes, search_axis]
    axes = combine_axes(axes, seeds, base.seed)
    if not axes:
        raise ConfigError("a sweep needs at least one axis: --grid KEY=V1,V2, --grid-file or --seeds N")
    name = args.name or f"{base.name}-sweep"
    if "/" in name or name in (".", "..") or not name.strip():
        raise ConfigError(f"--name {name!r} must be a plain file name")
    out = args.out or Path("runs") / name
    sweep = plan_sweep(
        args.config, args.set, args.data_root, axes, out, name=name, search=search, extra=extra
    )
    if search is not None:
        from hpcfl.sweep.select import personal_search_notes

        for note in personal_search_notes([p.cfg for p in sweep.points if p.cfg is not None]):
            print(note, file=sys.stderr)
    return sweep


def run(args: argparse.Namespace) -> int:
    """Plan, then run the missing points locally or queue them as one job array."""
    from hpcfl.runner.rundir import DONE

    if args.parallel < 1:
        raise ConfigError(f"-j/--parallel must be at least 1, got {args.parallel}")
    if args.array_parallelism is not None and args.array_parallelism < 1:
        raise ConfigError(f"--array-parallelism must be at least 1, got {args.array_parallelism}")
    sweep = build_sweep(args)
    from hpcfl.sweep.local import same_config

    mine = {p.name for p in sweep.points if p.cfg is not None}
    todo = [
        p
        for p in sweep.points
        if p.name in mine and not (same_config(p.run_dir, p.cfg) and (p.run_dir / DONE).exists())
    ]
    done = len(mine) - len(todo)
    print(
        f"hpcfl: sweep {sweep.name}: {len(mine)} points, {done} already finished, {len(todo)} to run "
        f"-> {sweep.sweep_dir}",
        file=sys.stderr,
    )
    if args.dry_run:
        for p in sweep.points:
            if p.name in mine:
                print(f"{'run ' if p in todo else 'done'}  {p.name}")
        return 0
    from hpcfl.runner.lock import RunLock

    # one sweep per sweep directory: a second one is refused here, naming the holder
    with RunLock(sweep.sweep_dir, what="sweep directory", by="another hpcfl sweep", option="--out"):
        sweep.write()
        if not todo:
            print(
                f"hpcfl: nothing to run; summarise it with: hpcfl report {sweep.sweep_dir}", file=sys.stderr
            )
            return 0
        if args.executor == "slurm":
            return _queue(args, sweep, todo)
        return _run_local(args, sweep, todo)


def _run_local(args: argparse.Namespace, sweep: Sweep, todo: list[SweepPoint]) -> int:
    from hpcfl.runner import StopRequest
    from hpcfl.sweep.local import run_points

    stop = StopRequest()
    stop.install()

    def said(name: str, outcome: PointOutcome) -> None:
        print(f"hpcfl: {name}: {outcome.status} ({outcome.seconds:.0f} s)", file=sys.stderr, flush=True)

    outcomes = run_points(
        [(p.name, p.cfg, p.run_dir) for p in todo], parallel=args.parallel, stop=stop, report=said
    )
    if len(outcomes) < len(todo) or any(o.stopped for o in outcomes.values()):
        print(f"hpcfl: stopped; run the same command again to continue ({sweep.sweep_dir})", file=sys.stderr)
        return EXIT_RESUMABLE
    failed = [n for n, o in outcomes.items() if o.failed]
    busy = [n for n, o in outcomes.items() if o.busy]
    if busy:
        print(
            f"hpcfl: {len(busy)} of {len(todo)} points are being run by another process and were left "
            f"alone ({', '.join(busy)}); run the same command again once they end",
            file=sys.stderr,
        )
    if failed:
        print(
            f"hpcfl: {len(failed)} of {len(todo)} points failed (hpcfl status {sweep.sweep_dir} shows why)",
            file=sys.stderr,
        )
        return 1
    if busy:
        return EXIT_RESUMABLE
    print(f"hpcfl: sweep finished; summarise it with: hpcfl report {sweep.sweep_dir}", file=sys.stderr)
    return 0


def _queue(args: argparse.Namespace, sweep: Sweep, todo: list[SweepPoint]) -> int:
    from hpcfl.cli.submit import options_from_args
    from hpcfl.runner.lock import lock_holder
    from hpcfl.sweep.array import queued_elsewhere, submit_array

    submit = []
    for p in todo:
        owner = queued_elsewhere(p)
        if owner is not None:
            print(f"hpcfl: {p.name}: already queued as job {owner[0]} ({owner[1]})", file=sys.stderr)
        elif (holder := lock_holder(p.run_dir)) is not None:
            print(f"hpcfl: {p.name}: running elsewhere (host {holder[0]}, PID {holder[1]})", file=sys.stderr)
        else:
            submit.append(p)
    if not submit:
        return 0
    options = options_from_args(args, executor="slurm")
    array_id, _ = submit_array(sweep, submit, options, array_parallelism=args.array_parallelism)
    print(
        f"hpcfl: submitted job array {array_id} ({len(submit)} tasks) -> {sweep.sweep_dir}", file=sys.stderr
    )
    print(f"hpcfl: follow it with: hpcfl status {sweep.sweep_dir}", file=sys.stderr)
    print(array_id)
    return 0
