"""Clients per device (issue 63): how many clients one process can train at once before memory runs out.

For each model (simplecnn, resnet8 on Fashion-MNIST-shaped data) and each group size N, a fresh
spawned process trains ONE vectorised group of N clients (``client_batch: N``; every client the
same size, ``--samples`` samples, one local epoch of batch ``--batch``) after a warm-up group, and
reports the peak memory that round adds: the process's peak RSS above its resident size before
the round on the CPU, ``torch.cuda.max_memory_allocated`` above the allocated bytes on a GPU. The
slope of peak memory over N (least squares) is the **memory per client**; beside it, the estimate
``client_batch: auto`` sizes groups by (:func:`hpcfl.runner.executor.client_footprint`), the group
``auto`` picks on this device, and the clients that fit at once in the device's memory
(``MemAvailable`` on the CPU, the total on a GPU): (memory − base) / per client, and in the share
``auto`` allows itself (``AUTO_MEMORY_SHARE``).

``client_batch: auto`` on the CPU trains one client at a time (batching does not pay there), so
the clients PER ROUND a CPU process can train are not bounded by memory at all: the ``auto`` row
(N clients in groups of what ``auto`` picks) shows the peak staying that of one client. The group
sizes are the bound on a GPU, where ``auto`` groups clients.

    python benchmarks/clients_per_device.py                         # CPU, about 3 minutes idle
    python benchmarks/clients_per_device.py --device cuda --groups 1 64 256 1024 --tag cuda

FedScale's published figure is about 19 clients per GPU. Writes
``benchmarks/results/clients_per_device_<device>[_TAG].json`` and prints a table. Synthetic data
of Fashion-MNIST's shape (1×28×28, 10 classes): the figure depends on the shape, not the pixels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from hpcfl.bench.machine import with_machine

RESULTS = Path(__file__).resolve().parent / "results"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(
    model_name: str, group: int | str, clients: int, samples: int, batch: int, device: str
) -> dict[str, Any]:
    """One round of ``clients`` clients trained in groups of ``group`` (``auto``: what it resolves
    to), in this (fresh) process: the peak memory it adds and the footprint estimate."""
    import resource

    import torch

    from hpcfl.algorithms import ClientState, FedAvg, Trainer
    from hpcfl.algorithms.base import ClientContext, ClientData
    from hpcfl.algorithms.participation import Population
    from hpcfl.data import load_dataset
    from hpcfl.models import build_model
    from hpcfl.runner.executor import ClientExecutor, client_footprint, resolve_client_batch
    from hpcfl.runner.federation import client_generator
    from hpcfl.training.flat import FlatModel
    from hpcfl.training.layout import StateLayout
    from hpcfl.training.sgd import LocalSchedule

    torch.set_num_threads(1)
    dev = torch.device(device)
    ds = load_dataset("synthetic", None, n_train=samples * (clients + 1), n_test=10, seed=0)
    torch.manual_seed(0)
    flat = FlatModel(build_model(model_name, ds.input_shape, ds.num_classes).to(dev))
    algo = FedAvg(FedAvg.Params(), layout=StateLayout.of_model(flat.model))
    trainer = Trainer(flat, LocalSchedule(lr=0.05, batch_size=batch, epochs=1, momentum=0.0))
    server = algo.init_server(flat.vector.clone())
    x, y = ds.train.x.to(dev), ds.train.y.to(dev)
    data = {
        k: ClientData(k, x[k * samples : (k + 1) * samples], y[k * samples : (k + 1) * samples])
        for k in range(clients + 1)
    }
    population = Population((samples,) * (clients + 1))
    size = resolve_client_batch(group, trainer, data[0].x[:1], samples)
    executor = ClientExecutor(size)

    def one_round(ids: list[int], rnd: int) -> None:
        def context(k: int) -> ClientContext:
            return ClientContext(rnd, tuple(ids), population, trainer, client_generator(0, rnd, k))

        for _k, upload, _state in executor.run(
            algo, server, trainer, ids, lambda k: ClientState(), data.__getitem__, context
        ):
            assert upload is not None
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    row: dict[str, Any] = {
        "model": model_name,
        "group": str(group),
        "resolved": size,
        "clients": clients,
        "device": device,
    }
    row["footprint_mib"] = client_footprint(trainer, data[0].x[:1], samples) / 2**20
    try:
        one_round([clients], 0)  # warm-up: one client (kernels, allocator); then the measured round
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        else:
            base = _rss_bytes()
        one_round(list(range(clients)), 1)
    except torch.cuda.OutOfMemoryError:
        return {**row, "peak_mib": float("nan"), "note": "out of GPU memory"}
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev) - base
        row["memory_mib"] = torch.cuda.get_device_properties(dev).total_memory / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
        row["memory_mib"] = _mem_available() / 2**20
    return {**row, "peak_mib": max(peak, 0) / 2**20, "note": ""}


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _slope(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of peak MiB over group size."""
    n = len(points)
    mx = sum(p for p, _ in points) / n
    my = sum(v for _, v in points) / n
    sxx = sum((p - mx) ** 2 for p, _ in points)
    slope = sum((p - mx) * (v - my) for p, v in points) / sxx if sxx else float("nan")
    return slope, my - slope * mx


def per_group(rows: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(N, peak MiB) of the measured groups the slope is fitted to: N >= 2 (a group of one adds
    nothing above the warm-up's one client) where two such groups were measured, and no failed one."""
    points = [
        (int(r["group"]), r["peak_mib"])
        for r in rows
        if r["group"] != "auto" and r["peak_mib"] == r["peak_mib"]
    ]
    several = [(n, v) for n, v in points if n >= 2]
    return several if len(several) >= 2 else points


def main() -> int:
    from hpcfl.runner.executor import AUTO_MEMORY_SHARE

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["simplecnn", "resnet8"])
    ap.add_argument("--groups", nargs="+", type=int, default=[1, 4, 16, 32])
    ap.add_argument("--samples", type=int, default=128, help="samples per client")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tag", default="")
    ap.add_argument(
        "--out", type=Path, default=RESULTS, help="folder of the JSON (default benchmarks/results)"
    )
    args = ap.parse_args()
    ctx = get_context("spawn")
    out: dict[str, Any] = {
        "device": args.device,
        "samples_per_client": args.samples,
        "batch": args.batch,
        "models": {},
    }
    print(f"{'model':10s} {'N':>5s} {'peak MiB':>9s}", flush=True)
    for model in args.models:
        rows = []
        for n in [*args.groups, "auto"]:
            clients = max(args.groups) if n == "auto" else n
            with ProcessPoolExecutor(1, mp_context=ctx) as pool:
                row = pool.submit(measure, model, n, clients, args.samples, args.batch, args.device).result()
            rows.append(row)
            print(
                f"{model:10s} {str(n):>5s} {row['peak_mib']:9.1f}  (groups of {row['resolved']}) {row['note']}",
                flush=True,
            )
        grouped = per_group(rows)
        slope, intercept = _slope(grouped)
        auto = rows[-1]
        memory = rows[0]["memory_mib"]
        fits = int((memory - max(intercept, 0)) // slope) if slope > 0 else None
        summary = {
            "rows": rows,
            "per_client_mib": slope,
            "base_mib": intercept,
            "footprint_estimate_mib": rows[0]["footprint_mib"],
            "auto_group": auto["resolved"],
            "auto_peak_mib_for_clients": [auto["clients"], auto["peak_mib"]],
            "memory_mib": memory,
            "clients_at_once_fit": fits,
            "clients_at_once_in_auto_share": int(AUTO_MEMORY_SHARE * memory // slope) if slope > 0 else None,
        }
        out["models"][model] = summary
        print(
            f"{model}: {slope:.2f} MiB per client measured (auto's estimate {summary['footprint_estimate_mib']:.2f}); "
            f"{fits} clients at once fit in {memory / 1024:.1f} GiB; auto trains groups of {auto['resolved']} "
            f"({auto['clients']} clients: peak {auto['peak_mib']:.1f} MiB)",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"clients_per_device_{args.device.split(':')[0]}" + (f"_{args.tag}" if args.tag else "")
    (args.out / f"{name}.json").write_text(json.dumps(with_machine(out), indent=1) + "\n")
    print(f"wrote {args.out / name}.json", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
