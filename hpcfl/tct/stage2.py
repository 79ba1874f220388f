"""TCT stage 2 as a federated algorithm over ψ = W (p+1, C): SCAFFOLD, FedAvg or GD variants.

It plugs into the same round loop as every other algorithm: the server state is W flattened, a
client's upload is its local W weighted by n_k, and the client state is SCAFFOLD's (h_k, Ŵ_k) in
the one-model-per-round form of TCT Appendix A.1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcfl.algorithms.base import (
    Aggregate,
    Algorithm,
    ClientContext,
    ClientData,
    ClientState,
    Exchange,
    HyperParams,
    NonFiniteLoss,
    ServerContext,
    ServerState,
    SumSpec,
    Upload,
)
from hpcfl.algorithms.scaffold import correction_update
from hpcfl.comm.base import Communicator
from hpcfl.errors import DivergenceError
from hpcfl.tct.solvers import LocalSolver, max_stable_lr
from hpcfl.training.layout import StateLayout


@dataclass(frozen=True)
class Stage2Params(HyperParams):
    """η2 (default 5e-5), M (default 500) and the variant (TCT Algorithm 2; Section 5.3)."""

    lr: float = 5e-5
    local_steps: int = 500
    variant: str = "scaffold"  # scaffold | fedavg (TCT-FedAvg) | gd (TCT-GD: one step per round)


@dataclass
class Stage2ClientState(ClientState):
    """SCAFFOLD memory of one client: correction h and last local model (None before round 1)."""

    h: torch.Tensor | None = None
    last_local: torch.Tensor | None = None


class Stage2(Algorithm[Stage2Params, ServerState, Stage2ClientState]):
    """Federated linear regression on eNTK features with per-client local solvers."""

    name = "tct-stage2"
    Params = Stage2Params

    def __init__(self, params: Stage2Params, solvers: dict[int, LocalSolver], shape: tuple[int, int]) -> None:
        super().__init__(params, layout=StateLayout.vector(shape[0] * shape[1], "W"))
        self.solvers = solvers
        self.shape = shape

    @property
    def steps(self) -> int:
        return 1 if self.params.variant == "gd" else self.params.local_steps

    def exchange(self, dtype: torch.dtype = torch.float32) -> Exchange:
        return Exchange(sums=(SumSpec("x", self.state_size, dtype),))

    def init_client(self, k: int, server: ServerState) -> Stage2ClientState:
        return Stage2ClientState()

    def client_update(
        self, server: ServerState, client: Stage2ClientState, data: ClientData, ctx: ClientContext
    ) -> tuple[Upload, Stage2ClientState]:
        lr = self.params.lr
        w0 = server.x.view(self.shape)
        h = client.h if client.h is not None else torch.zeros_like(w0)
        if self.params.variant == "scaffold" and client.last_local is not None:
            h = correction_update(h, w0, client.last_local.view(self.shape), self.steps, lr)
        w = self.solvers[data.k].local_steps(w0, h, lr, self.steps)
        if not torch.isfinite(w).all():
            raise NonFiniteLoss(f"client {data.k}")
        state = Stage2ClientState(h=h, last_local=w.flatten())
        return Upload(sums={"x": w.flatten()}, weight=float(data.n)), state

    def server_update(
        self, server: ServerState, aggregate: Aggregate, ctx: ServerContext
    ) -> tuple[ServerState, dict[str, float]]:
        x = aggregate.sums["x"] / aggregate.weight
        return ServerState(x=x), {"stage2_lr": self.params.lr}


def spectrum(solvers: dict[int, LocalSolver], comm: Communicator) -> dict[int, tuple[float, int]]:
    """(λ_max of Z̃_kZ̃_kᵀ, n_k) of every client, gathered on every rank."""
    mine = {k: (s.lambda_max(), s.problem.n) for k, s in solvers.items()}
    every: dict[int, tuple[float, int]] = {}
    for part in comm.allgather(mine):
        every.update(part)
    return every


def auto_lr(every: dict[int, tuple[float, int]], fraction: float = 0.5) -> float:
    """``fraction`` of the largest η2 that keeps every client's local steps stable."""
    return fraction * min(max_stable_lr(lam, n) for lam, n in every.values())


def check_stability(every: dict[int, tuple[float, int]], lr: float) -> None:
    """Refuse a learning rate for which some client's local steps diverge (η·λ_max/n_k > 2).

    ``every`` comes from :func:`spectrum`, identical on every rank, so the error is raised
    everywhere before any round is wasted.
    """
    bad = {k: v for k, v in every.items() if lr * v[0] / v[1] > 2.0}
    if bad:
        k = max(bad, key=lambda c: bad[c][0] / bad[c][1])
        lam, n = bad[k]
        safest = min(max_stable_lr(lam_, n_) for lam_, n_ in every.values())
        raise DivergenceError(
            f"stage-2 learning rate {lr:g} diverges: client {k} has λ_max(Z̃Z̃ᵀ) = {lam:.4g} with n_k = {n}, "
            f"so η·λ_max/n_k = {lr * lam / n:.3g} > 2; use stage2.lr < {safest:.4g} (or stage2.auto_lr: true)"
        )
