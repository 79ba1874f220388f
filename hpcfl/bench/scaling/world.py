"""World mode: measure every configuration of the options at the current world size."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

from hpcfl.bench.scaling.defaults import PROBE_FILE, ROWS_FILE
from hpcfl.bench.scaling.measure import measure_point, probe_allreduce, slurm_meta, world_info
from hpcfl.bench.scaling.report import summarize
from hpcfl.errors import EXIT_RESUMABLE


class _StopFlag:
    """SIGUSR1/SIGTERM (SLURM time limit, preemption): finish the configuration in flight, exit 75."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            try:
                signal.signal(sig, self._handle)
            except (ValueError, OSError):  # pragma: no cover - not the main thread
                pass

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True


def base_config(args: argparse.Namespace) -> dict[str, Any]:
    """The config every point starts from: the CONFIG file (+ --set) or the synthetic default."""
    from hpcfl.config import merge, parse_overrides, read_yaml

    if args.config:
        data = read_yaml(args.config)
        data.setdefault("name", Path(args.config).stem)
    else:
        data = {
            "name": "scaling",
            "dataset": "synthetic",
            "partition": "iid",
            "algorithm": "fedavg",
            "local_epochs": 1,
            "batch_size": 64,
            "lr": 0.01,
        }
    return merge(data, parse_overrides(args.set))


def point_config(base: dict[str, Any], args: argparse.Namespace, model: str, clients: int) -> Any:
    """The validated :class:`~hpcfl.config.Config` of one configuration."""
    from hpcfl.config import config_from_dict, merge

    over: dict[str, Any] = {
        "model": model,
        "num_clients": clients,
        "rounds": args.rounds,
        "eval_every": 1,  # every round reports its time split (evaluation is amortised later)
        "checkpoint_every": max(1, args.rounds),
        "threads": args.threads if args.threads > 0 else None,
        "progress": False,
    }
    data = merge(base, over)
    if data.get("dataset", "fashion-mnist") == "synthetic":
        spc = args.samples_per_client or 200
        options = dict(data.get("dataset_options") or {})
        if args.samples_per_client or not args.config:
            options["n_train"] = spc * clients
        options.setdefault("n_test", args.test_samples)
        options.setdefault("num_classes", 10)
        options.setdefault("input_shape", [1, 28, 28])
        options.setdefault("seed", 0)
        data["dataset_options"] = options
    return config_from_dict(data)


def world_points(args: argparse.Namespace, base: dict[str, Any], ranks: int) -> list[tuple[str, int]]:
    """(model, K) pairs to measure at ``ranks`` ranks: --models × (--clients ∪ {--clients-per-rank·R})."""
    models = args.models or [base.get("model", "simplecnn")]
    clients = list(args.clients or [int(base.get("num_clients", 10))])
    if args.clients_per_rank:
        clients.append(args.clients_per_rank * ranks)
    ks = sorted({k for k in clients if k >= ranks})
    return [(m, k) for m in models for k in ks]


def run_world(args: argparse.Namespace) -> int:
    """World mode: measure every point of the options at the current world size, append rows."""
    from hpcfl.comm import get_comm
    from hpcfl.files import append_jsonl, read_jsonl

    comm = get_comm("auto")
    stop = _StopFlag()
    stop.install()
    base = base_config(args)
    info = world_info(comm, args.threads)
    meta = slurm_meta()
    out: Path = args.out
    points = world_points(args, base, comm.size)
    skipped = [
        (m, k)
        for m in (args.models or [base.get("model", "simplecnn")])
        for k in (args.clients or [])
        if k < comm.size
    ]
    done: set[tuple[Any, ...]] = set()
    if comm.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if meta["slurm_job_id"]:  # a requeued job skips what an earlier run of it measured
            for r in read_jsonl(out / ROWS_FILE):
                if (
                    r.get("slurm_job_id") == meta["slurm_job_id"]
                    and r.get("slurm_restart_count", 0) < meta["slurm_restart_count"]
                    and r.get("ranks") == comm.size
                ):
                    done.add((r["model"], r["clients"]))
        for m, k in skipped:
            print(f"hpcfl: skip {m} K={k} at R={comm.size}: every rank needs a client", flush=True)
    done = comm.bcast(done)
    import torch

    for model, k in points:
        if (model, k) in done:
            if comm.rank == 0:
                print(f"hpcfl: {model} K={k} R={comm.size} already measured by this job", flush=True)
            continue
        cfg = point_config(base, args, model, k)
        row = measure_point(cfg, comm, warmup=args.warmup)
        if comm.rank == 0:
            row.update(info, **meta, threads=args.threads, time=time.time(), command=" ".join(sys.argv))
            append_jsonl(out / ROWS_FILE, row)
            eval_part = row["eval_s"] / args.eval_every
            print(
                f"hpcfl: {model} K={k} R={comm.size} nodes={info['nodes']}"
                f"{' (oversubscribed)' if info['oversubscribed'] else ''}: "
                f"{1 / (row['train_s'] + eval_part):.3f} rounds/s, compute {row['compute_s']:.3f}s "
                f"allreduce {row['allreduce_s'] * 1e3:.2f}ms eval {row['eval_s']:.3f}s",
                flush=True,
            )
        flag = torch.tensor([float(stop.requested)], dtype=torch.float64)  # host: a stop flag
        if comm.allreduce(flag).item() > 0:
            if comm.rank == 0:
                print("hpcfl: stopped by a signal; rerun (requeue) to measure the rest", file=sys.stderr)
            return EXIT_RESUMABLE
    if comm.size > 1 and not args.no_probe:
        probe = probe_allreduce(comm, budget_s=args.probe_budget)
        if comm.rank == 0:
            probe.update(info, **meta, time=time.time())
            append_jsonl(out / PROBE_FILE, probe)
            print(
                f"hpcfl: allreduce probe at R={comm.size}: alpha {probe['alpha_s'] * 1e6:.2f} us, "
                f"beta {probe['beta_Bps'] / 1e9:.2f} GB/s",
                flush=True,
            )
    if comm.rank == 0 and not args.worker:
        summarize(out, out, args)
    comm.barrier()
    return 0
