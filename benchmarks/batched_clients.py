"""Batched clients: samples/s of one round's local training, clients one by one vs vectorised groups.

Fashion-MNIST (IID over K clients), FedAvg, one local epoch, batch 64, lr 0.05; simplecnn and
resnet8 (BatchNorm); K ∈ {10, 100, 1,000}; ``client_batch`` N = 1 (sequential, the reference) and
the groups N of ``--batches`` (``all`` = K; ``auto`` = what ``client_batch: auto`` picks). Each
(model, K, N, repeat) runs in a fresh spawned process, so the peak memory is its own: the process's
peak RSS above its resident size before the round on the CPU, ``torch.cuda.max_memory_allocated``
on a GPU. Repeats interleave the N so a drifting machine hurts every N alike; the timed round comes
after a warm-up round of one group. Training time only (the executor's loop with FedAvg's uploads
summed), no evaluation or allreduce. Also reported: the largest relative difference of the summed
uploads from the sequential ones, beside a yardstick for float32 rounding: the same difference of a
sequential run in float64 (``--no-yardstick`` skips it). Over many local steps rounding differences
grow (training amplifies them), so the batched difference is judged against the yardstick of the
same run, not against a fixed bound.

Prints a table with the ratio batched / sequential samples/s and writes CSV, JSON and PNG to
``--out``.

    python benchmarks/batched_clients.py --threads 2                     # CPU
    python benchmarks/batched_clients.py --device cuda                   # GPU (target >= 5x at K = 100)
    python benchmarks/batched_clients.py --quick                         # a few seconds, synthetic data
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from hpcfl.bench.machine import with_machine, with_machine_columns
from hpcfl.files import write_csv

REPO = Path(__file__).resolve().parents[1]


def measure(
    model_name: str,
    clients: int,
    batch: int | str,
    device: str,
    threads: int,
    data_root: str | None,
    quick: bool,
    float64: bool = False,
) -> dict[str, Any]:
    """One round of local training of ``clients`` clients in groups of ``batch`` (in a fresh process)."""
    import resource

    import torch

    from hpcfl.algorithms import ClientState, FedAvg, Trainer
    from hpcfl.algorithms.base import ClientContext, ClientData
    from hpcfl.algorithms.participation import Population
    from hpcfl.data import load_dataset, partition
    from hpcfl.models import build_model
    from hpcfl.runner.executor import ClientExecutor, resolve_client_batch
    from hpcfl.runner.federation import client_generator
    from hpcfl.training.flat import FlatModel
    from hpcfl.training.layout import StateLayout
    from hpcfl.training.sgd import LocalSchedule

    torch.set_num_threads(threads)
    if quick:
        ds = load_dataset("synthetic", None, n_train=40 * clients, n_test=10, seed=0)
    else:
        ds = load_dataset("fashion-mnist", data_root)
    parts = partition(ds.train.y, "iid", clients, seed=0, num_classes=ds.num_classes)
    dev = torch.device(device)
    dtype = torch.float64 if float64 else torch.float32
    torch.manual_seed(0)
    flat = FlatModel(build_model(model_name, ds.input_shape, ds.num_classes).to(dev, dtype))
    algo = FedAvg(FedAvg.Params(), layout=StateLayout.of_model(flat.model))
    trainer = Trainer(flat, LocalSchedule(lr=0.05, batch_size=64, epochs=1, momentum=0.0))
    server = algo.init_server(flat.vector.clone())
    data = {
        k: ClientData(k, ds.train.x[p].to(dev, dtype), ds.train.y[p].to(dev)) for k, p in enumerate(parts)
    }
    population = Population(tuple(int(p.numel()) for p in parts))
    setting = clients if batch == "all" else batch
    group = resolve_client_batch(setting, trainer, data[0].x[:1], max(population.sizes))
    executor = ClientExecutor(group)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def one_round(ids: list[int], rnd: int) -> torch.Tensor:
        total = torch.zeros(flat.size, dtype=torch.float64, device=dev)

        def context(k: int) -> ClientContext:
            return ClientContext(rnd, tuple(ids), population, trainer, client_generator(0, rnd, k))

        for _k, upload, _state in executor.run(
            algo, server, trainer, ids, lambda k: ClientState(), data.__getitem__, context
        ):
            assert upload is not None
            total.add_(upload.sums["x"].to(torch.float64), alpha=upload.weight)
        sync()
        return total

    ids = list(range(clients))
    samples = sum(population.sizes)
    row = {
        "model": model_name,
        "clients": clients,
        "client_batch": str(batch),
        "group": group,
        "device": device,
        "threads": threads,
        "samples": samples,
    }
    try:
        one_round(ids[:group], 0)  # warm-up: kernels, allocator, vmap tracing
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        else:
            base = _rss_bytes()
        t0 = time.perf_counter()
        total = one_round(ids, 1)
        seconds = time.perf_counter() - t0
    except torch.cuda.OutOfMemoryError:  # a group too large for the GPU: reported, not fatal
        return {
            **row,
            "seconds": float("nan"),
            "samples_per_s": float("nan"),
            "peak_mib": float("nan"),
            "sum": None,
            "note": "out of GPU memory",
        }
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev) - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {
        **row,
        "seconds": seconds,
        "samples_per_s": samples / seconds,
        "peak_mib": max(peak, 0) / 2**20,
        "sum": total.cpu(),
        "note": "",
    }


def _rel_diff(a: Any, ref: Any) -> float:
    """max |a − ref| / max |ref| (NaN when either run did not finish)."""
    if a is None or ref is None:
        return float("nan")
    return float(((a - ref).abs().max() / ref.abs().max()).item())


def _rss_bytes() -> int:
    """This process's resident memory now (Linux /proc)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    ctx = get_context("spawn")
    rows: list[dict[str, Any]] = []
    for model in args.models:
        for clients in args.clients:
            batches: list[int | str] = [1]
            for b in args.batches:
                b = b if b in ("all", "auto") else int(b)
                if isinstance(b, int) and b >= clients:
                    b = "all"
                if b not in batches:
                    batches.append(b)
            runs: dict[str, list[dict[str, Any]]] = {str(b): [] for b in batches}
            for rep in range(args.repeats):
                for b in batches[rep % len(batches) :] + batches[: rep % len(batches)]:
                    with ProcessPoolExecutor(1, mp_context=ctx) as pool:
                        row = pool.submit(
                            measure, model, clients, b, args.device, args.threads, args.data_root, args.quick
                        ).result()
                    runs[str(b)].append(row)
                    print(
                        f"  {model} K={clients} N={b} repeat {rep + 1}/{args.repeats}: "
                        f"{row['samples_per_s']:,.0f} samples/s, peak {row['peak_mib']:.0f} MiB",
                        flush=True,
                    )
            seq = statistics.median(r["samples_per_s"] for r in runs["1"])
            ref = runs["1"][0]["sum"]
            yardstick = float("nan")
            if args.yardstick:
                with ProcessPoolExecutor(1, mp_context=ctx) as pool:
                    exact = pool.submit(
                        measure,
                        model,
                        clients,
                        1,
                        args.device,
                        args.threads,
                        args.data_root,
                        args.quick,
                        True,
                    ).result()
                yardstick = _rel_diff(ref, exact["sum"])
                print(f"  {model} K={clients}: float32 vs float64 sequential, rel. diff {yardstick:.1e}")
            for reps in runs.values():
                best = max(reps, key=lambda r: r["samples_per_s"])
                rows.append(
                    {
                        **{k: v for k, v in best.items() if k != "sum"},
                        "samples_per_s": statistics.median(r["samples_per_s"] for r in reps),
                        "samples_per_s_all": [r["samples_per_s"] for r in reps],
                        "ratio_vs_sequential": statistics.median(r["samples_per_s"] for r in reps) / seq,
                        "peak_mib": max(r["peak_mib"] for r in reps),
                        "max_rel_diff": _rel_diff(best["sum"], ref),
                        "float32_vs_float64": yardstick,
                    }
                )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | clients | client_batch | group | samples/s | × sequential | peak MiB | rel. diff "
        "| float32 vs float64 | note |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['clients']} | {r['client_batch']} | {r['group']} | {r['samples_per_s']:,.0f} | "
            f"{r['ratio_vs_sequential']:.2f} | {r['peak_mib']:.0f} | {r['max_rel_diff']:.1e} | "
            f"{r['float32_vs_float64']:.1e} | {r['note']} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(2, len(models), figsize=(5.5 * len(models), 7), squeeze=False)
    for j, model in enumerate(models):
        mine = [r for r in rows if r["model"] == model]
        for b in dict.fromkeys(r["client_batch"] for r in mine):
            pts = sorted(
                (r["clients"], r["samples_per_s"], r["peak_mib"]) for r in mine if r["client_batch"] == b
            )
            label = "sequential" if b == "1" else f"client_batch {b}"
            axes[0][j].plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
            axes[1][j].plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=label)
        axes[0][j].set(xscale="log", yscale="log", title=f"{model}: training samples/s", xlabel="clients")
        axes[1][j].set(xscale="log", title=f"{model}: peak memory (MiB)", xlabel="clients")
        axes[0][j].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["simplecnn", "resnet8"])
    parser.add_argument("--clients", nargs="+", type=int, default=[10, 100, 1000])
    parser.add_argument(
        "--batches",
        nargs="+",
        default=None,
        help="group sizes beside 1: numbers, all (= K), auto (what client_batch: auto picks: 1 on the CPU) "
        "(default: 10 100 all auto)",
    )
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (CPU)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per setting (median reported)")
    parser.add_argument(
        "--data-root", default=os.environ.get("HPCFL_DATA"), help="dataset dir (default $HPCFL_DATA)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="synthetic data, simplecnn, K = 4 and 8, 1 repeat"
    )
    parser.add_argument(
        "--no-yardstick",
        dest="yardstick",
        action="store_false",
        help="skip the float64 sequential run that measures float32 rounding (one per model and K)",
    )
    parser.add_argument("--out", type=Path, default=None, help="default benchmarks/results/batched_clients")
    args = parser.parse_args()
    if args.batches is None:
        args.batches = ["10", "100", "all", "auto"]
    if args.quick:
        args.models, args.clients, args.repeats = ["simplecnn"], [4, 8], 1
        args.batches = ["3", "all"]
    out = args.out or REPO / "benchmarks" / (
        "out/batched_clients_quick" if args.quick else "results/batched_clients"
    )
    out.mkdir(parents=True, exist_ok=True)
    rows = run_grid(args)
    print()
    print(table(rows))
    print()
    for model in dict.fromkeys(r["model"] for r in rows):
        for clients in dict.fromkeys(r["clients"] for r in rows):
            mine = [r for r in rows if r["model"] == model and r["clients"] == clients]
            batched = [
                r
                for r in mine
                if r["group"] > 1 and r["ratio_vs_sequential"] == r["ratio_vs_sequential"]  # not NaN (OOM)
            ]
            if batched:
                best = max(batched, key=lambda r: r["ratio_vs_sequential"])
                print(
                    f"{model}, {clients} clients: best batched / sequential = {best['ratio_vs_sequential']:.2f}x "
                    f"(client_batch {best['client_batch']}, {best['peak_mib']:.0f} MiB peak)"
                )
            for r in mine:
                if r["client_batch"] == "auto" and r["group"] == 1:  # the sequential path under another name
                    print(
                        f"{model}, {clients} clients: auto trains one by one; its ratio "
                        f"{r['ratio_vs_sequential']:.2f}x is this machine's run-to-run noise"
                    )
    tag = f"{args.device}_{args.threads}t" if args.device == "cpu" else args.device
    tag += "_" + "-".join(args.models)
    rows = with_machine_columns(rows, args.threads if args.device == "cpu" else None)
    fields = [k for k in rows[0] if k != "samples_per_s_all"]
    write_csv(out / f"batched_clients_{tag}.csv", rows, fields, extrasaction="ignore")
    (out / f"batched_clients_{tag}.json").write_text(
        json.dumps(with_machine({"args": vars(args) | {"out": str(out)}, "rows": rows}), indent=2)
    )
    plot(rows, out / f"batched_clients_{tag}.png")
    print(f"\nwritten: {out}/batched_clients_{tag}.csv, .json, .png", file=sys.stderr)


if __name__ == "__main__":
    main()
