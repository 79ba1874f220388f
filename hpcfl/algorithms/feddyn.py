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

Reported model: the official code (``utils_methods_FedDyn.py``) sends θ^t = mean − h/α to the
clients but evaluates and reports the plain mean of the client models (``avg_model``); so does this
module: ``test_accuracy`` is the client mean's (kept as ``mean`` in the server state, not sent to
clients), ``test_accuracy_corrected`` the h-corrected θ^t's. At α = 0.01 and momentum 0.9 the
corrected model oscillates between 10 % and 48 % for 20 rounds where the mean climbs to 75 % (issue
25).

Options of the official code: ``max_grad_norm`` clips, before each local step, the gradient of the
loss plus the linear terms (their ``clip_grad_norm_`` after ``backward`` of
``loss_f_i + α⟨θ, −θ^{t−1} + λ_k⟩``, their default 10) while α·θ and the weight decay (their
optimiser's ``weight_decay = α + wd``) stay outside the clip; ``alpha_per_client`` uses
α_k = α / w_k with w_k = n_k·N/Σ_j n_j (their ``alpha_coef / weight_list[clnt]``) in client k's
local problem and linear-term update, while the server's h/α keeps α, as their
``cld_mdl_param = avg + mean(local_param_list)`` does.

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
    check_weighting,
    model_upload,
)
from hpcfl.algorithms.participation import Population
from hpcfl.errors import ConfigError
from hpcfl.training.batched import LinearCorrection
from hpcfl.training.sgd import LocalResult


@dataclass(frozen=True)
class FedDynParams(HyperParams):
    """FedDyn's hyper-parameters (Acar et al., ICLR 2021, Algorithm 1).

    - ``alpha`` α = 0.01: the dynamic-regulariser weight; the paper selects it per task from
      {0.1, 0.01, 0.001}; 0.01 is the middle of that grid.
      α = 0 is FedAvg by convention (see the module docstring);
    - ``weighting`` = ``uniform``: Algorithm 1's uniform means (and the official code's); ``samples``:
      n_k-weighted (see the module docstring);
    - ``max_grad_norm`` = None: no clipping; a number clips each local step's gradient of the loss
      and linear terms to that norm, as the official code does (its default is 10);
    - ``alpha_per_client`` = false: one α; true: α_k = α/w_k, w_k = n_k·N/Σn (the official code's
      ``alpha / weight`` option).
    """

    alpha: float = 0.01
    weighting: str = "uniform"
    max_grad_norm: float | None = None
    alpha_per_client: bool = False

    def __post_init__(self) -> None:
        if not self.alpha >= 0:
            raise ConfigError(f"config key 'params.alpha' must be >= 0, got {self.alpha}")
        check_weighting(self.weighting)
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(f"config key 'params.max_grad_norm' must be > 0, got {self.max_grad_norm}")


@dataclass
class FedDynServerState(ServerState):
    """x (θ^t, what clients start from), h, the server's running (1/N)Σ of the clients' linear
    terms (over the parameters), and ``mean``, the last round's plain mean of the client models (the
    reported model; None before round 1). h and mean stay on the server (not in ``bytes_down``)."""

    server_only: ClassVar[tuple[str, ...]] = ("h", "mean")

    h: torch.Tensor | None = None
    mean: torch.Tensor | None = None

    def evaluated(self) -> dict[str, torch.Tensor]:
        """The client mean as ``test_accuracy`` (the official code's metric), θ^t as ``_corrected``."""
        return {"": self.x if self.mean is None else self.mean, "_corrected": self.x}


@dataclass
class FedDynClientState(ClientState):
    """g: the client's linear term ∇L_k(θ_k^{t−1}) (None: 0, a client never trained)."""

    g: torch.Tensor | None = None


@dataclass(frozen=True)
class ClippedDynCorrection:
    """FedDyn's correction with the official code's gradient clipping: the loss gradient plus the
    linear terms, ∇L_k − shift − pull·anchor, is clipped to ``max_norm`` (``clip_grad_norm_``'s
    coefficient max_norm/(‖·‖ + 1e-6), at most 1), then pull·w and the weight decay are added
    (they are the official optimiser's ``weight_decay``, outside the clip). ``d`` arrives as
    ∇L_k + weight_decay·w (``descend``'s order)."""

    max_norm: float
    weight_decay: float
    shift: torch.Tensor | None
    pull: float
    anchor: torch.Tensor | None

    def __call__(self, w: torch.Tensor, d: torch.Tensor) -> None:
        v = d.sub(w, alpha=self.weight_decay) if self.weight_decay else d.clone()
        if self.shift is not None:
            v.sub_(self.shift)
        if self.pull:
            assert self.anchor is not None
            v.sub_(self.anchor, alpha=self.pull)
        # on the device (no host read per step); in float64 then rounded, as the Python-float
        # coefficient it replaces, so the step is bit for bit the same
        coef = (self.max_norm / (v.norm().double() + 1e-6)).clamp(max=1.0)
        v.mul_(coef.to(v.dtype))
        if self.pull + self.weight_decay:
            v.add_(w, alpha=self.pull + self.weight_decay)
        d.copy_(v)


def client_alpha(params: FedDynParams, k: int, population: Population) -> float:
    """α_k: α, or with ``alpha_per_client`` α/w_k, w_k = n_k·N/Σ_j n_j (official ``alpha / weight``)."""
    if not params.alpha_per_client:
        return params.alpha
    sizes = population.sizes
    return params.alpha / (sizes[k] * len(sizes) / sum(sizes))


class FedDyn(Algorithm[FedDynParams, FedDynServerState, FedDynClientState]):
    name = "feddyn"
    dp_refusal = "its server state h is a second, unclipped statistic of the uploads"
    Params = FedDynParams
    divergence_params = ("alpha",)

    def init_server(self, x0: torch.Tensor) -> FedDynServerState:
        return FedDynServerState(x=x0.clone(), h=x0.new_zeros(self.num_params))

    def init_client(self, k: int, server: FedDynServerState) -> FedDynClientState:
        return FedDynClientState()

    def local_task(
        self, server: FedDynServerState, client: FedDynClientState, data: ClientData, ctx: ClientContext
    ) -> LocalTask[FedDynClientState]:
        alpha = client_alpha(self.params, data.k, ctx.population)
        weighting = self.params.weighting
        P = self.num_params
        anchor = server.x[:P]
        g = client.g

        def finish(y: torch.Tensor, result: LocalResult) -> tuple[Upload, FedDynClientState]:
            new = client
            if alpha != 0:
                drift = y[:P] - anchor
                new = FedDynClientState(g=(-alpha) * drift if g is None else g - alpha * drift)
            return model_upload(y, data, result, weighting=weighting), new

        max_norm = self.params.max_grad_norm
        if max_norm is not None:
            assert ctx.trainer is not None
            wd = ctx.trainer.schedule.weight_decay
            pull = alpha if alpha != 0 else 0.0
            clipped = ClippedDynCorrection(max_norm, wd, g if alpha != 0 else None, pull, anchor)
            return LocalTask(server.x, finish, clipped)
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
            return FedDynServerState(x=mean, h=server.h, mean=mean), {}
        P = self.num_params
        if self.params.weighting == "uniform":
            norm = float(ctx.population.size)  # N
        else:
            norm = float(sum(ctx.population.sizes))  # Σ_k n_k over every client
        moved = aggregate.sums["x"][:P] - aggregate.weight * server.x[:P]  # Σ_S w_k(θ_k − θ^{t−1})
        h = server.h - (alpha / norm) * moved
        x = mean.clone()
        x[:P] = mean[:P] - h / alpha
        return FedDynServerState(x=x, h=h, mean=mean), {"h_norm": float(h.norm())}
