"""Local-epoch time of FedCKA and MOON relative to FedAvg (FedCKA paper, Table 4).

    python benchmarks/fedcka_local_epoch_time.py --threads 1 --out bench-out/fedcka_time

One client with ``--samples`` CIFAR-shaped (3×32×32) synthetic samples trains ``cnn-proj`` with batch
64, SGD + momentum 0.9, from the same global state; FedCKA and MOON get a previous local model, so
their regularised path runs (from round 2 on). FedAvg, FedCKA and MOON are timed in the same
process, interleaved (the order rotates every repeat), ``--repeats`` times per number of local
epochs E; the figure is the median time per local epoch (round time / E), as wall clock and as the
thread's CPU time (steadier on a shared machine). The paper measured, per round with E = 10 on a
GPU, FedCKA 104.17 s and MOON 97.58 s against FedAvg's 54.82 s: 1.90× and 1.78×.

The frozen copies are built and the truncation point learned in an untimed warm-up (once per run,
not per round). Writes ``local_epoch_time.{csv,json,png}`` under ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hpcfl.algorithms import ALGORITHMS, ClientData, Trainer
from hpcfl.algorithms.base import ClientContext
from hpcfl.algorithms.fedcka import FedCKAParams
from hpcfl.algorithms.moon import MoonParams
from hpcfl.algorithms.participation import Population
from hpcfl.bench.machine import with_machine, with_machine_columns
from hpcfl.files import write_csv
from hpcfl.models import build_model
from hpcfl.training import FlatModel, LocalSchedule
from hpcfl.training.layout import StateLayout

PAPER_RATIO = {"fedavg": 1.0, "fedcka": 104.17 / 54.82, "moon": 97.58 / 54.82}  # Table 4, 7-layer CNN
TARGET_RATIO = {"fedavg": 1.0, "fedcka": 1.25, "moon": 1.5}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="cnn-proj")
    p.add_argument("--samples", type=int, default=5000, help="samples of the one client")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=int, nargs="+", default=[1, 10], help="local epochs E to measure")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--fedcka-mu", type=float, default=3.0)
    p.add_argument("--moon-mu", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-out/fedcka_time"))
    return p.parse_args(argv)


def _setup(args: argparse.Namespace) -> tuple[FlatModel, ClientData, dict[str, Any], dict[str, Any], Any]:
    torch.manual_seed(args.seed)
    flat = FlatModel(build_model(args.model, (3, 32, 32), 10))
    g = torch.Generator().manual_seed(args.seed)
    data = ClientData(
        0,
        torch.randn(args.samples, 3, 32, 32, generator=g),
        torch.randint(0, 10, (args.samples,), generator=g),
    )
    params = {"fedavg": None, "fedcka": FedCKAParams(mu=args.fedcka_mu), "moon": MoonParams(mu=args.moon_mu)}
    algos = {
        name: ALGORITHMS[name](p or ALGORITHMS[name].Params(), layout=StateLayout.of_model(flat.model))
        for name, p in params.items()
    }
    x0 = flat.vector.clone()
    server = algos["fedavg"].init_server(x0)
    prev = x0 + 0.01 * torch.randn(x0.shape, generator=g)  # stands in for last round's local model
    states = {}
    for name, algo in algos.items():
        states[name] = algo.init_client(0, server)
        if hasattr(states[name], "prev"):
            states[name].prev = prev
    return flat, data, algos, states, server


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Median per-epoch times of every algorithm for every E."""
    torch.set_num_threads(args.threads)
    flat, data, algos, states, server = _setup(args)
    names = list(algos)
    warm = Trainer(flat, LocalSchedule(lr=0.01, batch_size=args.batch, steps=2, momentum=0.9))
    for name in names:  # builds the frozen copies, learns the truncation point
        algos[name].client_update(
            server, states[name], data, client_context(warm, torch.Generator().manual_seed(0))
        )
    rows = []
    for epochs in args.epochs:
        trainer = Trainer(flat, LocalSchedule(lr=0.01, batch_size=args.batch, epochs=epochs, momentum=0.9))
        wall: dict[str, list[float]] = {n: [] for n in names}
        cpu: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(args.repeats):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                gen = torch.Generator().manual_seed(rep)
                t0, c0 = time.perf_counter(), time.thread_time()
                algos[name].client_update(server, states[name], data, client_context(trainer, gen))
                wall[name].append((time.perf_counter() - t0) / epochs)
                cpu[name].append((time.thread_time() - c0) / epochs)
                print(
                    f"  E={epochs} repeat {rep + 1}/{args.repeats} {name}: {wall[name][-1]:.3f} s/epoch",
                    flush=True,
                )
        base_w, base_c = statistics.median(wall["fedavg"]), statistics.median(cpu["fedavg"])
        for name in names:
            w, c = statistics.median(wall[name]), statistics.median(cpu[name])
            rows.append(
                {
                    "epochs": epochs,
                    "algorithm": name,
                    "wall_s_per_epoch": w,
                    "cpu_s_per_epoch": c,
                    "wall_ratio": w / base_w,
                    "cpu_ratio": c / base_c,
                    "paper_ratio": PAPER_RATIO[name],
                    "target_ratio": TARGET_RATIO[name],
                    "wall_all": wall[name],
                    "cpu_all": cpu[name],
                }
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| E | algorithm | wall s/epoch | × FedAvg (wall) | CPU s/epoch | × FedAvg (CPU) | target | paper (E=10, GPU) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['epochs']} | {r['algorithm']} | {r['wall_s_per_epoch']:.3f} | {r['wall_ratio']:.2f} | "
            f"{r['cpu_s_per_epoch']:.3f} | {r['cpu_ratio']:.2f} | ≤ {r['target_ratio']:.2f} | {r['paper_ratio']:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = sorted({r["epochs"] for r in rows})
    names = [n for n in ("fedavg", "fedcka", "moon") if any(r["algorithm"] == n for r in rows)]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    width = 0.8 / len(epochs)
    for i, e in enumerate(epochs):
        vals = [next(r["cpu_ratio"] for r in rows if r["epochs"] == e and r["algorithm"] == n) for n in names]
        ax.bar([j + i * width for j in range(len(names))], vals, width, label=f"E = {e} (this run)")
    ax.scatter(
        [j + 0.4 - width / 2 for j in range(len(names))],
        [PAPER_RATIO[n] for n in names],
        marker="x",
        color="k",
        zorder=3,
        label="paper, Table 4",
    )
    for j, n in enumerate(names):
        ax.hlines(TARGET_RATIO[n], j - width / 2, j + 0.8 - width / 2, colors="r", linestyles="--")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
    ax.set_ylabel("local-epoch time / FedAvg (CPU time)")
    ax.set_title("cnn-proj, batch 64, 1 thread (red: targets)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def client_context(trainer: Trainer, gen: torch.Generator) -> ClientContext:
    """One client's context in round 0 (the benchmark times single client updates)."""
    return ClientContext(0, (0,), Population((1,)), trainer, gen)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()
    t0 = time.time()
    rows = measure(args)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = with_machine_columns(rows, args.threads)
    keys = [k for k in rows[0] if not k.endswith("_all")]
    write_csv(args.out / "local_epoch_time.csv", rows, keys, extrasaction="ignore")
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__,
        "threads": args.threads,
        "cpu": platform.processor() or platform.machine(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "seconds": time.time() - t0,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (args.out / "local_epoch_time.json").write_text(
        json.dumps(with_machine({"meta": meta, "rows": rows}, args.threads), indent=1)
    )
    plot(rows, args.out / "local_epoch_time.png")
    print(table(rows))
    print(f"load average before/after: {load_before} / {meta['load_average_after']}")
    print(f"wrote {args.out}/local_epoch_time.{{csv,json,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
