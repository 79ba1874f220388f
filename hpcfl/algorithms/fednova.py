"""FedNova (Wang, Liu, Liang, Joshi & Poor, NeurIPS 2020, "Tackling the Objective Inconsistency
Problem in Heterogeneous Federated Optimization"): normalised averaging.

Clients that take different numbers of local steps τ_k pull FedAvg towards the optimum of a
surrogate objective weighted by n_k·τ_k. FedNova divides each client's update by the ℓ1 norm of its
local-step coefficients a_k, then rescales by the effective step count τ_eff (the paper's normalised averaging):

    x⁺ = x − τ_eff · Σ_S p_k (x − y_k)/‖a_k‖₁,   τ_eff = Σ_S p_k ‖a_k‖₁,   p_k = n_k / Σ_S n_j.

‖a_k‖₁ = τ_k for plain local SGD; with local momentum ρ (buffer initialised to the first gradient,
no dampening, as ``torch.optim.SGD``) the coefficient of the s-th gradient is (1 − ρ^{τ_k−s+1})/(1−ρ),
so ‖a_k‖₁ = (τ_k − ρ(1 − ρ^{τ_k})/(1 − ρ))/(1 − ρ) (the paper's local-momentum case;
:func:`hpcfl.training.sgd.local_norm`, shared with SCAFFOLD's and FedPVR's control variates).

The exchange: each participant uploads its model divided by its step norm, y_k/‖a_k‖₁ (rounded
once, on the client), with the weight n_k (so the summed model is Σ_S n_k y_k/‖a_k‖₁) beside three
plain scalars, n_k‖a_k‖₁, n_k and n_k/‖a_k‖₁: FedAvg's traffic plus three numbers. The weight is
the integer n_k, as FedAvg's, and not n_k/‖a_k‖₁: the runner's float64 sum of n_k times a float32
vector is exact, so it does not depend on how the participants are placed on ranks, where a sum of
products with a full-precision weight n_k/‖a_k‖₁ rounds differently on 1 and 2 ranks (issue 51:
under unequal work a third of an MLP's parameters differed by an ulp). The server step is the
paper's update written as

    x⁺ = (1 − τ_eff·Σ_S p_k/‖a_k‖₁)·x + τ_eff·Σ_S p_k y_k/‖a_k‖₁

on the parameters; the float buffers (BatchNorm statistics take no SGD steps) take the summed
model's own weighted mean, Σ_S (n_k/‖a_k‖₁)·y_k / Σ_S n_k/‖a_k‖₁. This equals FedAvg bit for bit when every client takes the same
power-of-two number of plain SGD steps (division and multiplication by a power of two are exact and
commute with rounding; the coefficient of x is then exactly 0), and FedAvg up to rounding for any
other equal step count. Partial participation: p_k over the round's participants, as FedAvg here.

Unequal work (``system.work``, :mod:`hpcfl.algorithms.system`): τ_k is the number of steps the
participant's local training returned (``result.steps``), so ‖a_k‖₁ and τ_eff follow the work
actually done; a dropped participant contributes to neither sum, so p_k and τ_eff are over the
participants that arrived (the paper's Σ over the clients the server heard from).
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
    LocalTask,
    ServerContext,
    ServerState,
    SumSpec,
    Upload,
)
from hpcfl.training.sgd import LocalResult, local_norm


@dataclass(frozen=True)
class FedNovaParams(HyperParams):
    """FedNova (Wang et al., NeurIPS 2020) has no hyper-parameters beyond the local schedule: the
    local momentum ρ and each client's step count τ_k set ‖a_k‖₁, and τ_eff = Σ p_k‖a_k‖₁ is the
    paper's default choice of the effective step count."""


class FedNova(Algorithm[FedNovaParams, ServerState, ClientState]):
    name = "fednova"
    dp_refusal = "its normalised update is weighted by each client's local step count"
    Params = FedNovaParams

    def exchange(self, dtype: torch.dtype = torch.float32) -> Exchange:
        return Exchange(
            sums=(
                SumSpec("x", self.state_size, dtype),  # y_k/‖a_k‖₁, weighted by n_k
                SumSpec("steps", 3, dtype, weighted=False),  # (n_k‖a_k‖₁, n_k, n_k/‖a_k‖₁)
            )
        )

    def local_task(
        self, server: ServerState, client: ClientState, data: ClientData, ctx: ClientContext
    ) -> LocalTask[ClientState]:
        trainer = ctx.trainer
        assert trainer is not None
        momentum = trainer.schedule.momentum

        def finish(y: torch.Tensor, result: LocalResult) -> tuple[Upload, ClientState]:
            a = local_norm(result.steps, momentum)
            n = float(data.n)
            upload = Upload(
                sums={"x": y / a, "steps": y.new_tensor([n * a, n, n / a])},
                weight=n,
                metrics={"loss": result.loss, "tau": float(result.steps)},
            )
            return upload, client

        return LocalTask(server.x, finish)

    def server_update(
        self, server: ServerState, aggregate: Aggregate, ctx: ServerContext
    ) -> tuple[ServerState, dict[str, float]]:
        na, n, n_over_a = (float(v) for v in aggregate.sums["steps"])
        tau_eff = na / n  # Σ p_k ‖a_k‖₁
        keep = 1.0 - tau_eff * (n_over_a / n)  # 1 − τ_eff Σ p_k/‖a_k‖₁
        P = self.num_params
        x = aggregate.sums["x"] / n_over_a  # buffers: the summed model's weighted mean
        x[:P] = keep * server.x[:P] + tau_eff * (aggregate.sums["x"][:P] / n)
        return ServerState(x=x), {"tau_eff": tau_eff}
