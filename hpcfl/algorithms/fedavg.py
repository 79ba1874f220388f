"""FedAvg (McMahan et al., 2017): local SGD, then the n_k/n-weighted average of the models
(``weighting: samples``, the paper's Algorithm 1 and NIID-Bench; ``uniform`` gives the plain mean the
FedPVR authors' code takes for every method)."""

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
    check_weighting,
    model_upload,
)

C = TypeVar("C", bound=ClientState)


@dataclass(frozen=True)
class FedAvgParams(HyperParams):
    """``weighting``: the server's model mean, ``samples`` (default: McMahan et al., Algorithm 1,
    n_k/n) or ``uniform``; see :data:`hpcfl.algorithms.base.WEIGHTINGS`."""

    weighting: str = "samples"

    def __post_init__(self) -> None:
        check_weighting(self.weighting)


def local_training(
    server: ServerState, client: C, data: ClientData, weighting: str = "samples"
) -> LocalTask[C]:
    """FedAvg's client step: plain local SGD from the server model, the model uploaded with its
    ``weighting`` weight."""
    return LocalTask(server.x, lambda x, result: (model_upload(x, data, result, weighting=weighting), client))


class FedAvg(Algorithm[FedAvgParams, ServerState, ClientState]):
    name = "fedavg"
    dp_levels = ("client", "sample")  # the upload is the model and the server step reads its mean
    Params = FedAvgParams

    def local_task(
        self, server: ServerState, client: ClientState, data: ClientData, ctx: ClientContext
    ) -> LocalTask[ClientState]:
        return local_training(server, client, data, self.params.weighting)
