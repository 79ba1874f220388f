"""FedProx (Li et al., 2020): FedAvg with a proximal term (μ/2)‖w − w_global‖² in each local loss."""

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
    model_upload,
)


@dataclass(frozen=True)
class FedProxParams(HyperParams):
    """mu: weight of the proximal term (the FedProx paper sweeps 0.001–1; 0.01 is NIID-Bench's default)."""

    mu: float = 0.01


class FedProx(Algorithm[FedProxParams, ServerState, ClientState]):
    name = "fedprox"
    Params = FedProxParams

    def client_update(
        self, server: ServerState, client: ClientState, data: ClientData, ctx: ClientContext
    ) -> tuple[Upload, ClientState]:
        assert ctx.trainer is not None
        anchor = server.x[: self.num_params]
        mu = self.params.mu

        def proximal(w: torch.Tensor, d: torch.Tensor) -> None:
            d.add_(w - anchor, alpha=mu)

        x, result = ctx.trainer.train(server.x, data, ctx.generator, correction=proximal)
        return model_upload(x, data, result), client
