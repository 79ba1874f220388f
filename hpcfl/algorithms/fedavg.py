"""FedAvg (McMahan et al., 2017): local SGD, then the n_k/n-weighted average of the models."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcfl.algorithms.base import (
    Algorithm,
    ClientData,
    ClientState,
    HyperParams,
    ServerState,
    Trainer,
    Upload,
)


@dataclass(frozen=True)
class FedAvgParams(HyperParams):
    """FedAvg has no hyper-parameters beyond the local schedule."""


class FedAvg(Algorithm):
    name = "fedavg"
    Params = FedAvgParams

    def client_update(
        self,
        server: ServerState,
        client: ClientState,
        data: ClientData,
        trainer: Trainer,
        generator: torch.Generator,
    ) -> tuple[Upload, ClientState]:
        x, result = trainer.train(server.x, data, generator)
        return Upload(payload=x, weight=float(data.n), metrics={"loss": result.loss}), client
