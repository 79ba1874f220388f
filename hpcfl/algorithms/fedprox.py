"""FedProx (Li et al., 2020): FedAvg with a proximal term (μ/2)‖w − w_global‖² in each local loss."""

from __future__ import annotations

from dataclasses import dataclass

from hpcfl.algorithms.base import (
    Algorithm,
    ClientContext,
    ClientData,
    ClientState,
    HyperParams,
    LocalTask,
    ServerState,
    model_upload,
)
from hpcfl.training.batched import LinearCorrection


@dataclass(frozen=True)
class FedProxParams(HyperParams):
    """mu: weight of the proximal term (the FedProx paper sweeps 0.001–1; 0.01 is NIID-Bench's default)."""

    mu: float = 0.01


class FedProx(Algorithm[FedProxParams, ServerState, ClientState]):
    name = "fedprox"
    legacy_sections = ("fedprox",)
    Params = FedProxParams

    def local_task(
        self, server: ServerState, client: ClientState, data: ClientData, ctx: ClientContext
    ) -> LocalTask[ClientState]:
        proximal = LinearCorrection(pull=self.params.mu, anchor=server.x[: self.num_params])
        return LocalTask(server.x, lambda x, result: (model_upload(x, data, result), client), proximal)
