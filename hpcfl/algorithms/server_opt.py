"""Server optimisers: FedAvg's clients, an optimiser step on the server (Reddi et al., ICLR 2021,
"Adaptive Federated Optimization", Algorithm 1's ServerOpt).

The round's pseudo-gradient is Δ = mean_S(y_k) − x over the trainable parameters (the n_k-weighted
mean, as every algorithm here). The optimiser turns Δ into a step; the server takes
x ← x + step on the trainable parameters, while the float buffers (BatchNorm statistics) take
FedAvg's mean, since they have no gradient. FedAdam, FedYogi, FedAdagrad and FedAvgM differ only in
the step; their optimiser buffers are ``server_only`` fields of the server state (checkpointed,
never downloaded).
"""

from __future__ import annotations

import math

import torch

from hpcfl.algorithms.base import Aggregate
from hpcfl.errors import ConfigError

#: the largest float32: the server vectors are float32, so a hyper-parameter whose step would pass
#: this is refused up front (a τ² that overflows made v₋₁ = inf and a traceback, issue 61)
_F32_MAX = float(torch.finfo(torch.float32).max)


def check_adaptive_params(*, server_lr: float, tau: float) -> None:
    """One :class:`ConfigError` line for an adaptive server optimiser's η or τ that is not a
    positive finite number, or whose use overflows float32: τ² (v₋₁ = τ²) and η itself must be
    finite there (τ ≤ √(float32 max) ≈ 1.8e19, η ≤ float32 max ≈ 3.4e38)."""
    if not (server_lr > 0 and math.isfinite(server_lr)):
        raise ConfigError(f"config key 'params.server_lr' must be > 0 and finite, got {server_lr}")
    if server_lr > _F32_MAX:
        raise ConfigError(
            f"config key 'params.server_lr' must be <= {_F32_MAX:.4g} (it scales float32 steps), got {server_lr}"
        )
    if not (tau > 0 and math.isfinite(tau)):
        raise ConfigError(f"config key 'params.tau' must be > 0 and finite, got {tau}")
    if tau * tau > _F32_MAX:
        raise ConfigError(
            f"config key 'params.tau' must be <= {math.sqrt(_F32_MAX):.4g}: τ² (the second moment's start "
            f"v₋₁) overflows float32 above it, got {tau}"
        )


def pseudo_gradient(
    x: torch.Tensor, aggregate: Aggregate, num_params: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, delta)``: the weighted mean of the uploaded states ``aggregate.sums["x"]`` and the
    pseudo-gradient Δ = mean − x over the first ``num_params`` (trainable) entries."""
    mean = aggregate.sums["x"] / aggregate.weight
    return mean, mean[:num_params] - x[:num_params]


def apply_step(x: torch.Tensor, mean: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The next server vector (a new tensor): ``x + step`` on the trainable entries (the length of
    ``step``), ``mean`` on the float buffers after them."""
    out = mean.clone()
    out[: step.numel()] = x[: step.numel()] + step
    return out


def momentum_step(
    v: torch.Tensor, delta: torch.Tensor, *, lr: float, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Heavy-ball momentum on Δ (Hsu, Qi & Brown 2019, Algorithm 1): v ← β·v + Δ, step = η·v;
    returns (step, v)."""
    v = beta * v + delta
    return lr * v, v


def adam_step(
    m: torch.Tensor,
    v: torch.Tensor,
    delta: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    tau: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adam on Δ without bias correction (Reddi et al. 2021, Algorithm 2): m ← β1·m + (1 − β1)·Δ,
    v ← β2·v + (1 − β2)·Δ², step = η·m/(√v + τ); returns (step, m, v)."""
    m = beta1 * m + (1.0 - beta1) * delta
    v = beta2 * v + (1.0 - beta2) * delta * delta
    return lr * m / (v.sqrt() + tau), m, v


def yogi_step(
    m: torch.Tensor,
    v: torch.Tensor,
    delta: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    tau: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Yogi on Δ (Reddi et al. 2021, Algorithm 2, FedYogi): m ← β1·m + (1 − β1)·Δ,
    v ← v − (1 − β2)·Δ²·sign(v − Δ²), step = η·m/(√v + τ); returns (step, m, v). v only moves
    towards Δ², by at most (1 − β2)·Δ², so it stays ≥ 0 where it starts ≥ 0."""
    m = beta1 * m + (1.0 - beta1) * delta
    d2 = delta * delta
    v = v - (1.0 - beta2) * d2 * torch.sign(v - d2)
    return lr * m / (v.sqrt() + tau), m, v


def adagrad_step(
    m: torch.Tensor,
    v: torch.Tensor,
    delta: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    tau: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adagrad on Δ (Reddi et al. 2021, Algorithm 2, FedAdagrad): m ← β1·m + (1 − β1)·Δ,
    v ← v + Δ², step = η·m/(√v + τ); returns (step, m, v)."""
    m = beta1 * m + (1.0 - beta1) * delta
    v = v + delta * delta
    return lr * m / (v.sqrt() + tau), m, v
