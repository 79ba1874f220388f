"""``hpcfl bench scaling``: round throughput over ranks, clients and models, and a projection.

What is measured, and why this way
----------------------------------
One *configuration* is (model, K clients, R ranks, T threads per rank). It runs the real round
loop (:func:`hpcfl.runner.rounds.run_rounds` over :func:`hpcfl.runner.federation.build_federation`,
exactly what ``hpcfl run`` executes, minus checkpoints and file output) for ``--rounds`` rounds of
FedAvg with one local epoch. The first ``--warmup`` round(s) are dropped (allocator, thread pools
and MPI connections warm up there); every later round is timed. The loop's own metrics row — the
one ``hpcfl run`` appends to ``metrics.jsonl``: ``compute_s`` (local updates), ``allreduce_s`` and
``eval_s`` (server step + sharded evaluation) — is collected from **every** rank, not only rank 0,
because under a synchronous allreduce rank 0's ``allreduce_s`` also contains the time it waited
for slower ranks. Per timed round:

- ``compute_s``   = max over ranks of the local work (the critical path),
- ``allreduce_s`` = min over ranks of the allreduce time (the collective itself, seen by the rank
  that arrived last), ``allreduce_wait_s`` = max − min (idle time of faster ranks: imbalance),
- ``train_s``     = max over ranks of compute + allreduce (the training part of a round),
- ``eval_s``      = max over ranks of the evaluation.

Each is the median over the timed rounds. Evaluation runs in every timed round so its cost is
known, but a run evaluates only every ``--eval-every`` N rounds, so a round is charged
``round_s = train_s + eval_s / N`` (default N = 5). From that:

- rounds/s = 1 / round_s; samples/s = training samples of a round / round_s;
- strong-scaling efficiency at fixed K: E_s(R) = R₀·T(R₀, K) / (R·T(R, K)), R₀ the smallest rank
  count measured (1 in the default sweep, so E_s = T(1)/(R·T(R)));
- weak-scaling efficiency with K ∝ R: E_w(R) = T(R₀, K·R₀/R) / T(R, K) where that base point was
  measured (the default sweep adds K = 25·R, so (1, 25) → (2, 50) → (4, 100) is one weak series,
  (1, 50) → (2, 100) another). E_w can exceed 1: the test set is fixed, so each rank's
  evaluation shard shrinks as R grows.

The data is synthetic (:func:`hpcfl.data.synthetic.make_synthetic`, FMNIST-shaped 1×28×28, 10
classes) with a FIXED number of samples per client (``--samples-per-client``, default 200), so the
work of a round is proportional to K and strong and weak scaling come from the same sweep. The
test set (``--test-samples``) has a fixed size. Threads: one torch thread per rank by default
(``--threads``); a configuration with more ranks × threads on a node than that node has cores is
labelled ``oversubscribed`` (MPICH lets R exceed the cores; the ranks then time-share cores, and
MPICH's busy-polling in the allreduce takes cycles from ranks still computing).

Modes
-----
- **launcher** (default when started without MPI): for every configuration spawn
  ``mpiexec -n R python -m hpcfl bench scaling --worker ...`` (R = 1 runs without mpiexec), plus an
  allreduce micro-benchmark at 2 ranks; then summarise. ``--repeats N`` makes N whole passes
  over the configurations (the fastest of each is reported), so a busy spell on shared cores
  lands on every configuration rather than on one.
- **world** (started by ``srun``/``mpiexec`` — as ``slurm/scaling_sweep.sbatch`` does — or with
  ``--mode world``): measure the current world only (every model × K of the options, K ≥ R) and
  append one row per configuration, with SLURM_JOB_ID, node count and ranks, to
  ``OUT/scaling_rows.jsonl``, so repeated jobs at different node counts accumulate; a requeued job
  skips the configurations it already measured. With ≥ 2 ranks the allreduce probe runs too.
- **summarize** (``--summarize DIR``): rebuild table, CSV, JSON and PNGs from every
  ``scaling_rows.jsonl`` / ``allreduce_probe.jsonl`` under DIR (when a configuration was measured
  more than once, the fastest measurement is kept: noise only ever adds time).

Projection (a model, not a measurement)
---------------------------------------
Round time at R ranks and K clients::

    T(R, K) = ceil(K/R)·c + t_ar(R, 4·(L + K + 2)) + (e₁/R + t_ar(R, 24)) / N
    t_ar(R, n) = 2(R−1)·α + 2(R−1)/R · n/β                  (ring allreduce)

c is the measured per-client local-update time (median of compute_s / ceil(K/R) over the
model's rows at the smallest measured R), ``ceil`` models stragglers (the rank with the most
clients sets the pace), L the model's float32 parameters (the allreduced buffer also carries K
non-finite flags, the weight and the loss), e₁ the evaluation time at one rank (sharded: /R; its 3 float64 counts are
allreduced). α and β come from two sources, both reported: (1) the allreduce micro-benchmark
(``allreduce_probe.jsonl``: float32 allreduce over message sizes 8 B … 32 MiB, best of the
repeats, fitted to the ring formula by relative least squares) — on this machine that is MPICH
over shared memory inside ONE node, so it is optimistic for a network; under SLURM across nodes
the probe with the most nodes is used; (2) an InfiniBand-like α = 2 µs, β = 10 GB/s (typical
of HDR/NDR fabrics after MPI overheads; ``--ib-alpha``/``--ib-beta`` change it). The
projection covers R = 1 … ``--project-ranks`` (512) for strong scaling at K = 1000 and weak
scaling at K = 10·R. It ignores per-rank jitter (real stragglers), memory-bandwidth contention
between ranks of a node, hierarchical (node-aware) allreduce algorithms and start-up.

Outputs in ``--out`` (default ``benchmarks/out/scaling``): ``scaling_rows.jsonl`` (raw rows),
``allreduce_probe.jsonl``, ``scaling.csv``, ``scaling.json`` (rows + projection + method),
``scaling.png`` (strong / weak efficiency and projected rounds/s per model) and
``scaling_time_split.png`` (stacked compute / allreduce / evaluation per configuration).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HELP = "round throughput vs ranks × clients × models: strong/weak efficiency, time split, projection"
DEFAULT_OUT = Path("benchmarks/out/scaling")
ROWS_FILE = "scaling_rows.jsonl"
PROBE_FILE = "allreduce_probe.jsonl"
EXIT_RESUMABLE = 75  # as `hpcfl run`: stopped by SIGUSR1/SIGTERM, the sweep requeues
DEFAULT_MODELS = ("simplecnn", "resnet8")
DEFAULT_CLIENTS = (10, 50, 100)
DEFAULT_CLIENTS_PER_RANK = 25
DEFAULT_RANKS = (1, 2, 4)
IB_ALPHA_S = 2e-6  # InfiniBand-like latency per message step
IB_BETA_BPS = 10e9  # InfiniBand-like bandwidth, bytes/s (~HDR 100 Gb/s after protocol overheads)
PROJECTION_LABEL = "PROJECTION (latency/bandwidth model from measured per-client time; not measured)"
PROBE_SIZES = tuple(8 * 4**i for i in range(12))  # 8 B … 32 MiB
# environment variables present only in a process started by an MPI launcher or by srun (the
# batch script of an sbatch job has SLURM_* but neither of these)
_LAUNCHED_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_ID")


# ---------------------------------------------------------------------------------------------
# Pure arithmetic: efficiencies, the allreduce model and the projection (tested on made-up data)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Network:
    """α (seconds per message step) and β (bytes/s) of the ring-allreduce model, and their origin."""

    name: str
    alpha_s: float
    beta_Bps: float
    source: str


def ring_allreduce_s(ranks: int, nbytes: float, alpha_s: float, beta_Bps: float) -> float:
    """Ring allreduce time t = 2(R−1)·α + 2(R−1)/R · n/β (0 at one rank)."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) * alpha_s + 2 * (ranks - 1) / ranks * nbytes / beta_Bps


def fit_alpha_beta(samples: Iterable[tuple[int, float, float]]) -> tuple[float, float]:
    """Fit (α, β) of :func:`ring_allreduce_s` to (ranks, bytes, seconds) samples.

    Least squares on the *relative* error (each equation divided by its time), so 8-byte latencies
    weigh as much as 32 MiB transfers; α and 1/β are kept non-negative. Returns (α, β) with
    β = inf when the sizes carry no bandwidth term.
    """
    import numpy as np

    rows = [(2.0 * (r - 1), 2.0 * (r - 1) / r * n, t) for r, n, t in samples if r > 1 and t > 0]
    if not rows:
        raise ValueError("fit_alpha_beta needs samples at 2 or more ranks with positive times")
    a = np.array([[x1 / t, x2 / t] for x1, x2, t in rows])
    b = np.ones(len(rows))
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, b, rcond=None)
    if alpha < 0 or inv_beta < 0:  # one term alone: the better non-negative one-parameter fit
        fits = []
        for col in (0, 1):
            x = a[:, col]
            coef = max(float(x @ b / (x @ x)), 0.0)
            fits.append((float(((x * coef - b) ** 2).sum()), col, coef))
        _, col, coef = min(fits)
        alpha, inv_beta = (coef, 0.0) if col == 0 else (0.0, coef)
    return float(alpha), (1.0 / float(inv_beta) if inv_beta > 0 else math.inf)


def strong_efficiency(t_base: float, r_base: int, t: float, r: int) -> float:
    """R₀·T(R₀) / (R·T(R)) at a fixed problem: 1 is perfect, 0.5 means half the ranks idle."""
    return (r_base * t_base) / (r * t)


def weak_efficiency(t_base: float, t: float) -> float:
    """T(R₀, K₀) / T(R, K₀·R/R₀): 1 when R times the work on R times the ranks takes as long."""
    return t_base / t


@dataclass(frozen=True)
class ComputeModel:
    """Per-model inputs of the projection, all measured (see the module docstring)."""

    model: str
    per_client_s: float  # local update of one client (one epoch over samples_per_client)
    eval_1rank_s: float  # evaluation of the fixed test set on one rank
    payload_floats: int  # L: float32 entries of one upload
    samples_per_client: int
    eval_every: int
    source: str  # which measured row the numbers come from


def projected_round(cm: ComputeModel, net: Network, ranks: int, clients: int) -> dict[str, float]:
    """Projected time split of one round at R ranks and K clients (see the module docstring)."""
    if ranks > clients:
        raise ValueError(f"{ranks} ranks need at least as many clients, got {clients}")
    compute = math.ceil(clients / ranks) * cm.per_client_s
    buffer_bytes = 4 * (cm.payload_floats + clients + 2)
    allreduce = ring_allreduce_s(ranks, buffer_bytes, net.alpha_s, net.beta_Bps)
    evaluation = cm.eval_1rank_s / ranks + ring_allreduce_s(ranks, 24, net.alpha_s, net.beta_Bps)
    round_s = compute + allreduce + evaluation / cm.eval_every
    return {
        "compute_s": compute,
        "allreduce_s": allreduce,
        "eval_s": evaluation,
        "round_s": round_s,
        "rounds_per_s": 1.0 / round_s,
        "samples_per_s": clients * cm.samples_per_client / round_s,
        "allreduce_share": allreduce / round_s,
    }


def project(
    cm: ComputeModel, net: Network, ranks: Sequence[int], clients_of: Callable[[int], int], kind: str
) -> list[dict[str, Any]]:
    """Projected rows over ``ranks`` with K = ``clients_of(R)``; efficiency against ranks[0].

    ``kind`` ``strong`` (K fixed): E = R₀·T(R₀)/(R·T(R)); ``weak`` (K ∝ R): E = T(R₀)/T(R).
    """
    rows: list[dict[str, Any]] = []
    base: dict[str, float] | None = None
    for r in ranks:
        k = clients_of(r)
        if r > k:
            continue
        p = projected_round(cm, net, r, k)
        if base is None:
            base, r0 = p, r
        eff = (
            strong_efficiency(base["round_s"], r0, p["round_s"], r)
            if kind == "strong"
            else weak_efficiency(base["round_s"], p["round_s"])
        )
        rows.append(
            {
                "projection": True,
                "kind": kind,
                "model": cm.model,
                "network": net.name,
                "ranks": r,
                "clients": k,
                **p,
                "efficiency": eff,
            }
        )
    return rows


def powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, … up to ``limit``."""
    out, r = [], 1
    while r <= limit:
        out.append(r)
        r *= 2
    return out


# ---------------------------------------------------------------------------------------------
# Aggregating raw rows into the report
# ---------------------------------------------------------------------------------------------

_KEY = ("config", "model", "clients", "ranks", "nodes", "threads", "samples_per_client")


def row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two measurements the same configuration."""
    return tuple(row.get(k) for k in _KEY)


def summarize_rows(raw: Sequence[dict[str, Any]], eval_every: int) -> list[dict[str, Any]]:
    """One summary row per configuration: the fastest of its measurements, round time with
    evaluation amortised over ``eval_every`` rounds, shares, and both scaling efficiencies."""
    best: dict[tuple[Any, ...], dict[str, Any]] = {}
    count: dict[tuple[Any, ...], int] = {}
    jobs: dict[tuple[Any, ...], set[str]] = {}
    for row in raw:
        key = row_key(row)
        count[key] = count.get(key, 0) + 1
        if row.get("slurm_job_id"):
            jobs.setdefault(key, set()).add(str(row["slurm_job_id"]))
        t = row["train_s"] + row["eval_s"] / eval_every
        kept = best.get(key)
        if kept is None or t < kept["train_s"] + kept["eval_s"] / eval_every:
            best[key] = row
    rows = []
    for key, row in best.items():
        round_s = row["train_s"] + row["eval_s"] / eval_every
        rows.append(
            {
                **{k: row.get(k) for k in _KEY},
                "oversubscribed": bool(row.get("oversubscribed")),
                "ranks_per_node": row.get("ranks_per_node"),
                "eval_every": eval_every,
                "round_s": round_s,
                "rounds_per_s": 1.0 / round_s,
                "samples_per_s": row["samples_per_round"] / round_s,
                "compute_s": row["compute_s"],
                "allreduce_s": row["allreduce_s"],
                "allreduce_wait_s": row.get("allreduce_wait_s", 0.0),
                "eval_s": row["eval_s"],
                "train_s": row["train_s"],
                "compute_share": row["compute_s"] / round_s,
                "allreduce_share": row["allreduce_s"] / round_s,
                "eval_share": row["eval_s"] / eval_every / round_s,
                "imbalance": row.get("imbalance", 1.0),
                "samples_per_round": row["samples_per_round"],
                "payload_floats": row.get("payload_floats"),
                "buffer_bytes": row.get("buffer_bytes"),
                "timed_rounds": row.get("timed_rounds"),
                "measurements": count[key],
                "slurm_job_ids": ",".join(sorted(jobs.get(key, ()))),
            }
        )
    rows.sort(key=lambda r: (str(r["config"]), str(r["model"]), r["clients"], r["ranks"], r["nodes"]))
    add_efficiencies(rows)
    return rows


def add_efficiencies(rows: list[dict[str, Any]]) -> None:
    """Set ``strong_eff``/``strong_base`` and ``weak_eff``/``weak_base`` on every row (None where
    no base point was measured). Rows are grouped by (config, model, threads, samples/client);
    the base is the smallest rank count of the group (fewest nodes at equal ranks)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        key = (row["config"], row["model"], row["threads"], row["samples_per_client"])
        groups.setdefault(key, []).append(row)
    for group in groups.values():
        r0 = min(r["ranks"] for r in group)
        base_at = {}
        for r in sorted(group, key=lambda r: (r["ranks"], r["nodes"])):
            base_at.setdefault((r["ranks"], r["clients"]), r)
        for row in group:
            row["strong_eff"] = row["strong_base"] = row["weak_eff"] = row["weak_base"] = None
            b = base_at.get((r0, row["clients"]))
            if b is not None and row["ranks"] > r0:
                row["strong_eff"] = strong_efficiency(b["round_s"], r0, row["round_s"], row["ranks"])
                row["strong_base"] = f"R={r0},K={row['clients']}"
            k0, rem = divmod(row["clients"] * r0, row["ranks"])
            wb = base_at.get((r0, k0)) if rem == 0 else None
            if wb is not None and row["ranks"] > r0:
                row["weak_eff"] = weak_efficiency(wb["round_s"], row["round_s"])
                row["weak_base"] = f"R={r0},K={k0}"


def select_probe(probes: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The probe the projection uses: most nodes, then most ranks, then the latest."""
    if not probes:
        return None
    return max(probes, key=lambda p: (p.get("nodes", 1), p.get("ranks", 2), p.get("time", 0)))


def compute_models(rows: Sequence[dict[str, Any]], eval_every: int) -> list[ComputeModel]:
    """Per model, the projection inputs: the MEDIAN over its rows at the smallest measured rank
    count (fewest nodes; oversubscribed rows only when nothing else was measured) of the
    per-client compute time compute_s / ceil(K/R) and of the one-rank evaluation time eval_s·R.
    The median over several client counts is less exposed to one noisy run than any single row."""
    out = []
    by_model: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(r)
    for model, group in sorted(by_model.items()):
        first = min((r["oversubscribed"], r["ranks"], r["nodes"]) for r in group)
        src = sorted(
            (r for r in group if (r["oversubscribed"], r["ranks"], r["nodes"]) == first),
            key=lambda r: r["clients"],
        )
        per_client = statistics.median(r["compute_s"] / math.ceil(r["clients"] / r["ranks"]) for r in src)
        out.append(
            ComputeModel(
                model=model,
                per_client_s=per_client,
                eval_1rank_s=statistics.median(r["eval_s"] * r["ranks"] for r in src),
                payload_floats=int(src[0]["payload_floats"]),
                samples_per_client=int(src[0]["samples_per_round"] // src[0]["clients"]),
                eval_every=eval_every,
                source=(
                    f"median of {model} R={first[1]} nodes={first[2]} K="
                    + ",".join(str(r["clients"]) for r in src)
                    + f" threads={src[0]['threads']}"
                ),
            )
        )
    return out


def networks(probe: dict[str, Any] | None, ib_alpha: float, ib_beta: float) -> list[Network]:
    """The measured network (from the allreduce probe, when there is one) and the IB-like one."""
    nets = []
    if probe is not None:
        where = "shared-memory MPI on one node" if probe.get("nodes", 1) == 1 else "across nodes"
        nets.append(
            Network(
                name="measured",
                alpha_s=probe["alpha_s"],
                beta_Bps=probe["beta_Bps"],
                source=(
                    f"allreduce probe, {probe['ranks']} ranks on {probe.get('nodes', 1)} node(s) "
                    f"({where}; {probe.get('mpi', 'MPI')})"
                ),
            )
        )
    nets.append(
        Network(
            name="IB-like",
            alpha_s=ib_alpha,
            beta_Bps=ib_beta,
            source=f"assumed InfiniBand-like: alpha={ib_alpha * 1e6:g} us, beta={ib_beta / 1e9:g} GB/s",
        )
    )
    return nets


def build_projection(
    rows: Sequence[dict[str, Any]],
    probe: dict[str, Any] | None,
    *,
    eval_every: int,
    max_ranks: int,
    strong_clients: int,
    weak_clients_per_rank: int,
    ib_alpha: float = IB_ALPHA_S,
    ib_beta: float = IB_BETA_BPS,
) -> dict[str, Any]:
    """The projection section of the report (strong at K = strong_clients, weak at K = c·R)."""
    cms = compute_models(rows, eval_every)
    nets = networks(probe, ib_alpha, ib_beta)
    ranks = powers_of_two(max_ranks)
    strong, weak = [], []
    for cm in cms:
        for net in nets:
            strong += project(cm, net, ranks, lambda r: strong_clients, "strong")
            weak += project(cm, net, ranks, lambda r: weak_clients_per_rank * r, "weak")
    return {
        "label": PROJECTION_LABEL,
        "method": (
            "T(R,K) = ceil(K/R)*c + t_ar(R, 4*(L+K+2)) + (e1/R + t_ar(R, 24))/N; "
            "t_ar(R,n) = 2(R-1)*alpha + 2(R-1)/R*n/beta (ring allreduce); c = measured per-client "
            "local-update time, e1 = measured evaluation time at one rank, N = eval_every"
        ),
        "ignores": (
            "per-rank jitter, memory-bandwidth contention inside a node, node-aware allreduce "
            "algorithms, start-up"
        ),
        "inputs": [asdict(cm) for cm in cms],
        "networks": [asdict(n) for n in nets],
        "strong": {"clients": strong_clients, "rows": strong},
        "weak": {"clients_per_rank": weak_clients_per_rank, "rows": weak},
    }


# ---------------------------------------------------------------------------------------------
# Measurement inside one world (every rank runs this)
# ---------------------------------------------------------------------------------------------


def launched() -> bool:
    """True when this process was started by an MPI launcher or srun (not by a plain shell or the
    batch script of an sbatch job)."""
    return any(v in os.environ for v in _LAUNCHED_VARS)


def _cores() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def world_info(comm: Any, threads: int) -> dict[str, Any]:
    """Nodes, ranks per node and whether ranks × threads exceed the cores the ranks may use."""
    me = (socket.gethostname(), sorted(_cores()))
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


def _slurm_meta() -> dict[str, Any]:
    return {
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
    }


def _mpi_version() -> str:
    try:
        from mpi4py import MPI

        return MPI.Get_library_version().splitlines()[0].strip()
    except Exception:  # noqa: BLE001 - informational only
        return "no MPI"


def measure_point(cfg: Any, comm: Any, *, warmup: int) -> dict[str, Any]:
    """Run ``cfg.rounds`` rounds of the real round loop on ``comm``; return the timing row
    (on every rank; fields described in the module docstring)."""
    import torch

    from hpcfl.data import clear_dataset_cache
    from hpcfl.runner.experiment import set_threads
    from hpcfl.runner.federation import build_federation, model_plan
    from hpcfl.runner.rounds import run_rounds

    set_threads(cfg, comm)
    fed = build_federation(cfg, comm)
    plan = model_plan(fed)
    algo = fed.algorithm
    server = algo.init_server(fed.flat.vector)
    clients = {k: algo.init_client(k, server) for k in fed.owned}
    mine: list[tuple[float, float, float]] = []

    def record(done: int, srv: Any, cls: Any, row: dict[str, Any] | None) -> bool:
        if row is not None:  # eval_every = 1: every round has its row
            mine.append((row["compute_s"], row["allreduce_s"], row["eval_s"]))
        return False

    comm.barrier()
    run_rounds(plan, server, clients, 0, cfg.rounds, hook=record)
    every = comm.allgather((mine, len(fed.owned)))
    K = len(fed.parts)
    sizes = [int(p.numel()) for p in fed.parts]
    steps = cfg.local_steps
    samples = sum(sizes) * cfg.local_epochs if steps is None else K * steps * cfg.batch_size
    L = algo.payload_size()
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
        buffer_bytes=(L + K + 2) * server.x.element_size(),
        params=fed.flat.num_params,
        rounds=cfg.rounds,
        warmup=warmup,
        timed_rounds=len(per_round),
        per_round=per_round,
        torch_threads=torch.get_num_threads(),
        device=str(fed.device),
    )
    del fed, plan, server, clients
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
        buf = torch.ones(max(1, n // 4), dtype=torch.float32)
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
    meta = _slurm_meta()
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
        flag = torch.tensor([float(stop.requested)], dtype=torch.float64)
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


# ---------------------------------------------------------------------------------------------
# Launcher mode
# ---------------------------------------------------------------------------------------------


def _mpiexec(args: argparse.Namespace) -> str:
    if args.mpiexec:
        return args.mpiexec
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        from hpcfl.errors import CommError

        raise CommError("mpiexec not found next to python or on PATH; pass --mpiexec or --ranks 1")
    return found


def _worker_argv(args: argparse.Namespace, model: str, clients: int, probe_only: bool) -> list[str]:
    argv = [sys.executable, "-m", "hpcfl", "bench", "scaling"]
    if args.config:
        argv.append(str(args.config))
    argv += ["--worker", "--out", str(args.out), "--models", model, "--clients", str(clients)]
    argv += ["--clients-per-rank", "0", "--rounds", str(args.rounds), "--warmup", str(args.warmup)]
    argv += ["--threads", str(args.threads), "--test-samples", str(args.test_samples)]
    argv += ["--eval-every", str(args.eval_every), "--probe-budget", str(args.probe_budget)]
    if args.samples_per_client:
        argv += ["--samples-per-client", str(args.samples_per_client)]
    if probe_only:
        argv += ["--probe-only"]
    else:
        argv += ["--no-probe"]
    if args.set:
        argv += ["--set", *args.set]
    return argv


def _spawn(args: argparse.Namespace, ranks: int, argv: list[str]) -> tuple[int, str, float]:
    import hpcfl

    env = dict(os.environ)
    if args.threads > 0:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    root = str(Path(hpcfl.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    cmd = argv if ranks == 1 else [_mpiexec(args), "-n", str(ranks), *argv]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        return 124, out + f"\n(timed out after {args.timeout} s)", time.perf_counter() - t0
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0


def run_launcher(args: argparse.Namespace) -> int:
    """Launcher mode: one worker launch per configuration (+ the 2-rank allreduce probe)."""
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if not args.append:
        for name in (ROWS_FILE, PROBE_FILE):
            if (out / name).exists():
                (out / name).replace(out / (name + ".prev"))
    base = base_config(args)
    configs = [(r, m, k) for r in args.ranks for m, k in world_points(args, base, r)]
    plan = configs * args.repeats  # whole passes, so a busy spell on shared cores is not one config's
    cores = len(_cores())
    print(
        f"hpcfl bench scaling: {len(configs)} configurations x {args.repeats} pass(es), ranks "
        f"{args.ranks}, {cores} cores here, {args.rounds} rounds each (first {args.warmup} dropped) "
        f"-> {out}",
        flush=True,
    )
    failed = 0
    for i, (r, m, k) in enumerate(plan, 1):
        over = " (oversubscribed)" if r * max(args.threads, 1) > cores else ""
        print(f"[{i}/{len(plan)}] {m} K={k} R={r}{over} ...", end=" ", flush=True)
        rc, text, wall = _spawn(args, r, _worker_argv(args, m, k, probe_only=False))
        if rc != 0:
            failed += 1
            tail = "\n    ".join(text.strip().splitlines()[-8:])
            print(f"FAILED (exit {rc}) after {wall:.0f}s:\n    {tail}", flush=True)
            continue
        line = [s for s in text.splitlines() if s.startswith("hpcfl: ")]
        print((line[-1].split(": ", 2)[-1] if line else "done") + f"  [{wall:.0f}s]", flush=True)
    if not args.no_probe and max(args.ranks) >= 2:
        print("allreduce probe at 2 ranks ...", end=" ", flush=True)
        rc, text, _ = _spawn(args, 2, _worker_argv(args, args.models[0] if args.models else "mlp", 2, True))
        line = [s for s in text.splitlines() if "probe" in s]
        print(line[-1].split(": ", 2)[-1] if rc == 0 and line else f"FAILED (exit {rc}): {text[-300:]}")
    summarize(out, out, args)
    return 1 if failed == len(plan) else 0


def run_probe_only(args: argparse.Namespace) -> int:
    """``--probe-only``: just the allreduce micro-benchmark at the current world."""
    from hpcfl.comm import get_comm
    from hpcfl.files import append_jsonl

    comm = get_comm("auto")
    if comm.size < 2:
        from hpcfl.errors import CommError

        raise CommError("the allreduce probe needs at least 2 ranks: mpiexec -n 2 ... --probe-only")
    info = world_info(comm, args.threads)
    probe = probe_allreduce(comm, budget_s=args.probe_budget)
    if comm.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        probe.update(info, **_slurm_meta(), time=time.time())
        append_jsonl(args.out / PROBE_FILE, probe)
        print(
            f"hpcfl: allreduce probe at R={comm.size}: alpha {probe['alpha_s'] * 1e6:.2f} us, "
            f"beta {probe['beta_Bps'] / 1e9:.2f} GB/s",
            flush=True,
        )
    return 0


# ---------------------------------------------------------------------------------------------
# Report: table, CSV, JSON, PNG
# ---------------------------------------------------------------------------------------------

CSV_FIELDS = (
    "config",
    "model",
    "clients",
    "ranks",
    "nodes",
    "ranks_per_node",
    "threads",
    "oversubscribed",
    "samples_per_client",
    "rounds_per_s",
    "samples_per_s",
    "round_s",
    "compute_s",
    "allreduce_s",
    "allreduce_wait_s",
    "eval_s",
    "eval_every",
    "compute_share",
    "allreduce_share",
    "eval_share",
    "imbalance",
    "strong_eff",
    "strong_base",
    "weak_eff",
    "weak_base",
    "buffer_bytes",
    "timed_rounds",
    "measurements",
    "slurm_job_ids",
)


def _f(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The measured rows as a markdown table."""
    head = (
        "| model | K | R | nodes | note | rounds/s | samples/s | compute s | allreduce ms | "
        "eval s (÷N) | allreduce % | E strong | E weak |\n"
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['clients']} | {r['ranks']} | {r['nodes']} | "
            f"{'oversubscribed' if r['oversubscribed'] else ''} | {r['rounds_per_s']:.3f} | "
            f"{r['samples_per_s']:,.0f} | {r['compute_s']:.3f} | {r['allreduce_s'] * 1e3:.2f} | "
            f"{r['eval_s']:.3f} (÷{r['eval_every']}) | {100 * r['allreduce_share']:.2f} | "
            f"{_f(r['strong_eff'], '.3f')} | {_f(r['weak_eff'], '.3f')} |"
        )
    return "\n".join(lines)


def format_projection(proj: dict[str, Any], ranks: Sequence[int] = (1, 8, 64, 512)) -> str:
    """A compact table of the projection (selected rank counts)."""
    lines = [
        f"{proj['label']}",
        *(f"  network {n['name']}: {n['source']}" for n in proj["networks"]),
        "| kind | model | network | R | K | rounds/s | allreduce % | efficiency |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for kind in ("strong", "weak"):
        for p in proj[kind]["rows"]:
            if p["ranks"] in ranks:
                lines.append(
                    f"| {kind} (projection) | {p['model']} | {p['network']} | {p['ranks']} | "
                    f"{p['clients']} | {p['rounds_per_s']:.3f} | {100 * p['allreduce_share']:.2f} | "
                    f"{p['efficiency']:.3f} |"
                )
    return "\n".join(lines)


def acceptance(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Issue #5 figures: allreduce share of simplecnn at 2 ranks (≤ 5%), E_s 1→2 ranks (≥ 0.9)."""
    two = [r for r in rows if r["model"] == "simplecnn" and r["ranks"] == 2 and r["threads"] == 1]
    if not two:
        return {}
    return {
        "allreduce_share_simplecnn_2_ranks": {
            "values": {str(r["clients"]): r["allreduce_share"] for r in two},
            "max": max(r["allreduce_share"] for r in two),
            "required_max": 0.05,
        },
        "strong_eff_simplecnn_1_to_2_ranks": {
            "values": {str(r["clients"]): r["strong_eff"] for r in two},
            "min": min((r["strong_eff"] for r in two if r["strong_eff"] is not None), default=None),
            "required_min": 0.9,
        },
    }


def _plot(rows: Sequence[dict[str, Any]], proj: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(len(models), 3, figsize=(16, 4.2 * len(models)), squeeze=False)
    styles = {"measured": "--", "IB-like": ":"}  # projection lines: one style per network model
    colors = {"measured": "black", "IB-like": "dimgray"}
    for ax_row, model in zip(axes, models, strict=True):
        mine = [r for r in rows if r["model"] == model]
        strong_ax, weak_ax, rate_ax = ax_row
        for k in sorted({r["clients"] for r in mine}):
            pts = sorted(
                (r for r in mine if r["clients"] == k and r["strong_eff"] is not None),
                key=lambda r: r["ranks"],
            )
            if pts:
                r0 = min(r["ranks"] for r in mine if r["clients"] == k)
                xs = [r0] + [r["ranks"] for r in pts]
                strong_ax.plot(xs, [1.0] + [r["strong_eff"] for r in pts], "o-", label=f"measured K={k}")
                over = [r for r in pts if r["oversubscribed"]]
                strong_ax.plot([r["ranks"] for r in over], [r["strong_eff"] for r in over], "kx", ms=9)
        weak = {}
        for r in mine:
            if r["weak_eff"] is not None:
                weak.setdefault(r["weak_base"], []).append(r)
        for base_name, pts in sorted(weak.items()):
            pts.sort(key=lambda r: r["ranks"])
            r0 = int(base_name.split(",")[0][2:])
            k0 = int(base_name.split("K=")[1])
            xs = [r0] + [r["ranks"] for r in pts]
            weak_ax.plot(xs, [1.0] + [r["weak_eff"] for r in pts], "o-", label=f"measured {k0}/rank")
            over = [r for r in pts if r["oversubscribed"]]
            weak_ax.plot([r["ranks"] for r in over], [r["weak_eff"] for r in over], "kx", ms=9)
        for kind, ax in (("strong", strong_ax), ("weak", weak_ax)):
            what = (
                f"K={proj['strong']['clients']}"
                if kind == "strong"
                else f"K={proj['weak']['clients_per_rank']}·R"
            )
            for net in proj["networks"]:
                p = [q for q in proj[kind]["rows"] if q["model"] == model and q["network"] == net["name"]]
                if not p:
                    continue
                xs = [q["ranks"] for q in p]
                style = dict(ls=styles.get(net["name"], "-."), color=colors.get(net["name"], "gray"))
                label = f"PROJECTION {kind} {what}, {net['name']} α,β"
                ax.plot(xs, [q["efficiency"] for q in p], label=label, **style)
                style["color"] = "tab:blue" if kind == "strong" else "tab:red"
                rate_ax.plot(xs, [q["rounds_per_s"] for q in p], label=label, **style)
            ax.set_xscale("log", base=2)
            if any(r["oversubscribed"] for r in mine):
                ax.plot([], [], "kx", ms=9, label="oversubscribed (ranks x threads > cores)")
            top = max([1.15] + [q["efficiency"] + 0.05 for q in proj[kind]["rows"] if q["model"] == model])
            top = max([top] + [r[f"{kind}_eff"] + 0.05 for r in mine if r[f"{kind}_eff"] is not None])
            ax.set_ylim(0, top)
            ax.axhline(1.0, color="gray", lw=0.5)
            ax.set_xlabel("ranks")
            ax.set_ylabel(f"{kind}-scaling efficiency")
            ax.set_title(f"{model}: {kind} scaling")
            ax.legend(fontsize=7)
        rate_ax.set_xscale("log", base=2)
        rate_ax.set_yscale("log")
        rate_ax.set_xlabel("ranks")
        rate_ax.set_ylabel("rounds / s")
        rate_ax.set_title(f"{model}: projected rounds/s (PROJECTION)")
        rate_ax.legend(fontsize=7)
    fig.suptitle(
        "hpcfl bench scaling — measured (solid) and PROJECTION (dashed/dotted: ring allreduce model)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_split(rows: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(max(6, 0.55 * len(rows) + 3), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        mine = sorted(
            (r for r in rows if r["model"] == model), key=lambda r: (r["clients"], r["ranks"], r["nodes"])
        )
        labels = [
            f"K{r['clients']}\nR{r['ranks']}"
            + (f"\nN{r['nodes']}" if r["nodes"] > 1 else "")
            + ("\n(over)" if r["oversubscribed"] else "")
            for r in mine
        ]
        xs = range(len(mine))
        comp = [r["compute_s"] for r in mine]
        ar = [max(r["train_s"] - r["compute_s"], 0.0) for r in mine]  # the slowest rank's allreduce
        ev = [r["eval_s"] / r["eval_every"] for r in mine]
        ax.bar(xs, comp, label="local compute (slowest rank)")
        ax.bar(xs, ar, bottom=comp, label="allreduce (on the critical path)")
        ax.bar(xs, ev, bottom=[c + a for c, a in zip(comp, ar, strict=True)], label="evaluation ÷ eval_every")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel("seconds per round")
        ax.set_title(f"{model}: time split of one round")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(src: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Rebuild the report from every raw row under ``src``; write CSV/JSON/PNG to ``out``."""
    from hpcfl.errors import ConfigError
    from hpcfl.files import atomic_write_text, read_jsonl

    raw = [r for p in sorted(Path(src).rglob(ROWS_FILE)) for r in read_jsonl(p)]
    probes = [r for p in sorted(Path(src).rglob(PROBE_FILE)) for r in read_jsonl(p)]
    if not raw:
        raise ConfigError(f"no {ROWS_FILE} under {src}: run `hpcfl bench scaling --out {src}` first")
    rows = summarize_rows(raw, args.eval_every)
    probe = select_probe(probes)
    proj = build_projection(
        rows,
        probe,
        eval_every=args.eval_every,
        max_ranks=args.project_ranks,
        strong_clients=args.project_clients,
        weak_clients_per_rank=args.project_clients_per_rank,
        ib_alpha=args.ib_alpha,
        ib_beta=args.ib_beta,
    )
    report = {
        "method": __doc__,
        "eval_every": args.eval_every,
        "rows": rows,
        "acceptance": acceptance(rows),
        "allreduce_probe": probe,
        "projection": proj,
        "raw_rows": len(raw),
    }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "scaling.json", json.dumps(report, indent=2, default=str))
    tmp = out / ".scaling.csv.tmp"
    with open(tmp, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(out / "scaling.csv")
    _plot(rows, proj, out / "scaling.png")
    _plot_split(rows, out / "scaling_time_split.png")
    print(format_table(rows))
    if probe is not None:
        print(
            f"\nallreduce probe ({probe['ranks']} ranks, {probe.get('nodes', 1)} node(s), {probe.get('mpi')}): "
            f"alpha = {probe['alpha_s'] * 1e6:.2f} us, beta = {probe['beta_Bps'] / 1e9:.2f} GB/s"
        )
    print()
    print(format_projection(proj))
    for name, item in report["acceptance"].items():
        value = item.get("max", item.get("min"))
        bound = item.get("required_max", item.get("required_min"))
        ok = value is not None and (value <= bound if "required_max" in item else value >= bound)
        print(
            f"{name}: {_f(value, '.3f')} (required {'<=' if 'required_max' in item else '>='} {bound}) "
            f"[{'ok' if ok else 'BELOW'}]"
        )
    print(f"wrote {out}/scaling.{{csv,json,png}}, scaling_time_split.png")
    return report


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

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


if __name__ == "__main__":
    sys.exit(main())
