"""FedDyn (Acar, Zhao, Matas, Mattina, Whatmough & Saligrama, ICLR 2021, "Federated Learning Based
on Dynamic Regularization", Algorithm 1).

Each participant k of round t solves (here: approximately, by the run's local SGD)

    θ_k^t = argmin_θ  L_k(θ) − ⟨∇L_k(θ_k^{t−1}), θ⟩ + (α/2)‖θ − θ^{t−1}‖²,

keeps its linear term g_k = ∇L_k(θ_k^t) = g_k − α(θ_k^t − θ^{t−1}) (client state, 0 at the start),
and the server keeps h (server state, 0 at the start):

    h^t = h^{t−1} − α·(1/N)·Σ_S (θ_k^t − θ^{t−1}),      θ^t = mean_S θ_k^t − h^t/α,

with N the number of clients (partial participation as in Algorithm 1). The dynamic regulariser and
h act on the trainable parameters; float buffers (BatchNorm statistics) take FedAvg's mean.

``weighting``: ``uniform`` (default) is Algorithm 1 as written: the uniform mean over S and the
(1/N)Σ_S of the h step, minimising (1/N)Σ_k L_k. ``samples`` weights both by n_k (the model mean
Σ_S n_k θ_k / Σ_S n_k, as FedAvg here, and h ← h − α·Σ_S n_k(θ_k − θ)/Σ_{all k} n_k), which
keeps the induction h = Σ_k n_k g_k / Σ_k n_k and so minimises the pooled loss Σ_k n_k L_k; the
two coincide when all clients hold the same number of samples. Either way each participant uploads
only its model (the sum Σ_S w_k(θ_k − θ) is the model sum minus Σ_S w_k·θ), i.e. FedAvg's traffic.

α = 0: the local problem is FedAvg's and h stays 0, but the server's h/α is 0/0. It is defined as 0,
so ``alpha: 0`` is FedAvg (bit for bit with ``weighting: samples``). This is a convention, not the
limit: as α → 0⁺, h/α → −(1/N)Σ_{s≤t}Σ_{S_s}(θ_k^s − θ^{s−1}) (clients tend to FedAvg's, the server
keeps adding up every past average drift), a different and unstable method; the tests check both.
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
    Upload,
    model_upload,
)
from hpcfl.errors import ConfigError
from hpcfl.training.batched import LinearCorrection
from hpcfl.training.sgd import LocalResult


@dataclass(frozen=True)
class FedDynParams(HyperParams):
    """FedDyn's hyper-parameters (Acar et al., ICLR 2021, Algorithm 1).

    - ``alpha`` α = 0.01: the dynamic-regulariser weight; the paper selects it per task from
      {0.1, 0.01, 0.001}; 0.01 is the middle of that grid.
      α = 0 is FedAvg by convention (see the module docstring);
    - ``weighting`` = ``uniform``: Algorithm 1's uniform means; ``samples``: n_k-weighted (see the
      module docstring).
    """

    alpha: float = 0.01
    weighting: str = "uniform"

    def __post_init__(self) -> None:
        if not self.alpha >= 0:
            raise ConfigError(f"config key 'params.alpha' must be >= 0, got {self.alpha}")
        if self.weighting not in ("uniform", "samples"):
            raise ConfigError(
                f"config key 'params.weighting' must be uniform or samples, got {self.weighting!r}"
            )


@dataclass
class FedDynServerState(ServerState):
    """x and h, the server's running (1/N)Σ of the clients' linear terms (over the parameters);
    h stays on the server (not counted in ``bytes_down``)."""

    server_only: ClassVar[tuple[str, ...]] = ("h",)

    h: torch.Tensor | None = None


@dataclass
class FedDynClientState(ClientState):
    """g: the client's linear term ∇L_k(θ_k^{t−1}) (None: 0, a client never trained)."""

    g: torch.Tensor | None = None


class FedDyn(Algorithm[FedDynParams, FedDynServerState, FedDynClientState]):
    name = "feddyn"
    Params = FedDynParams

    def init_server(self, x0: torch.Tensor) -> FedDynServerState:
        return FedDynServerState(x=x0.clone(), h=x0.new_zeros(self.num_params))

    def init_client(self, k: int, server: FedDynServerState) -> FedDynClientState:
        return FedDynClientState()

    def local_task(
        self, server: FedDynServerState, client: FedDynClientState, data: ClientData, ctx: ClientContext
    ) -> LocalTask[FedDynClientState]:
        alpha = self.params.alpha
        uniform = self.params.weighting == "uniform"
        P = self.num_params
        anchor = server.x[:P]
        g = client.g

        def finish(y: torch.Tensor, result: LocalResult) -> tuple[Upload, FedDynClientState]:
            new = client
            if alpha != 0:
                drift = y[:P] - anchor
                new = FedDynClientState(g=(-alpha) * drift if g is None else g - alpha * drift)
            upload = model_upload(y, data, result)
            if uniform:
                upload.weight = 1.0
            return upload, new

        if alpha == 0:  # the local problem is FedAvg's and g stays 0
            return LocalTask(server.x, finish)
        # ∇ of −⟨g_k, θ⟩ + (α/2)‖θ − θ^{t−1}‖²
        return LocalTask(server.x, finish, LinearCorrection(shift=g, pull=alpha, anchor=anchor))

    def server_update(
        self, server: FedDynServerState, aggregate: Aggregate, ctx: ServerContext
    ) -> tuple[FedDynServerState, dict[str, float]]:
        assert server.h is not None
        alpha = self.params.alpha
        mean = aggregate.sums["x"] / aggregate.weight
        if alpha == 0:
            return FedDynServerState(x=mean, h=server.h), {}
        P = self.num_params
        if self.params.weighting == "uniform":
            norm = float(ctx.population.size)  # N
        else:
            norm = float(sum(ctx.population.sizes))  # Σ_k n_k over every client
        moved = aggregate.sums["x"][:P] - aggregate.weight * server.x[:P]  # Σ_S w_k(θ_k − θ^{t−1})
        h = server.h - (alpha / norm) * moved
        x = mean.clone()
        x[:P] = mean[:P] - h / alpha
        return FedDynServerState(x=x, h=h), {"h_norm": float(h.norm())}
