"""FedAvg (McMahan et al., 2017): local SGD, then the n_k/n-weighted average of the models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

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

C = TypeVar("C", bound=ClientState)


@dataclass(frozen=True)
class FedAvgParams(HyperParams):
    """FedAvg has no hyper-parameters beyond the local schedule."""


def local_training(server: ServerState, client: C, data: ClientData) -> LocalTask[C]:
    """FedAvg's client step: plain local SGD from the server model, the model uploaded."""
    return LocalTask(server.x, lambda x, result: (model_upload(x, data, result), client))


class FedAvg(Algorithm[FedAvgParams, ServerState, ClientState]):
    name = "fedavg"
    Params = FedAvgParams

    def local_task(
        self, server: ServerState, client: ClientState, data: ClientData, ctx: ClientContext
    ) -> LocalTask[ClientState]:
        return local_training(server, client, data)
