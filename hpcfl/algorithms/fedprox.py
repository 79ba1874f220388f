"""FedProx (Li et al., 2020): FedAvg with a proximal term (μ/2)‖w − w_global‖² in each local loss."""

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
class FedProxParams(HyperParams):
    """mu: weight of the proximal term (the FedProx paper sweeps 0.001–1; 0.01 is NIID-Bench's default)."""

    mu: float = 0.01


class FedProx(Algorithm):
    name = "fedprox"
    Params = FedProxParams

    def client_update(
        self,
        server: ServerState,
        client: ClientState,
        data: ClientData,
        trainer: Trainer,
        generator: torch.Generator,
    ) -> tuple[Upload, ClientState]:
        anchor = server.x[: self.num_params]
        mu = self.params.mu  # type: ignore[attr-defined]

        def proximal(w: torch.Tensor, d: torch.Tensor) -> None:
            d.add_(w - anchor, alpha=mu)

        x, result = trainer.train(server.x, data, generator, correction=proximal)
        return Upload(payload=x, weight=float(data.n), metrics={"loss": result.loss}), client
