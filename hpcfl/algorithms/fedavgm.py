"""FedAvgM (Hsu, Qi & Brown, 2019, "Measuring the Effects of Non-Identical Data Distribution for
Federated Visual Classification", Section 3): FedAvg's clients, heavy-ball momentum on the server.

With the pseudo-gradient Δ = mean_S(y_k) − x (the n_k-weighted mean, as every algorithm here):

    v ← β·v + Δ,   x ← x + η·v,

with v₀ = 0. The paper writes Δw = x − mean and w ← w − v with an implicit η = 1; the sign
convention here is FedAdam's, and η (``server_lr``) is kept as the paper's experiments vary the
effective rate η/(1 − β). β = 0, η = 1 is FedAvg (up to rounding of x + (mean − x)). v lives in the
server state as a ``server_only`` field: checkpointed, never sent to the clients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from hpcfl.algorithms import (
    Aggregate,
    Algorithm,
    ClientContext,
    ClientData,
    ClientState,
    HyperParams,
    LocalTask,
    ServerContext,
    ServerState,
    local_training,
)
from hpcfl.algorithms.server_opt import apply_step, momentum_step, pseudo_gradient
from hpcfl.errors import ConfigError


@dataclass(frozen=True)
class FedAvgMParams(HyperParams):
    """FedAvgM's server optimiser (Hsu et al. 2019, Section 3).

    - ``server_lr`` η = 1.0: the paper's server step, which it keeps at 1 and tunes the client rate;
    - ``beta`` β = 0.9: the server momentum, the paper's best value in most of its sweeps (it
      reports that β = 0.9 to 0.99 help most under strongly non-identical data).
    """

    server_lr: float = 1.0
    beta: float = 0.9

    def __post_init__(self) -> None:
        if not self.server_lr > 0:
            raise ConfigError(f"config key 'params.server_lr' must be > 0, got {self.server_lr}")
        if not 0.0 <= self.beta < 1.0:
            raise ConfigError(f"config key 'params.beta' must be in [0, 1), got {self.beta}")


@dataclass
class FedAvgMServerState(ServerState):
    """x and the server momentum v over the trainable parameters (server-only)."""

    server_only: ClassVar[tuple[str, ...]] = ("v",)

    v: torch.Tensor | None = None


class FedAvgM(Algorithm[FedAvgMParams, FedAvgMServerState, ClientState]):
    name = "fedavgm"
    Params = FedAvgMParams
    divergence_params = ("server_lr",)
    dp_levels = ("client", "sample")  # the upload is the model and the server step reads its mean
    example_params = FedAvgMParams(beta=0.5)

    def init_server(self, x0: torch.Tensor) -> FedAvgMServerState:
        return FedAvgMServerState(x=x0.clone(), v=x0.new_zeros(self.num_params))

    def local_task(
        self, server: FedAvgMServerState, client: ClientState, data: ClientData, ctx: ClientContext
    ) -> LocalTask[ClientState]:
        return local_training(server, client, data)

    def server_update(
        self, server: FedAvgMServerState, aggregate: Aggregate, ctx: ServerContext
    ) -> tuple[FedAvgMServerState, dict[str, float]]:
        assert server.v is not None
        mean, delta = pseudo_gradient(server.x, aggregate, self.num_params)
        step, v = momentum_step(server.v, delta, lr=self.params.server_lr, beta=self.params.beta)
        return FedAvgMServerState(x=apply_step(server.x, mean, step), v=v), {
            "pseudo_grad_norm": float(delta.norm())
        }
