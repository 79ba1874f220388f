"""FedYogi (Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar & McMahan, ICLR 2021, "Adaptive
Federated Optimization", Algorithm 2): FedAvg's clients, Yogi on the server.

FedAdam with Yogi's second moment: with the pseudo-gradient Δ = mean_S(y_k) − x (the n_k-weighted
mean, as every algorithm here), the server takes one step without bias correction
(:func:`hpcfl.algorithms.server_opt.yogi_step`):

    m ← β1·m + (1 − β1)·Δ,   v ← v − (1 − β2)·Δ²·sign(v − Δ²),   x ← x + η·m/(√v + τ),

with m₋₁ = 0 and v₋₁ = τ², FedAdam's conventions here (Algorithm 2 asks for v₋₁ ≥ τ²; Flower's
FedYogi starts v at 0). v moves towards Δ² additively, so a large Δ² once does not shrink later
steps as fast as Adam's multiplicative decay lets it, the paper's reason for Yogi. Everything else
(local training, the float buffers taking FedAvg's mean, m and v as checkpointed ``server_only``
fields, the DP levels) is FedAdam's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcfl.algorithms.fedadam import FedAdam, FedAdamParams
from hpcfl.algorithms.server_opt import yogi_step


@dataclass(frozen=True)
class FedYogiParams(FedAdamParams):
    """FedYogi's server optimiser (Reddi et al., ICLR 2021, Algorithm 2); FedAdam's fields, checks
    and defaults, which are also Flower's FedYogi defaults (η 1e-2, β1 0.9, β2 0.99, τ 1e-3):

    - ``server_lr`` η = 0.01: the paper tunes η per task over a log grid; a conservative start;
    - ``beta1`` β1 = 0.9 and ``beta2`` β2 = 0.99: the values the paper fixes in its experiments;
    - ``tau`` τ = 1e-3: the adaptivity term the paper fixes while tuning the rates; also v₋₁ = τ².
    """


class FedYogi(FedAdam):
    name = "fedyogi"
    dp_levels = ("client", "sample")  # the upload is the model and the server step reads its mean
    Params = FedYogiParams

    def moment_step(
        self, m: torch.Tensor, v: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p = self.params
        return yogi_step(m, v, delta, lr=p.server_lr, beta1=p.beta1, beta2=p.beta2, tau=p.tau)
