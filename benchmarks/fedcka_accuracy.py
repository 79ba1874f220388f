"""FedAvg / FedProx / MOON / FedCKA on Fashion-MNIST under Dirichlet label skew (FedCKA, Table 2),
under the comparison protocol: lr chosen per method and α on a validation split, 3 seeds, last-k
mean ± std.

    HPCFL_DATA=/path/to/datasets python benchmarks/fedcka_accuracy.py --out bench-out/fedcka_acc

The paper's Table 2 compares the four methods on CIFAR-10 with 10 clients and α ∈ {5.0, 0.5, 0.1}
(100 rounds of 10 local epochs on a GPU; ``configs/cifar10_*.yaml`` reproduce that set-up). This
script runs the same grid on Fashion-MNIST at a CPU budget: by default ``cnn-proj`` (the paper's
CNN with projection head, on 1×28×28), 10 clients, ``--rounds 10`` rounds of ``--local-steps 10``
SGD steps of batch 64 per client (momentum 0.9, weight decay 1e-5; evaluation every 2nd round),
the hyper-parameters' defaults (FedProx μ = 0.01, MOON μ = 1 and τ = 0.5, FedCKA μ = 3; fixed, not
the paper's per-setting μ tuning); every run records per-layer CKA (``cka_metrics``).

Protocol (``benchmarks/_runs.py``, :mod:`hpcfl.report.protocol`, as every table script): each lr
of ``--lrs`` (0.01, 0.05) runs at the first seed with ``--validation`` (5 %) of each client's data
held out; the lr with the best mean validation accuracy over the last ``--last`` (5) evaluated
rounds is chosen, then ``--seeds`` (3) seeds run at it. The table: mean ± std over seeds of each
seed's last-5 mean test accuracy (at eval every 2nd round of 10: rounds 2–10), rounds to target on
a running mean of 3 evaluations, final accuracy as a secondary table. Budget: 3 partitions × 4
methods × (2 + 2) runs = 48 runs, two at a time, one thread each.

Every run is an ordinary run directory under ``<out>/runs/`` (``hpcfl report``-able; a finished one
is reused, an unfinished one resumed, a diverged one reported as such); the script writes
``<out>/accuracy.{md,csv,json,png}`` (the protocol's tables, curves with ± std bands; the paper's
CIFAR-10 numbers beside, for orientation) and prints the markdown.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from _runs import Setting, column_targets, run_protocol, write_tables

from hpcfl.report.protocol import Protocol

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
    p.add_argument("--lrs", type=float, nargs="+", default=[0.01, 0.05], help="lr candidates")
    p.add_argument("--validation", type=float, default=0.05, help="held-out share for the lr choice")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seeds", type=int, default=3, help="seeds at the chosen lr (0, 1, ...)")
    p.add_argument("--last", type=int, default=5, help="k of the last-k mean (evaluated rounds)")
    p.add_argument("--window", type=int, default=3, help="running-mean window of rounds to target")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel (processes)")
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--no-cka-metrics", action="store_true", help="skip the per-layer CKA rows")
    p.add_argument("--out", type=Path, default=Path("bench-out/fedcka_acc"))
    return p.parse_args(argv)


def config(args: argparse.Namespace, partition: str, algorithm: str) -> dict[str, Any]:
    """The run config of ``algorithm`` on ``partition`` (without lr and seed)."""
    cfg: dict[str, Any] = dict(
        dataset="fashion-mnist",
        partition=partition,
        num_clients=args.clients,
        model=args.model,
        algorithm=algorithm,
        rounds=args.rounds,
        local_epochs=args.local_epochs,
        local_steps=args.local_steps or None,
        momentum=0.9,
        weight_decay=1e-5,
        batch_size=args.batch,
        validation=args.validation,
        threads=args.threads,
        progress=False,
        eval_every=args.eval_every,
        cka_metrics=not args.no_cka_metrics,
        **ALGORITHMS[algorithm],
    )
    if args.data_root:
        cfg["data_root"] = args.data_root
    return cfg


def paper_markdown(args: argparse.Namespace) -> str:
    """The paper's CIFAR-10 numbers for orientation (other data and budget)."""
    lines = ["| method | " + " | ".join(args.partitions) + " |", "|---|" + "---:|" * len(args.partitions)]
    for algorithm in args.algorithms:
        cells = [f"{PAPER_TABLE2[algorithm].get(p, float('nan')):.2f}" for p in args.partitions]
        lines.append(f"| {algorithm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    protocol = Protocol(last_k=args.last, window=args.window)
    t0 = time.perf_counter()
    settings = [
        Setting(algorithm, partition, config(args, partition, algorithm), tuple(args.lrs))
        for partition in args.partitions
        for algorithm in args.algorithms
    ]
    cells = run_protocol(
        settings, seeds=list(range(args.seeds)), out=args.out, jobs=args.jobs, protocol=protocol
    )
    targets = column_targets(cells, args.partitions, protocol)
    local = f"{args.local_steps} local steps" if args.local_steps else f"{args.local_epochs} local epoch(s)"
    header = (
        "# FedCKA Table 2's grid on Fashion-MNIST\n\n"
        f"**Budget.** {args.model}, {args.clients} clients, {args.rounds} rounds × {local} (batch "
        f"{args.batch}), evaluation every {args.eval_every} round(s), momentum 0.9, weight decay 1e-5; lr "
        f"chosen from {args.lrs} on a {100 * args.validation:g}% validation split at seed 0, then "
        f"{args.seeds} seeds; μ fixed (FedProx 0.01, MOON 1 with τ 0.5, FedCKA 3); {args.jobs} run(s) at a "
        f"time × {args.threads} thread(s); wall time {time.perf_counter() - t0:.0f} s (finished runs count 0)."
    )
    text = write_tables(cells, protocol, targets, args.out / "accuracy", header)
    text += "\nThe paper's CIFAR-10 top-1 accuracy (%), for orientation only (other data and budget):\n\n"
    text += paper_markdown(args) + "\n"
    (args.out / "accuracy.md").write_text(text)
    print(text)
    print(f"wrote {args.out}/accuracy.{{csv,md,json,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
