"""FedAvg / FedProx / MOON / FedCKA on Fashion-MNIST under Dirichlet label skew (FedCKA, Table 2).

    HPCFL_DATA=/path/to/datasets python benchmarks/fedcka_accuracy.py --out bench-out/fedcka_acc

The paper's Table 2 compares the four methods on CIFAR-10 with 10 clients and α ∈ {5.0, 0.5, 0.1}
(100 rounds of 10 local epochs on a GPU; ``configs/cifar10_*.yaml`` reproduce that set-up). This
script runs the same grid on Fashion-MNIST at a CPU budget: by default ``cnn-proj`` (the paper's
CNN with projection head, on 1×28×28), 10 clients, ``--rounds 10`` rounds of ``--local-steps 10``
SGD steps of batch 64 per client (lr 0.05, momentum 0.9, weight decay 1e-5; evaluation every 2nd
round), one seed, two runs at a time (``--jobs 2``, one thread each), the
hyper-parameters' defaults (FedProx μ = 0.01, MOON μ = 1 and τ = 0.5, FedCKA μ = 3) without the
paper's per-setting μ tuning; every run records per-layer CKA (``cka_metrics``). Larger budgets:
``--rounds``, ``--local-steps`` or ``--local-epochs``, ``--seeds``.

Every run is an ordinary run directory under ``<out>/runs/`` (``hpcfl report``-able; a finished one
is reused, an unfinished one resumed, a diverged one reported as such); the script
writes ``accuracy.{csv,md,json}`` (final and best test accuracy per method and α) and
``accuracy.png`` (test accuracy vs round), and prints the markdown table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import json
import math
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _runs import run_cached

from hpcfl.config import config_from_dict

ALGORITHMS: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "fedprox": {"fedprox": {"mu": 0.01}},
    "moon": {"moon": {"mu": 1.0, "temperature": 0.5}},
    "fedcka": {"fedcka": {"mu": 3.0}},
}
PAPER_TABLE2 = {  # CIFAR-10, 100 rounds × 10 epochs (for orientation only: other data and budget)
    "fedavg": {"dir:5.0": 64.37, "dir:0.5": 59.81, "dir:0.1": 50.43},
    "fedprox": {"dir:5.0": 64.58, "dir:0.5": 59.98, "dir:0.1": 51.07},
    "moon": {"dir:5.0": 65.25, "dir:0.5": 60.65, "dir:0.1": 51.63},
    "fedcka": {"dir:5.0": 67.86, "dir:0.5": 61.13, "dir:0.1": 52.35},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-root", help="datasets directory (default: $HPCFL_DATA)")
    p.add_argument("--partitions", nargs="+", default=["dir:5.0", "dir:0.5", "dir:0.1"])
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    p.add_argument("--model", default="cnn-proj")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--local-steps", type=int, default=10, help="M local steps per round (0: use epochs)")
    p.add_argument("--local-epochs", type=int, default=1, help="used when --local-steps 0")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel (processes)")
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--no-cka-metrics", action="store_true", help="skip the per-layer CKA rows")
    p.add_argument("--out", type=Path, default=Path("bench-out/fedcka_acc"))
    return p.parse_args(argv)


def config(args: argparse.Namespace, partition: str, algorithm: str, seed: int) -> dict[str, Any]:
    name = f"{partition.replace(':', '')}_{algorithm}_s{seed}"
    cfg: dict[str, Any] = dict(
        name=name,
        dataset="fashion-mnist",
        partition=partition,
        num_clients=args.clients,
        model=args.model,
        algorithm=algorithm,
        rounds=args.rounds,
        local_epochs=args.local_epochs,
        local_steps=args.local_steps or None,
        lr=args.lr,
        momentum=0.9,
        weight_decay=1e-5,
        batch_size=args.batch,
        seed=seed,
        threads=args.threads,
        progress=False,
        eval_every=args.eval_every,
        cka_metrics=not args.no_cka_metrics,
        **ALGORITHMS[algorithm],
    )
    if args.data_root:
        cfg["data_root"] = args.data_root
    return cfg


def _run_one(cfg_dict: dict[str, Any], run_dir: str, tags: dict[str, Any]) -> dict[str, Any]:
    """One run (in a worker process when ``--jobs`` > 1); a diverged run gets NaN accuracies."""
    res = run_cached(cfg_dict, run_dir)
    rows = [r for r in res["rows"] if "test_accuracy" in r]
    acc = [r["test_accuracy"] for r in rows]
    failed = res["status"].startswith("failed")
    out = {
        **tags,
        "final_accuracy": float("nan") if failed or not acc else acc[-1],
        "best_accuracy": float("nan") if failed or not acc else max(acc),
        "seconds": res["seconds"],
        "status": res["status"],
    }
    print(
        f"{tags['partition']:8s} {tags['algorithm']:8s} seed {tags['seed']}: final {out['final_accuracy']:.4f} "
        f"({res['seconds']:.0f} s, {res['status']})",
        flush=True,
    )
    return {**out, "rounds": [r["round"] for r in rows], "curve": acc, "run_dir": run_dir}


def run_grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    jobs = [
        (
            config(args, partition, algorithm, seed),
            str(args.out / "runs" / config(args, partition, algorithm, seed)["name"]),
            {"partition": partition, "algorithm": algorithm, "seed": seed},
        )
        for partition in args.partitions
        for algorithm in args.algorithms
        for seed in args.seeds
    ]
    for cfg, _, _ in jobs:  # validate everything before the first run starts
        config_from_dict(cfg)
    if args.jobs <= 1:
        return [_run_one(*job) for job in jobs]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
        return list(pool.map(_run_one, *zip(*jobs, strict=True)))


def summarise(results: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    table = []
    for algorithm in args.algorithms:
        row: dict[str, Any] = {"algorithm": algorithm}
        for partition in args.partitions:
            runs = [r for r in results if r["algorithm"] == algorithm and r["partition"] == partition]
            row[partition] = statistics.mean(r["final_accuracy"] for r in runs)
            row[f"{partition} best"] = statistics.mean(r["best_accuracy"] for r in runs)
            row[f"{partition} s"] = statistics.mean(r["seconds"] for r in runs)
        table.append(row)
    return table


def markdown(table: list[dict[str, Any]], args: argparse.Namespace) -> str:
    head = "| method | " + " | ".join(f"α = {p[4:]} final (best)" for p in args.partitions)
    head += " | seconds per run | paper CIFAR-10 (" + ", ".join(p[4:] for p in args.partitions) + ") |"
    lines = [head, "|" + "---|" * (len(args.partitions) + 3)]
    for row in table:
        cells = [
            "diverged" if math.isnan(row[p]) else f"{100 * row[p]:.2f}% ({100 * row[p + ' best']:.2f}%)"
            for p in args.partitions
        ]
        secs = statistics.mean(row[f"{p} s"] for p in args.partitions)
        paper = ", ".join(
            f"{PAPER_TABLE2[row['algorithm']].get(p, float('nan')):.2f}" for p in args.partitions
        )
        lines.append(f"| {row['algorithm']} | " + " | ".join(cells) + f" | {secs:.0f} | {paper} |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(args.partitions), figsize=(4.2 * len(args.partitions), 3.6), squeeze=False
    )
    for ax, partition in zip(axes[0], args.partitions, strict=True):
        for algorithm in args.algorithms:
            curves = [
                r["curve"] for r in results if r["algorithm"] == algorithm and r["partition"] == partition
            ]
            length = min(len(c) for c in curves)  # a diverged run stops early
            if not length:
                continue
            mean = [statistics.mean(v) for v in zip(*(c[:length] for c in curves), strict=True)]
            rounds = next(
                r["rounds"] for r in results if r["partition"] == partition and r["algorithm"] == algorithm
            )[:length]
            ax.plot(rounds, mean, marker="o", ms=3, label=algorithm)
        ax.set_title(f"Fashion-MNIST, {partition}")
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = run_grid(args)
    table = summarise(results, args)
    md = markdown(table, args)
    budget = (
        f"{args.rounds} rounds × {args.local_steps} local steps (batch {args.batch})"
        if args.local_steps
        else f"{args.rounds} rounds × {args.local_epochs} local epochs (batch {args.batch})"
    )
    header = (
        f"Fashion-MNIST, {args.clients} clients, {args.model}, {budget}, lr {args.lr}, momentum 0.9, "
        f"seeds {args.seeds}, {args.jobs} job(s) × {args.threads} thread(s); "
        f"total {time.perf_counter() - t0:.0f} s\n\n"
    )
    (args.out / "accuracy.md").write_text(header + md + "\n")
    with open(args.out / "accuracy.csv", "w", newline="") as f:
        writer = csv.DictWriter(
            f, fieldnames=[k for k in results[0] if k not in ("curve", "rounds")], extrasaction="ignore"
        )
        writer.writeheader()
        writer.writerows(results)
    (args.out / "accuracy.json").write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": results}, indent=1)
    )
    plot(results, args, args.out / "accuracy.png")
    print(header + md)
    print(f"wrote {args.out}/accuracy.{{csv,md,json,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
