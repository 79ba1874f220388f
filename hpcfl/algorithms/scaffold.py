"""SCAFFOLD (Karimireddy et al., 2020), in two equivalent forms.

``one_model`` (TCT, Appendix A.1; used when every client takes part in every round): each client
keeps a correction h_k and its last local model θ̂_k. At round t it sets
h_k ← h_k + (θ^t − θ̂_k)/(Mη), runs M local steps of SGD on ∇L_k − h_k from θ^t and uploads only
its model: FedAvg's traffic, equivalent to Option II of the original paper.

``control_variates`` (Karimireddy et al., Algorithm 1, Option II; needed with partial
participation, where θ̂_k is stale): the server holds c, client k holds c_k; local steps follow
∇L_k − c_k + c; c_k⁺ = c_k − c + (x − y_k)/(Mη); the participants upload y_k (weighted by n_k)
and Δc_k = c_k⁺ − c_k (summed, unweighted); the server sets x ← Σ n_k y_k / Σ n_k and
c ← c + (|S|/N)·mean_S Δc_k = c + Σ_S Δc_k / N. Twice FedAvg's upload.

The server averages models n_k-weighted (TCT footnote 5).
"""

from __future__ import annotations

import dataclasses
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
    LocalTask,
    ServerContext,
    ServerState,
    SumSpec,
    Upload,
    model_upload,
)
from hpcfl.errors import ConfigError
from hpcfl.training.batched import LinearCorrection
from hpcfl.training.sgd import LocalResult


@dataclass(frozen=True)
class ScaffoldParams(HyperParams):
    """form: ``auto`` (one_model under full participation, control_variates otherwise),
    ``one_model`` (TCT Appendix A.1) or ``control_variates`` (Karimireddy et al., Algorithm 1)."""

    form: str = "auto"

    def __post_init__(self) -> None:
        if self.form not in ("auto", "one_model", "control_variates"):
            raise ConfigError(
                f"config key 'params.form' must be auto, one_model or control_variates, got {self.form!r}"
            )


@dataclass
class ScaffoldServerState(ServerState):
    """x and, in the control-variate form, the server control variate c (None otherwise)."""

    c: torch.Tensor | None = None


@dataclass
class ScaffoldClientState(ClientState):
    """h: the client's correction (one_model) or control variate c_k; last_local: θ̂_k (one_model)."""

    h: torch.Tensor | None = None
    last_local: torch.Tensor | None = None


def correction_update(
    h: torch.Tensor | None, x: torch.Tensor, y: torch.Tensor | None, steps: int, lr: float
) -> torch.Tensor:
    """h + (x − y)/(Mη): SCAFFOLD's control-variate step (shared with TCT's stage 2)."""
    h = h if h is not None else torch.zeros_like(x)
    return h if y is None else h + (x - y) / (steps * lr)


class Scaffold(Algorithm[ScaffoldParams, ScaffoldServerState, ScaffoldClientState]):
    name = "scaffold"
    Params = ScaffoldParams

    @property
    def control_variates(self) -> bool:
        form = self.params.form
        if form == "auto":
            return self.participation.count is not None
        return form == "control_variates"

    def exchange(self, dtype: torch.dtype = torch.float32) -> Exchange:
        sums = (SumSpec("x", self.state_size, dtype),)
        if self.control_variates:
            sums += (SumSpec("dc", self.num_params, dtype, weighted=False),)
        return Exchange(sums=sums)

    def init_server(self, x0: torch.Tensor) -> ScaffoldServerState:
        c = torch.zeros_like(x0[: self.num_params]) if self.control_variates else None
        return ScaffoldServerState(x=x0.clone(), c=c)

    def init_client(self, k: int, server: ScaffoldServerState) -> ScaffoldClientState:
        return ScaffoldClientState()

    def local_task(
        self, server: ScaffoldServerState, client: ScaffoldClientState, data: ClientData, ctx: ClientContext
    ) -> LocalTask[ScaffoldClientState]:
        trainer = ctx.trainer
        assert trainer is not None
        P = self.num_params
        steps = trainer.schedule.num_steps(data.n)
        lr = trainer.schedule.lr
        if self.control_variates:
            assert server.c is not None
            c = server.c
            c_k = client.h if client.h is not None else torch.zeros_like(c)

            def finish_cv(y: torch.Tensor, result: LocalResult) -> tuple[Upload, ScaffoldClientState]:
                c_new = correction_update(c_k - c, server.x[:P], y[:P], steps, lr)
                upload = model_upload(y, data, result)
                upload.sums["dc"] = c_new - c_k
                return upload, ScaffoldClientState(h=c_new)

            return LocalTask(server.x, finish_cv, LinearCorrection(shift=c_k - c))
        last = client.last_local[:P] if client.last_local is not None else None
        h = correction_update(
            client.h if client.h is not None else torch.zeros_like(server.x[:P]),
            server.x[:P],
            last,
            steps,
            lr,
        )

        def finish(x: torch.Tensor, result: LocalResult) -> tuple[Upload, ScaffoldClientState]:
            return model_upload(x, data, result), ScaffoldClientState(h=h, last_local=x)

        return LocalTask(server.x, finish, LinearCorrection(shift=h))

    def server_update(
        self, server: ScaffoldServerState, aggregate: Aggregate, ctx: ServerContext
    ) -> tuple[ScaffoldServerState, dict[str, float]]:
        x = aggregate.sums["x"] / aggregate.weight
        if not self.control_variates:
            return dataclasses.replace(server, x=x), {}
        assert server.c is not None
        c = server.c + aggregate.sums["dc"] / ctx.population.size
        return ScaffoldServerState(x=x, c=c), {}
