"""FedAvg with a server learning rate: x ← x + η_g·(mean_S(y_k) − x).

η_g = 1 is FedAvg; η_g < 1 damps each round's step (the "server learning rate" of Reddi et al.,
ICLR 2021, Algorithm 1 with SGD on the server). Written only against the public contract
(``hpcfl.algorithms``), as a researcher's own method would be.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hpcfl.algorithms import (
    Aggregate,
    Algorithm,
    ClientContext,
    ClientData,
    ClientState,
    ConfigError,
    HyperParams,
    LocalTask,
    ServerContext,
    ServerState,
    local_training,
)


@dataclass(frozen=True)
class ServerLRParams(HyperParams):
    """``server_lr`` η_g in (0, 1]: the share of the round's mean step the server takes."""

    server_lr: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.server_lr <= 1.0:
            raise ConfigError(f"config key 'params.server_lr' must be in (0, 1], got {self.server_lr}")


class ServerLRFedAvg(Algorithm[ServerLRParams, ServerState, ClientState]):
    name = "example_slr"
    Params = ServerLRParams
    example_params = ServerLRParams(server_lr=0.5)
    #: DP-FedAvg fits: the upload is the local model and the server step reads only its mean
    dp_levels = ("client",)

    def local_task(
        self, server: ServerState, client: ClientState, data: ClientData, ctx: ClientContext
    ) -> LocalTask[ClientState]:
        return local_training(server, client, data)

    def server_update(
        self, server: ServerState, aggregate: Aggregate, ctx: ServerContext
    ) -> tuple[ServerState, dict[str, float]]:
        mean = aggregate.sums["x"] / aggregate.weight
        x = server.x + self.params.server_lr * (mean - server.x)
        return dataclasses.replace(server, x=x), {}
