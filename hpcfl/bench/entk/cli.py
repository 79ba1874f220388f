"""The command line of ``hpcfl bench entk`` (:func:`add_arguments`, :func:`run_cli`) and the
standalone entry (:func:`main`: ``python -m hpcfl.bench.entk``, ``benchmarks/entk_throughput.py``,
and ``--worker SPEC``, one method timed in this process, as :mod:`hpcfl.bench.entk.worker` does)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hpcfl.bench.entk.benchmark import DEFAULT_METHODS, run_benchmark
from hpcfl.bench.entk.runners import METHODS, MODELS

HELP = "eNTK feature throughput: loop / vmap / fused / Opacus / BackPACK vs one training step"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hpcfl bench entk``."""
    parser.add_argument("--model", default="simplecnn", choices=MODELS)
    parser.add_argument("--p", type=int, default=100_000, help="kept eNTK coordinates (default 100000)")
    parser.add_argument("--batch", type=int, default=256, help="samples per batch (default 256)")
    parser.add_argument(
        "--methods",
        default=None,
        help="comma-separated subset of "
        + ",".join(METHODS)
        + " (default: cpu "
        + DEFAULT_METHODS["cpu"]
        + "; cuda "
        + DEFAULT_METHODS["cuda"]
        + ")",
    )
    parser.add_argument(
        "--norm",
        default=None,
        choices=("bn", "gn"),
        help="normalisation of resnet8/resnet18 (default: the model's, resnet8 bn, resnet18 gn; "
        "Opacus needs gn: it refuses BatchNorm)",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per method (default 5)")
    parser.add_argument("--loop-samples", type=int, default=16, help="samples timed for loop (default 16)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/entk"), help="output directory")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per method (0: torch default)")
    parser.add_argument("--seed", type=int, default=0, help="model / coordinate seed (default 0)")
    parser.add_argument(
        "--omp-wait-policy",
        default="default",
        choices=("default", "passive", "active"),
        help="OMP_WAIT_POLICY for the timed processes (default: leave the environment's)",
    )
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="raise glibc's mmap/trim thresholds in the timed processes (see the module docstring)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="time every method in this process instead of a fresh one per method and round: on a "
        "GPU it saves a CUDA start-up (~4 s) each; one method's allocations may then colour the next's",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds over all methods, best kept per method (default 3; evens out shared cores)",
    )


def run_cli(args: argparse.Namespace) -> int:
    """``hpcfl bench entk`` entry point."""
    run_benchmark(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m hpcfl.bench.entk`` / ``benchmarks/entk_throughput.py``)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # the form of earlier versions: a method timed in this process
        from hpcfl.bench.entk.worker import worker

        print(json.dumps(worker(json.loads(argv[1]))), flush=True)
        return 0
    parser = argparse.ArgumentParser(prog="entk_throughput", description=HELP)
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))
