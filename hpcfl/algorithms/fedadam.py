"""FedAdam (Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar & McMahan, ICLR 2021, "Adaptive
Federated Optimization", Algorithm 2): FedAvg's clients, Adam on the server.

The round's pseudo-gradient is Δ = mean_S(y_k) − x (the n_k-weighted mean, as every algorithm here;
Algorithm 2 writes the uniform mean of the Δ_k). The server then takes one Adam step without bias
correction, as Algorithm 2 does (:mod:`hpcfl.algorithms.server_opt`, shared with FedAvgM):

    m ← β1·m + (1 − β1)·Δ,   v ← β2·v + (1 − β2)·Δ²,   x ← x + η·m/(√v + τ),

with m₋₁ = 0 and v₋₁ = τ² (Algorithm 2 asks for v₋₁ ≥ τ²). Adam acts on the trainable parameters;
the float buffers (BatchNorm statistics) take FedAvg's mean, since they have no gradient. m and v
live in the server state, so they are checkpointed and a resumed run continues bit-identically.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from hpcfl.algorithms.base import (
    Aggregate,
    Algorithm,
    ClientContext,
    ClientData,
    ClientState,
    HyperParams,
    LocalTask,
    ServerContext,
    ServerState,
)
from hpcfl.algorithms.fedavg import local_training
from hpcfl.algorithms.server_opt import adam_step, apply_step, check_adaptive_params, pseudo_gradient
from hpcfl.errors import ConfigError


@dataclass(frozen=True)
class FedAdamParams(HyperParams):
    """FedAdam's server optimiser (Reddi et al., ICLR 2021, Algorithm 2).

    - ``server_lr`` η = 0.01: the paper tunes η per task over a log grid;
      0.01 is a conservative start, to be tuned like the client ``lr``;
    - ``beta1`` β1 = 0.9 and ``beta2`` β2 = 0.99: the values the paper fixes in its experiments;
    - ``tau`` τ = 1e-3: the adaptivity (ε-like) term, the value the paper fixes while tuning the
      learning rates; it also sets v₋₁ = τ².
    """

    server_lr: float = 1e-2
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3

    def __post_init__(self) -> None:
        for key in ("beta1", "beta2"):
            value = getattr(self, key)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"config key 'params.{key}' must be in [0, 1), got {value}")
        check_adaptive_params(server_lr=self.server_lr, tau=self.tau)


@dataclass
class FedAdamServerState(ServerState):
    """x and Adam's moments over the trainable parameters: m (first), v (second); the moments stay
    on the server (not counted in ``bytes_down``)."""

    server_only: ClassVar[tuple[str, ...]] = ("m", "v")

    m: torch.Tensor | None = None
    v: torch.Tensor | None = None


class FedAdam(Algorithm[FedAdamParams, FedAdamServerState, ClientState]):
    name = "fedadam"
    dp_levels = ("client", "sample")  # the upload is the model and the server step reads its mean
    Params = FedAdamParams
    divergence_params = ("server_lr",)

    def init_server(self, x0: torch.Tensor) -> FedAdamServerState:
        P = self.num_params
        return FedAdamServerState(x=x0.clone(), m=x0.new_zeros(P), v=x0.new_full((P,), self.params.tau**2))

    def local_task(
        self, server: FedAdamServerState, client: ClientState, data: ClientData, ctx: ClientContext
    ) -> LocalTask[ClientState]:
        return local_training(server, client, data)

    def server_update(
        self, server: FedAdamServerState, aggregate: Aggregate, ctx: ServerContext
    ) -> tuple[FedAdamServerState, dict[str, float]]:
        assert server.m is not None and server.v is not None
        mean, delta = pseudo_gradient(server.x, aggregate, self.num_params)
        step, m, v = self.moment_step(server.m, server.v, delta)
        x = apply_step(server.x, mean, step)
        return FedAdamServerState(x=x, m=m, v=v), {"pseudo_grad_norm": float(delta.norm())}

    def moment_step(
        self, m: torch.Tensor, v: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(step, m, v): the server optimiser's update of its moments from the pseudo-gradient (Adam's;
        FedYogi and FedAdagrad change only this)."""
        p = self.params
        return adam_step(m, v, delta, lr=p.server_lr, beta1=p.beta1, beta2=p.beta2, tau=p.tau)
