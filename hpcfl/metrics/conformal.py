"""Split-conformal prediction sets (LAC and APS) for a classifier's softmax outputs.

FedPVR (Section 5.2, Figure 3) reports, for the final server model, the empirical coverage and the
mean prediction-set size that split conformal prediction (Angelopoulos et al., ICLR 2021) gives at
a target coverage 1 − α. The recipe, for ``n`` calibration points with true labels:

1. a non-conformity score per calibration point;
2. q̂ = the ⌈(n+1)(1−α)⌉-th smallest score (no finite q̂ when that rank exceeds n: every class);
3. the prediction set of a new input holds every class whose score would be ≤ q̂.

For exchangeable data this guarantees P(y ∈ C(x)) ≥ 1 − α, and ≤ 1 − α + 1/(n+1) when the
scores have no ties (the upper half is why APS is randomised).

- **LAC** (least ambiguous set-valued classifier, Sadinle et al. 2019): s = 1 − p_y. Smallest sets
  on average; coverage is marginal only.
- **APS** (adaptive prediction sets, Romano et al. 2020): s = Σ_{j: p_j > p_y} p_j + u·p_y with
  u ~ U(0, 1) (randomised: exact coverage and no ties); the set grows with the model's uncertainty.

Everything here is a pure function of tensors and a seed: the calibration split and the APS draws
come from one seeded generator, so every rank computes the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hpcfl.metrics.conformal_spec import ALPHAS, METHODS


def calibration_split(n: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded random split of ``n`` points into (calibration, evaluation) index tensors, the
    calibration part ⌊fraction·n⌋ points (at least 1 on each side)."""
    n_cal = min(max(int(fraction * n), 1), n - 1)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))  # host: a seeded index split
    return order[:n_cal].sort().values, order[n_cal:].sort().values


def conformal_scores(probs: torch.Tensor, labels: torch.Tensor, method: str, u: torch.Tensor) -> torch.Tensor:
    """Non-conformity score of the true label of each row of ``probs`` (n, C); ``u`` (n,) are the
    APS uniforms (ignored by LAC)."""
    p_true = probs.gather(1, labels.view(-1, 1)).squeeze(1)
    if method == "lac":
        return 1.0 - p_true
    if method == "aps":
        above = torch.where(probs > p_true.unsqueeze(1), probs, torch.zeros_like(probs)).sum(1)
        return above + u * p_true
    raise ValueError(f"unknown conformal method {method!r}; use one of {METHODS}")


def conformal_threshold(scores: torch.Tensor, alpha: float) -> float:
    """q̂: the ⌈(n+1)(1−α)⌉-th smallest calibration score, or +inf when that rank exceeds n."""
    n = scores.numel()
    rank = math.ceil((n + 1) * (1.0 - alpha))
    if rank > n:
        return math.inf
    return float(scores.sort().values[rank - 1])


def prediction_sets(probs: torch.Tensor, qhat: float, method: str, u: torch.Tensor) -> torch.Tensor:
    """Boolean (n, C) membership: class j is in the set of row i when its score would be ≤ q̂."""
    if method == "lac":
        return (1.0 - probs) <= qhat
    if method == "aps":
        # mass strictly above each class, Σ_{k: p_k > p_j} p_k, exactly as the score defines it
        above = torch.stack(
            [(probs * (probs > probs[:, j : j + 1])).sum(1) for j in range(probs.shape[1])], 1
        )
        return above + u.view(-1, 1) * probs <= qhat
    raise ValueError(f"unknown conformal method {method!r}; use one of {METHODS}")


def conformal_metrics(
    probs: torch.Tensor,
    labels: torch.Tensor,
    *,
    seed: int,
    calibration_fraction: float = 0.5,
    alphas: Sequence[float] = ALPHAS,
    methods: Sequence[str] = METHODS,
) -> dict[str, float]:
    """Coverage and mean set size of each method at each 1 − α, calibrated on a seeded split of
    (probs, labels) and measured on the rest. Keys: ``{method}_coverage_{pct}`` and
    ``{method}_set_size_{pct}`` with pct = 100(1 − α) (e.g. ``aps_coverage_95``)."""
    probs = probs.to(torch.float64)
    labels = labels.to(torch.long)
    cal, ev = calibration_split(probs.shape[0], calibration_fraction, seed)
    # host: probs come back to the host
    u = torch.rand(probs.shape[0], generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    out: dict[str, float] = {}
    for method in methods:
        scores = conformal_scores(probs[cal], labels[cal], method, u[cal])
        for alpha in alphas:
            sets = prediction_sets(probs[ev], conformal_threshold(scores, alpha), method, u[ev])
            covered = sets.gather(1, labels[ev].view(-1, 1)).squeeze(1)
            pct = f"{100 * (1 - alpha):g}"
            out[f"{method}_coverage_{pct}"] = float(covered.double().mean())
            out[f"{method}_set_size_{pct}"] = float(sets.sum(1).double().mean())
    return out
