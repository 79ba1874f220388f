"""SCAFFOLD (Karimireddy et al., 2020) in the one-model-per-round form of TCT, Appendix A.1.

Each client keeps a correction h_k and its last local model θ̂_k. At round t it sets
h_k ← h_k + (θ^t − θ̂_k)/(Mη), runs M local steps of SGD on ∇L_k − h_k from θ^t, and uploads only
θ̂_k: the same traffic as FedAvg, equivalent to Option II of the original paper. The server takes
the n_k-weighted average (TCT footnote 5).
"""

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
class ScaffoldParams(HyperParams):
    """SCAFFOLD needs no hyper-parameters beyond the local schedule (η and M)."""


@dataclass
class ScaffoldClientState(ClientState):
    """h: correction over the trainable parameters; last_local: θ̂_k (None until first trained)."""

    h: torch.Tensor | None = None
    last_local: torch.Tensor | None = None


class Scaffold(Algorithm):
    name = "scaffold"
    Params = ScaffoldParams

    def init_client(self, k: int, server: ServerState) -> ScaffoldClientState:
        return ScaffoldClientState()

    def client_update(
        self,
        server: ServerState,
        client: ClientState,
        data: ClientData,
        trainer: Trainer,
        generator: torch.Generator,
    ) -> tuple[Upload, ScaffoldClientState]:
        assert isinstance(client, ScaffoldClientState)
        P = self.num_params
        steps = trainer.schedule.num_steps(data.n)
        lr = trainer.schedule.lr
        h = client.h if client.h is not None else torch.zeros_like(server.x[:P])
        if client.last_local is not None:
            h = h + (server.x[:P] - client.last_local[:P]) / (steps * lr)

        def corrected(w: torch.Tensor, d: torch.Tensor) -> None:
            d.sub_(h)

        x, result = trainer.train(server.x, data, generator, correction=corrected)
        state = ScaffoldClientState(h=h, last_local=x)
        return Upload(payload=x, weight=float(data.n), metrics={"loss": result.loss}), state
