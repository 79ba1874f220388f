"""APFL (Deng, Kamani & Mahdavi, "Adaptive Personalized Federated Learning", 2020).

Each client keeps a personal model v_k and a mixing weight α_k; its personalised model is the
mixture v̄_k = α_k v_k + (1 − α_k) w. In every local step on a mini-batch ξ (Algorithm 1), from the
same ξ:

- the client's copy of the global model takes a plain step, w ← w − η ∇f_k(w; ξ);
- the personal model takes a step on the mixture's loss, v ← v − η ∇_v f_k(v̄; ξ) = v − η α ∇f_k(v̄; ξ);
- α adapts (Sec. 3, "adaptive α"): α ← α − η_α ∇_α f_k(v̄; ξ) = α − η_α ⟨v − w, ∇f_k(v̄; ξ)⟩,
  clipped to [0, 1] as in the authors' code;

each gradient taken at the values before the step (v̄ = α v + (1 − α) w of the previous iterate).
After the local steps the client uploads w and the server averages it as FedAvg does (n_k-weighted
by default); v_k and α_k stay in the client state (memory or the on-disk store).

The run's weight decay and momentum apply to w and to v alike (a momentum buffer each, as two
optimisers would keep). BatchNorm statistics (float buffers): w keeps those of its own forward
passes, v those of the mixture's.

Defaults: ``alpha`` = 0.5, the α_k every client starts from: the authors' code (MLOPTPSU/FedTorch,
"Official implementation for https://arxiv.org/abs/2003.13461": ``--fed_personal_alpha`` default
0.5); ``adaptive`` true (the method's name; the code's ``--fed_adaptive_alpha`` is off by default);
``alpha_lr`` = None, the run's learning rate (the code steps α with the round's lr as well).
v_k starts at the initial global model, v_k^0 = w^0.

The paper's text was not at hand (only its abstract in the searched corpora), so the per-step rule
above, from Algorithm 1 as this file's author read it, is not checked against it. The authors' code
(``fedtorch/comms/trainings/federated/apfl.py`` and ``alpha_update`` in
``fedtorch/comms/utils/flow_utils.py``) differs from it: it steps α once per round (at the first
local step), with gradient ⟨v − w, α∇_v + (1 − α)∇_w⟩ of the mixture's loss plus 0.02·α, clipped to
[0, 1]; and it takes the personal step at the mixture of the already-updated w. This file keeps the
per-step form (each of the three steps the gradient of the mixture's loss at the previous iterate);
set ``adaptive: false`` for a fixed α.

Judged per client (:attr:`personalised`): client k's model is α_k v_k + (1 − α_k) w with w the
current global model (a client never trained: α₀ w⁰ + (1 − α₀) w, from its initial state). One
local loop over two models and α, over the trainer's steps (:meth:`Trainer.steps`: both gradients
of a step from one read of its mini-batch): trained one by one under ``client_batch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcfl.algorithms.base import (
    Algorithm,
    ClientContext,
    ClientData,
    ClientState,
    HyperParams,
    ServerState,
    Upload,
    check_weighting,
    model_upload,
    read_phases,
)
from hpcfl.errors import ConfigError
from hpcfl.training.sgd import sgd_step


@dataclass(frozen=True)
class APFLParams(HyperParams):
    """``alpha``: every client's initial mixing weight α_k in [0, 1] (default 0.5); ``adaptive``:
    whether α_k follows the paper's gradient step (default true; false keeps it fixed);
    ``alpha_lr``: η_α (None: the run's lr); ``weighting``: the global model's server mean."""

    alpha: float = 0.5
    adaptive: bool = True
    alpha_lr: float | None = None
    weighting: str = "samples"

    def __post_init__(self) -> None:
        check_weighting(self.weighting)
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"config key 'params.alpha' (APFL's α) must be in [0, 1], got {self.alpha}")
        if self.alpha_lr is not None and not self.alpha_lr > 0:
            raise ConfigError(f"config key 'params.alpha_lr' must be > 0, got {self.alpha_lr}")


@dataclass
class APFLClientState(ClientState):
    """v: the client's personal model (w^0 until it trains); alpha: its mixing weight α_k, a
    one-element float64 tensor (the initial ``alpha`` until it trains)."""

    v: torch.Tensor | None = None
    alpha: torch.Tensor | None = None


class APFL(Algorithm[APFLParams, ServerState, APFLClientState]):
    name = "apfl"
    dp_refusal = (
        "its personal models and mixing weights train outside the clipped update (not analysed for DP)"
    )
    Params = APFLParams
    personalised = True
    unbatched_reason = "its local steps train the global copy, the personal model and α together"

    def init_client(self, k: int, server: ServerState) -> APFLClientState:
        alpha = torch.full((1,), self.params.alpha, dtype=torch.float64, device=server.x.device)
        return APFLClientState(v=server.x.clone(), alpha=alpha)  # v_k^0 = w^0

    def mixture(self, server: ServerState, client: APFLClientState) -> torch.Tensor:
        """v̄_k = α_k v_k + (1 − α_k) w with the server's w."""
        if client.v is None or client.alpha is None:
            return server.x
        a = client.alpha.to(server.x.dtype)
        return a * client.v + (1 - a) * server.x

    def personal_model(
        self, server: ServerState, client: APFLClientState, data: ClientData, ctx: ClientContext
    ) -> torch.Tensor:
        return self.mixture(server, client)

    def client_update(
        self, server: ServerState, client: APFLClientState, data: ClientData, ctx: ClientContext
    ) -> tuple[Upload, APFLClientState]:
        trainer = ctx.trainer
        assert trainer is not None
        sched, P = trainer.schedule, self.num_params
        fresh = self.init_client(data.k, server)
        w = server.x.clone()
        v = (client.v if client.v is not None else fresh.v).clone()  # type: ignore[union-attr]
        alpha = (client.alpha if client.alpha is not None else fresh.alpha).clone()  # type: ignore[union-attr]
        alpha_lr = self.params.alpha_lr if self.params.alpha_lr is not None else sched.lr
        buf_w: torch.Tensor | None = None
        buf_v: torch.Tensor | None = None
        steps = trainer.steps(data, ctx.generator)  # the trainer's mini-batches and gradients
        for batch in steps:
            a = alpha.to(w.dtype)
            mixed = a * v + (1 - a) * w  # v̄ of the previous iterate
            # from the same mini-batch ξ: ∇f(w; ξ) (its loss tallied) and ∇f(v̄; ξ), each with the
            # buffers its forward pass left (w keeps its own, v the mixture's)
            (g_w, w_next), (g, v_next) = steps.gradients(batch, (w, mixed))
            buf_w = sgd_step(w_next[:P], g_w, sched, None, buf_w)
            # v's step along α·∇f(v̄), α's along ⟨v − w, ∇f(v̄)⟩
            v_next[:P] = v[:P]
            if self.params.adaptive:
                step = torch.dot((v[:P] - w[:P]).to(torch.float64), g.to(torch.float64))
                alpha = (alpha - alpha_lr * step).clamp_(0.0, 1.0)
            buf_v = sgd_step(v_next[:P], a * g, sched, None, buf_v)
            w, v = w_next, v_next
        finite = torch.isfinite(w).all() & torch.isfinite(v).all() & torch.isfinite(alpha).all()
        result = read_phases(data, steps.tallies(finite))  # the one read
        return model_upload(w, data, result, weighting=self.params.weighting), APFLClientState(
            v=v, alpha=alpha
        )
