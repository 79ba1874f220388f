"""``hpcfl bench scaling`` options and entry points."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpcfl.bench.scaling.defaults import (
    DEFAULT_CLIENTS,
    DEFAULT_CLIENTS_PER_RANK,
    DEFAULT_MODELS,
    DEFAULT_OUT,
    DEFAULT_RANKS,
    IB_ALPHA_S,
    IB_BETA_BPS,
)
from hpcfl.bench.scaling.launcher import run_launcher, run_probe_only
from hpcfl.bench.scaling.measure import launched
from hpcfl.bench.scaling.report import summarize
from hpcfl.bench.scaling.world import run_world

DESCRIPTION = """\
Measure FedAvg rounds/s, samples/s and the split of a round into local compute, allreduce and
evaluation over ranks x clients x models (synthetic FMNIST-shaped data, a fixed number of samples
per client, one torch thread per rank), and report strong- and weak-scaling efficiency plus a
PROJECTION to hundreds of ranks (a ring-allreduce latency/bandwidth model fed with the measured
per-client time and an allreduce micro-benchmark; labelled as a projection wherever it appears).

Modes: started from a shell it launches `mpiexec -n R python -m hpcfl bench scaling --worker` per
configuration; started by srun/mpiexec (as slurm/scaling_sweep.sbatch does) it measures the
current world only and appends rows to --out/scaling_rows.jsonl, so jobs at different node counts
accumulate; --summarize DIR rebuilds the table, CSV, JSON and PNGs from every row under DIR.
The full method: python -c "import hpcfl.bench.scaling as m; print(m.__doc__)"
"""

EPILOG = """\
examples:
  hpcfl bench scaling                                   # the default sweep (launcher mode)
  hpcfl bench scaling --ranks 1,2 --models simplecnn --rounds 2
  mpiexec -n 4 hpcfl bench scaling --out results/s     # measure this 4-rank world only
  srun --mpi=pmi2 hpcfl bench scaling my.yaml --out results/scaling/my/nodes2-ranks16
  hpcfl bench scaling --summarize results/scaling/my   # table + plots from every point below
  sbatch --export=ALL,CONFIG=my.yaml slurm/scaling_sweep.sbatch   # the sweep across nodes

Round time = max-rank compute + allreduce (+ evaluation / --eval-every); strong efficiency
T(R0)·R0/(T(R)·R) at fixed K, weak efficiency T(R0,K0)/T(R,K0·R/R0). The projection to hundreds of
ranks is a ring-allreduce latency/bandwidth model, labelled PROJECTION everywhere it appears.
"""


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _str_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hpcfl bench scaling``."""
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument(
        "config", nargs="?", help="YAML config to benchmark (default: synthetic FMNIST-shaped FedAvg)"
    )
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})"
    )
    parser.add_argument(
        "--ranks",
        type=_int_list,
        default=list(DEFAULT_RANKS),
        help="launcher mode: rank counts (default 1,2,4; more ranks x threads than cores = oversubscribed)",
    )
    parser.add_argument(
        "--models",
        type=_str_list,
        default=None,
        help="comma-separated models (default simplecnn,resnet8; with CONFIG: its model)",
    )
    parser.add_argument(
        "--clients",
        type=_int_list,
        default=None,
        help="client counts K (default 10,50,100; with CONFIG: its num_clients); K < R is skipped",
    )
    parser.add_argument(
        "--clients-per-rank",
        type=int,
        default=None,
        help=f"also measure K = N*R at every R, a weak-scaling series (default {DEFAULT_CLIENTS_PER_RANK}; "
        "with CONFIG: none; 0 = none)",
    )
    parser.add_argument(
        "--samples-per-client",
        type=int,
        default=None,
        help="synthetic samples per client, fixed so work is proportional to K (default 200)",
    )
    parser.add_argument(
        "--test-samples", type=int, default=2000, help="synthetic test-set size (default 2000)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds per configuration (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="leading rounds dropped (default 1)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per rank (default 1; 0 = hpcfl's default: node cores / local ranks)",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=5,
        help="evaluation is measured every round but charged 1/N per round (default N=5)",
    )
    parser.add_argument(
        "--mode",
        choices=("auto", "launch", "world"),
        default="auto",
        help="auto: world when started by srun/mpiexec, else launch (default auto)",
    )
    parser.add_argument(
        "--summarize", type=Path, metavar="DIR", help="only rebuild the report from rows under DIR"
    )
    parser.add_argument("--append", action="store_true", help="launcher: keep earlier rows in --out")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="launcher: passes over all configurations; the fastest of each is reported (default 1)",
    )
    parser.add_argument("--mpiexec", help="launcher: the mpiexec to use (default: next to python, else PATH)")
    parser.add_argument("--timeout", type=float, default=3600, help="launcher: seconds per configuration")
    parser.add_argument("--no-probe", action="store_true", help="skip the allreduce micro-benchmark")
    parser.add_argument("--probe-budget", type=float, default=0.25, help="seconds per probe message size")
    parser.add_argument("--project-ranks", type=int, default=512, help="projection: up to this many ranks")
    parser.add_argument("--project-clients", type=int, default=1000, help="projection: K of strong scaling")
    parser.add_argument(
        "--project-clients-per-rank",
        type=int,
        default=10,
        help="projection: K/R of weak scaling (default 10)",
    )
    parser.add_argument("--ib-alpha", type=float, default=IB_ALPHA_S, help="projection: network latency α, s")
    parser.add_argument(
        "--ib-beta", type=float, default=IB_BETA_BPS, help="projection: network bandwidth β, B/s"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe-only", action="store_true", help=argparse.SUPPRESS)


def _check(args: argparse.Namespace) -> None:
    from hpcfl.errors import ConfigError, unknown
    from hpcfl.models import MODELS

    if args.clients_per_rank is None:
        args.clients_per_rank = 0 if args.config else DEFAULT_CLIENTS_PER_RANK
    if not args.config:
        args.models = args.models or list(DEFAULT_MODELS)
        args.clients = args.clients or list(DEFAULT_CLIENTS)
    for m in args.models or []:
        if m not in MODELS:
            raise unknown("model", m, MODELS)
    if args.rounds < args.warmup + 1:
        raise ConfigError(
            f"--rounds must exceed --warmup ({args.warmup}) so a round is timed, got {args.rounds}"
        )
    for name in (
        "eval_every",
        "test_samples",
        "repeats",
        "project_ranks",
        "project_clients",
        "project_clients_per_rank",
    ):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if args.samples_per_client is not None and args.samples_per_client < 1:
        raise ConfigError("--samples-per-client must be >= 1")
    if args.warmup < 0 or args.clients_per_rank < 0 or args.threads < 0:
        raise ConfigError("--warmup, --clients-per-rank and --threads must be >= 0")
    if args.ib_alpha < 0 or args.ib_beta <= 0:
        raise ConfigError("--ib-alpha must be >= 0 and --ib-beta > 0")


def run_cli(args: argparse.Namespace) -> int:
    """``hpcfl bench scaling`` entry point: summarize, probe, world or launcher mode."""
    _check(args)
    if args.summarize is not None:
        out = args.summarize if args.out == DEFAULT_OUT else args.out
        summarize(args.summarize, out, args)
        return 0
    if args.probe_only:
        return run_probe_only(args)
    if args.worker or args.mode == "world" or (args.mode == "auto" and launched()):
        return run_world(args)
    return run_launcher(args)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``benchmarks/scaling.py``), same options as ``hpcfl bench scaling``."""
    from hpcfl.errors import HpcflError

    parser = argparse.ArgumentParser(prog="scaling")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_cli(args)
    except HpcflError as err:
        print(f"scaling: error: {err}", file=sys.stderr)
        return err.exit_code
