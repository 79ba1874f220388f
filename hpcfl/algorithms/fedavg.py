"""FedAvg (McMahan et al., 2017): local SGD, then the n_k/n-weighted average of the models."""

from __future__ import annotations

from dataclasses import dataclass

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
class FedAvgParams(HyperParams):
    """FedAvg has no hyper-parameters beyond the local schedule."""


def local_training(server: ServerState, data: ClientData, ctx: ClientContext) -> Upload:
    """FedAvg's client step: plain local SGD from the server model, the model uploaded."""
    assert ctx.trainer is not None
    x, result = ctx.trainer.train(server.x, data, ctx.generator)
    return model_upload(x, data, result)


class FedAvg(Algorithm[FedAvgParams, ServerState, ClientState]):
    name = "fedavg"
    Params = FedAvgParams

    def client_update(
        self, server: ServerState, client: ClientState, data: ClientData, ctx: ClientContext
    ) -> tuple[Upload, ClientState]:
        return local_training(server, data, ctx), client
