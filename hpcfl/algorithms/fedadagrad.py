"""FedAdagrad (Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar & McMahan, ICLR 2021, "Adaptive
Federated Optimization", Algorithm 2): FedAvg's clients, Adagrad on the server.

With the pseudo-gradient Δ = mean_S(y_k) − x (the n_k-weighted mean, as every algorithm here), the
server takes one step (:func:`hpcfl.algorithms.server_opt.adagrad_step`):

    m ← β1·m + (1 − β1)·Δ,   v ← v + Δ²,   x ← x + η·m/(√v + τ),

with m₋₁ = 0 and v₋₁ = τ² (FedAdam's conventions here; Algorithm 2 asks for v₋₁ ≥ τ²). Algorithm 2
keeps the momentum m for all three adaptive methods; Flower's FedAdagrad has none, which is
``beta1: 0`` here (m = Δ). v only grows, so the steps shrink over the rounds. As FedAdam: the float
buffers (BatchNorm statistics) take FedAvg's mean; m and v are checkpointed ``server_only`` fields
of FedAdam's server state, so a resumed run continues bit-identically.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcfl.algorithms.base import HyperParams
from hpcfl.algorithms.fedadam import FedAdam
from hpcfl.algorithms.server_opt import adagrad_step, check_adaptive_params
from hpcfl.errors import ConfigError


@dataclass(frozen=True)
class FedAdagradParams(HyperParams):
    """FedAdagrad's server optimiser (Reddi et al., ICLR 2021, Algorithm 2).

    - ``server_lr`` η = 0.1: Flower's FedAdagrad default (the paper tunes η per task over a log
      grid); larger than FedAdam's 0.01 since v accumulates every round's Δ² and never decays;
    - ``beta1`` β1 = 0.9: the paper's momentum for its adaptive methods (0 is Flower's FedAdagrad);
    - ``tau`` τ = 1e-3: the adaptivity term the paper fixes while tuning the rates (Flower's
      current default too); it also sets v₋₁ = τ².
    """

    server_lr: float = 1e-1
    beta1: float = 0.9
    tau: float = 1e-3

    def __post_init__(self) -> None:
        if not 0.0 <= self.beta1 < 1.0:
            raise ConfigError(f"config key 'params.beta1' must be in [0, 1), got {self.beta1}")
        check_adaptive_params(server_lr=self.server_lr, tau=self.tau)


class FedAdagrad(FedAdam):
    """FedAdam's server state, initialisation and clients; only the server step differs."""

    name = "fedadagrad"
    dp_levels = ("client", "sample")  # the upload is the model and the server step reads its mean
    Params = FedAdagradParams  # type: ignore[assignment]

    def moment_step(
        self, m: torch.Tensor, v: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p = self.params
        return adagrad_step(m, v, delta, lr=p.server_lr, beta1=p.beta1, tau=p.tau)
