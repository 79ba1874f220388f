"""The rounds of ``hpcfl bench entk``: validate the options, run every method (plus ``plain``)
``--rounds`` times interleaved, keep each method's best round, and report (:func:`run_benchmark`)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

from hpcfl.bench.entk.measure import KEEP_FREED_MEMORY, run_child, run_here
from hpcfl.bench.entk.report import acceptance, write_report
from hpcfl.bench.entk.runners import bench_model, input_shape, parse_methods

DEFAULT_METHODS = {
    "cpu": "loop,vmap,fused,opacus,backpack",
    "cuda": "loop,vmap,fused,opacus,opacus-functorch,backpack",
}
"""``--methods`` when not given, per ``--device`` (the CPU's list as before issue 39)."""


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run every method (plus ``plain``) in its own subprocess, write CSV/JSON/PNG, print a table."""
    from hpcfl.entk import costs, native
    from hpcfl.errors import ConfigError

    methods = parse_methods(args.methods or DEFAULT_METHODS[args.device])
    if "fused-graph" in methods and args.device != "cuda":
        raise ConfigError(
            "--methods fused-graph needs --device cuda (a CUDA graph is a no-op on the CPU, where it is fused)"
        )
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda, but torch sees no CUDA device here; use --device cpu")
    if min(args.p, args.batch, args.repeats, args.loop_samples, args.rounds) < 1:
        raise ConfigError("--p, --batch, --repeats, --loop-samples and --rounds must be positive")
    shape = input_shape(args.model)
    if args.norm and args.model not in ("resnet8", "resnet18"):
        raise ConfigError(f"--norm applies to resnet8 and resnet18, not {args.model}")
    from hpcfl.entk import num_params

    total = num_params(bench_model(args.model, shape, {"norm": args.norm} if args.norm else {}))
    if args.in_process and (args.keep_freed_memory or args.omp_wait_policy != "default"):
        raise ConfigError(
            "--keep-freed-memory and --omp-wait-policy set a fresh process's environment: not with --in-process"
        )
    p = min(args.p, total)
    if p < args.p:
        print(
            f"--p {args.p} is more than {args.model}'s {total:,} parameters: every coordinate kept (p = {total:,})"
        )
    config = {
        "model": args.model,
        "norm": args.norm,
        "input_shape": list(shape),
        "p": p,
        "p_requested": args.p,
        "batch": args.batch,
        "device": args.device,
        "repeats": args.repeats,
        "loop_samples": args.loop_samples,
        "threads": args.threads,
        "seed": args.seed,
        "rounds": args.rounds,
        "omp_wait_policy": args.omp_wait_policy
        if args.omp_wait_policy != "default"
        else os.environ.get("OMP_WAIT_POLICY", "default"),
        "keep_freed_memory": bool(args.keep_freed_memory),
        "in_process": bool(args.in_process),
        "malloc_env": {k: os.environ[k] for k in KEEP_FREED_MEMORY if k in os.environ},
        "layer_form_costs": {
            "constants": costs.constants(args.device),
            "from": os.environ.get(costs.COSTS_ENV),
        },
        # the fused method's CPU kernel (hpcfl.entk.native): "on: FILE" or "off: WHY"
        "native_kernel": native.status() if args.device == "cpu" else "off: not a CPU run",
    }
    best: dict[str, dict[str, Any]] = {}
    per_round: list[dict[str, Any]] = []
    for round_ in range(args.rounds):  # interleaved, so a busy spell on shared cores hits all methods
        this_round: dict[str, dict[str, Any]] = {}
        for method in ["plain", *methods]:
            row = (run_here if args.in_process else run_child)({**config, "method": method})
            this_round[method] = row
            kept = best.get(method)
            if kept is None or (
                row.get("status") == "ok" and row["samples_per_s"] > kept.get("samples_per_s", 0)
            ):
                if kept is not None and kept.get("status") == "ok":
                    row["peak_mb"] = max(row["peak_mb"], kept["peak_mb"])
                best[method] = row
            elif row.get("status") == "ok":
                kept["peak_mb"] = max(row["peak_mb"], kept["peak_mb"])
            ok = row.get("status") == "ok"
            status = (
                f"{row['samples_per_s']:.1f} samples/s"
                if ok
                else f"{row.get('status')}: {row.get('note', '')}"
            )
            print(f"  round {round_ + 1} {method:<9} {status}", flush=True)
        per_round.append({name: item["ratio"] for name, item in acceptance(this_round, args.device).items()})
    rows = [best[m] for m in ["plain", *methods]]
    by_method = {r["method"]: r for r in rows}
    plain = by_method["plain"]["samples_per_s"] if by_method["plain"].get("status") == "ok" else None
    ratios = acceptance(by_method, args.device)
    for name, item in ratios.items():
        item["per_round"] = [r[name] for r in per_round if name in r]
        item["median_of_rounds"] = statistics.median(item["per_round"])
    report = {"config": config, "command": " ".join(sys.argv), "results": rows, "acceptance": ratios}
    write_report(args.out, report, plain)
    return report
