"""FedBuff (Nguyen et al., AISTATS 2022): asynchronous FL with a server buffer of K updates.

At most ``concurrency`` clients train at once, each from the server model current when it starts;
the server adds each arriving update Δ_i = y_i − x_{τ_i} weighted by its staleness s(t − τ_i)
(Algorithm 1; the paper's s(τ) = 1/√(1 + τ) is ``staleness: polynomial``, ``a: 0.5``, the default)
into a buffer, and once K updates are in it takes the step x ← x + η_g · (1/K) Σ s(τ_i) Δ_i
(``server_lr`` η_g). The clock, the pending updates and the local step are
:mod:`hpcfl.algorithms.asynchronous`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hpcfl.algorithms.asynchronous import AsyncAlgorithm, AsyncParams, staleness_weight
from hpcfl.algorithms.base import Arrival
from hpcfl.errors import ConfigError


@dataclass(frozen=True)
class FedBuffParams(AsyncParams):
    """``buffer_size`` K: updates per server step, at most the concurrency (None, the default: the
    paper's K = 10 of its cross-device runs where the concurrency allows it, else the concurrency, so
    that a federation of 8 clients is not refused; the K chosen is in the run's ``determinism.json``,
    issue 63); ``server_lr`` η_g (> 0); the rest: :class:`AsyncParams`."""

    buffer_size: int | None = None
    server_lr: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.buffer_size is None:
            return self._check_server_lr()
        if isinstance(self.buffer_size, bool) or self.buffer_size < 1:
            raise ConfigError(f"config key 'params.buffer_size' must be >= 1, got {self.buffer_size}")
        if self.concurrency is not None and self.buffer_size > self.concurrency:
            raise ConfigError(
                f"config key 'params.buffer_size' ({self.buffer_size}) is larger than params.concurrency "
                f"({self.concurrency}): the buffer could never fill; lower buffer_size or raise concurrency"
            )
        self._check_server_lr()

    def _check_server_lr(self) -> None:
        if not (self.server_lr > 0 and math.isfinite(self.server_lr)):
            raise ConfigError(f"config key 'params.server_lr' must be > 0, got {self.server_lr}")


#: the paper's buffer size in its cross-device experiments (Nguyen et al. 2022, §5: K = 10)
PAPER_BUFFER_SIZE = 10


class FedBuff(AsyncAlgorithm[FedBuffParams]):
    dp_refusal = (
        "its stale updates are applied one server step at a time with staleness weights, which the "
        "accountants (one mean of a synchronous round's uploads per step) do not cover"
    )
    name = "fedbuff"
    Params = FedBuffParams
    example_params = FedBuffParams(buffer_size=2, server_lr=1.0)
    divergence_params = ("server_lr",)

    @property
    def buffer_size(self) -> int:
        """``params.buffer_size``, or (unset) the paper's K = 10 capped at the concurrency (before
        :meth:`resolved` knows the concurrency: 10, or ``params.concurrency`` if lower)."""
        if self.params.buffer_size is not None:
            return self.params.buffer_size
        return min(PAPER_BUFFER_SIZE, self.concurrency or PAPER_BUFFER_SIZE)

    def kept(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The update Δ = y − x."""
        return y - x

    def apply(
        self, x: torch.Tensor, rows: list[torch.Tensor], arrivals: tuple[Arrival, ...]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        p = self.params
        buffered = torch.zeros_like(x)
        for delta, arrival in zip(rows, arrivals, strict=True):
            buffered.add_(delta, alpha=staleness_weight(p.staleness, arrival.staleness, p.a, p.b))
        x = x + (p.server_lr / self.buffer_size) * buffered
        return x, _staleness_metrics(arrivals)


def _staleness_metrics(arrivals: tuple[Arrival, ...]) -> dict[str, float]:
    """The mean and largest staleness of a step's updates (every update's: the ``staleness`` column)."""
    if not arrivals:
        return {}
    values = [a.staleness for a in arrivals]
    return {"staleness_mean": sum(values) / len(values), "staleness_max": float(max(values))}
