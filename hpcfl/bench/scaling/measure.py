"""Measurement inside one world (every rank runs this): the world's layout, one configuration's
round timings through the real round loop, and the allreduce micro-benchmark."""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpcfl.bench.scaling.defaults import LAUNCHED_VARS, PROBE_SIZES
from hpcfl.bench.scaling.perfmodel import fit_alpha_beta


def launched() -> bool:
    """True when this process was started by an MPI launcher or srun (not by a plain shell or the
    batch script of an sbatch job)."""
    return any(v in os.environ for v in LAUNCHED_VARS)


def usable_cores() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def world_info(comm: Any, threads: int) -> dict[str, Any]:
    """Nodes, ranks per node and whether ranks × threads exceed the cores the ranks may use."""
    me = (socket.gethostname(), sorted(usable_cores()))
    everyone = comm.allgather(me)
    per_node: dict[str, list[set[int]]] = {}
    for host, cores in everyone:
        per_node.setdefault(host, []).append(set(cores))

    def used(sets: list[set[int]]) -> int:  # threads per rank (0: hpcfl's cores / local ranks)
        return threads if threads > 0 else max(1, len(set().union(*sets)) // len(sets))

    over = any(len(sets) * used(sets) > len(set().union(*sets)) for sets in per_node.values())
    return {
        "nodes": len(per_node),
        "hosts": sorted(per_node),
        "ranks_per_node": max(len(s) for s in per_node.values()),
        "cores_per_node": min(len(set().union(*s)) for s in per_node.values()),
        "oversubscribed": over,
    }


def slurm_meta() -> dict[str, Any]:
    return {
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
    }


def _mpi_version() -> str:
    from hpcfl.comm import mpi_library_version

    try:
        return mpi_library_version()
    except Exception:  # noqa: BLE001 - informational only
        return "no MPI"


def measure_point(cfg: Any, comm: Any, *, warmup: int) -> dict[str, Any]:
    """Run ``cfg.rounds`` rounds of the real round loop on ``comm``; return the timing row
    (on every rank; fields described in the module docstring)."""
    import tempfile

    import torch

    from hpcfl.data import clear_dataset_cache
    from hpcfl.runner.experiment import RecordingBook, drive_stages, run_stages, set_threads
    from hpcfl.runner.federation import build_federation
    from hpcfl.runner.rounds import round_layout

    set_threads(cfg, comm)
    fed = build_federation(cfg, comm)
    comm.barrier()
    with tempfile.TemporaryDirectory() as tmp:  # the run driver itself, its rows kept in memory
        book = RecordingBook(Path(tmp), comm)
        server, _ = drive_stages(fed, run_stages(cfg), Path(tmp), None, book)
    # eval_every = 1: every round has its row
    mine = [(row["compute_s"], row["allreduce_s"], row["eval_s"]) for row in book.rows]
    every = comm.allgather((mine, len(fed.owned)))
    K = len(fed.parts)
    sizes = [int(p.numel()) for p in fed.parts]
    steps = cfg.local_steps
    samples = sum(sizes) * cfg.local_epochs if steps is None else K * steps * cfg.batch_size
    algo = fed.algorithm
    L = sum(spec.length for spec in algo.exchange(server.x.dtype).sums)
    from hpcfl.runner.federation import model_plan

    layout = round_layout(model_plan(fed), K, server.x.dtype)
    per_round = []
    for i in range(warmup, cfg.rounds):
        comp = [m[i][0] for m, _ in every]
        ar = [m[i][1] for m, _ in every]
        per_round.append(
            {
                "compute_s": max(comp),
                "compute_mean_s": statistics.fmean(comp),
                "allreduce_s": min(ar),
                "allreduce_wait_s": max(ar) - min(ar),
                "train_s": max(c + a for c, a in zip(comp, ar, strict=True)),
                "eval_s": max(m[i][2] for m, _ in every),
            }
        )
    row: dict[str, Any] = {
        f: statistics.median(r[f] for r in per_round)
        for f in ("compute_s", "compute_mean_s", "allreduce_s", "allreduce_wait_s", "train_s", "eval_s")
    }
    row["imbalance"] = row["compute_s"] / row["compute_mean_s"] if row["compute_mean_s"] > 0 else 1.0
    row.update(
        config=cfg.name,
        model=cfg.model,
        algorithm=cfg.algorithm,
        dataset=cfg.dataset,
        clients=K,
        ranks=comm.size,
        clients_per_rank_max=max(n for _, n in every),
        samples_per_client=sizes[0] if len(set(sizes)) == 1 else None,
        samples_per_round=samples,
        test_samples=int(fed.dataset.test.y.numel()),
        payload_floats=L,
        buffer_bytes=layout.nbytes(torch.float64 if cfg.reduction == "float64" else server.x.dtype),
        params=fed.flat.num_params,
        rounds=cfg.rounds,
        warmup=warmup,
        timed_rounds=len(per_round),
        per_round=per_round,
        torch_threads=torch.get_num_threads(),
        device=str(fed.device),
    )
    del fed, server, book
    clear_dataset_cache()
    return row


def probe_allreduce(
    comm: Any, sizes: Sequence[int] = PROBE_SIZES, *, budget_s: float = 0.25, max_reps: int = 200
) -> dict[str, Any]:
    """Allreduce micro-benchmark at the current world: float32 buffers of ``sizes`` bytes, through
    the same :class:`~hpcfl.comm.Communicator` the round loop uses. Each size is repeated until
    ``budget_s`` or ``max_reps`` (at least 3), each repetition after a barrier, its time the
    slowest rank's; the best repetition is kept (noise on shared cores only adds time), the median
    is recorded too. α, β: :func:`fit_alpha_beta` on the best times."""
    import torch

    best, median = [], []
    for n in sizes:
        buf = torch.ones(max(1, n // 4), dtype=torch.float32)  # host: the host allreduce path
        comm.allreduce(buf)  # warm the path for this size
        times: list[float] = []
        t_start = time.perf_counter()
        while True:
            comm.barrier()
            t0 = time.perf_counter()
            comm.allreduce(buf)
            times.append(time.perf_counter() - t0)
            more = len(times) < 3 or (len(times) < max_reps and time.perf_counter() - t_start < budget_s)
            if not comm.bcast(more):  # rank 0 decides, so every rank runs the same repetitions
                break
        slowest = [max(ts) for ts in zip(*comm.allgather(times), strict=True)]
        best.append(min(slowest))
        median.append(statistics.median(slowest))
    alpha, beta = fit_alpha_beta((comm.size, n, t) for n, t in zip(sizes, best, strict=True))
    return {
        "ranks": comm.size,
        "sizes_bytes": list(sizes),
        "seconds_best": best,
        "seconds_median": median,
        "alpha_s": alpha,
        "beta_Bps": beta,
        "fit": "ring model t = 2(R-1)a + 2(R-1)/R n/b, relative least squares on the best times",
        "mpi": _mpi_version(),
    }
