"""FedProx (Li et al., 2020): FedAvg with a proximal term (μ/2)‖w − w_global‖² in each local loss.

Its systems-heterogeneity setting (§5.2: stragglers doing a smaller, uniformly drawn number of
epochs, whose partial work FedProx keeps while FedAvg drops it) is the ``system.work`` kind
``stragglers`` with ``drop: false`` / ``drop: true`` (:mod:`hpcfl.algorithms.system`)."""

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
    check_weighting,
    model_upload,
)
from hpcfl.errors import ConfigError
from hpcfl.training.batched import LinearCorrection


@dataclass(frozen=True)
class FedProxParams(HyperParams):
    """mu: weight of the proximal term (the FedProx paper sweeps 0.001–1; 0.01 is NIID-Bench's default).
    weighting: the server's model mean, ``samples`` (default: the FedProx paper's p_k = n_k/n and
    NIID-Bench) or ``uniform``."""

    mu: float = 0.01
    weighting: str = "samples"

    def __post_init__(self) -> None:
        check_weighting(self.weighting)
        if not self.mu >= 0:  # also refuses NaN; a negative μ pushes the model away from the server's
            raise ConfigError(f"config key 'params.mu' (FedProx's μ) must be >= 0, got {self.mu}")


class FedProx(Algorithm[FedProxParams, ServerState, ClientState]):
    name = "fedprox"
    dp_levels = ("client", "sample")  # the upload is the model and the server step reads its mean
    legacy_sections = ("fedprox",)
    Params = FedProxParams
    divergence_params = ("mu",)  # lr·μ > 2 diverges the proximal pull

    def local_task(
        self, server: ServerState, client: ClientState, data: ClientData, ctx: ClientContext
    ) -> LocalTask[ClientState]:
        proximal = LinearCorrection(pull=self.params.mu, anchor=server.x[: self.num_params])
        weighting = self.params.weighting
        return LocalTask(
            server.x, lambda x, result: (model_upload(x, data, result, weighting=weighting), client), proximal
        )
