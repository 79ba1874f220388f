"""Pure arithmetic of the scaling benchmark: efficiencies, the ring-allreduce model and the
projection to many ranks (tested on made-up timings)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any


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
    # the round buffer (hpcfl.runner.rounds.round_layout) in float64: the payload, weight and count,
    # a non-finite flag and a loss per participant, and three per-rank slots
    buffer_bytes = 8 * (cm.payload_floats + 2 * clients + 2 + 3 * ranks)
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
