"""FedAsync (Xie et al., 2019, "Asynchronous Federated Optimization"): every arriving model is
mixed into the server model at once, x ← (1 − α_t) x + α_t y with α_t = α · s(t − τ) (Algorithm 1;
s: ``constant``, ``polynomial`` (t − τ + 1)^−a or ``hinge``, §5.2). The clock, the pending models
and the local step are :mod:`hpcfl.algorithms.asynchronous`'s; ``concurrency`` clients train at
once (the paper's scheduler triggers a new client whenever one finishes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hpcfl.algorithms.asynchronous import AsyncAlgorithm, AsyncParams, staleness_weight
from hpcfl.algorithms.base import Arrival
from hpcfl.algorithms.fedbuff import _staleness_metrics
from hpcfl.errors import ConfigError


@dataclass(frozen=True)
class FedAsyncParams(AsyncParams):
    """``alpha`` α in (0, 1]: the mixing weight of a fresh model (the paper sweeps 0.4–0.9; 0.6
    default); the rest: :class:`AsyncParams`."""

    alpha: float = 0.6

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (0 < self.alpha <= 1 and math.isfinite(self.alpha)):
            raise ConfigError(f"config key 'params.alpha' must be in (0, 1], got {self.alpha}")


class FedAsync(AsyncAlgorithm[FedAsyncParams]):
    dp_refusal = (
        "its stale updates are applied one server step at a time with staleness weights, which the "
        "accountants (one mean of a synchronous round's uploads per step) do not cover"
    )
    name = "fedasync"
    Params = FedAsyncParams
    divergence_params = ("alpha",)

    def kept(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The trained model itself (mixed in as it is)."""
        return y

    def apply(
        self, x: torch.Tensor, rows: list[torch.Tensor], arrivals: tuple[Arrival, ...]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        p = self.params
        mixes = [p.alpha * staleness_weight(p.staleness, a.staleness, p.a, p.b) for a in arrivals]
        for y, mix in zip(rows, mixes, strict=True):
            x = torch.lerp(x, y, mix)  # (1 − α_t) x + α_t y
        return x, {**_staleness_metrics(arrivals), **({"alpha_t": mixes[-1]} if mixes else {})}
