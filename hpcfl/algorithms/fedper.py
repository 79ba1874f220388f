"""FedPer (Arivazhagan, Aggarwal, Singh & Choudhary, "Federated Learning with Personalization
Layers", 2019): a shared body (base layers) averaged by FedAvg, and a personal head
(personalisation layers) that each client keeps.

Algorithm 1 of the paper: client k starts its round from the server's base layers W_B and its own
personalisation layers W_{P_k}, runs its local SGD epochs on both together, and sends back W_B
only; the server sets W_B ← Σ_k (n_k/n) W_{B,k}. So only the body is exchanged, both ways: the
upload is the state vector without the head's slices (``bytes_up`` counts that) and so is the
download (the exchange declares ``received``, so ``bytes_down`` counts the body only), and the head
lives in the client's state (memory or the on-disk store). A client's first round starts from the
initial head, part of the model's seeded initialisation that every client builds itself; it is not
counted as traffic. Float buffers (BatchNorm statistics) belong to the
body.

Judged per client (:attr:`personalised`): a client's model is the server's body with its own head
(a client never trained has the initial head, which the server's ``x`` keeps in its head slices; the
server's ``test_accuracy`` is therefore the body with the initial head, not a model any client uses:
read ``personal_acc_*`` under ``client_eval``).

``head``: the personalisation layers by module name, default ``classifier`` (the last layer; the
paper varies how many of the last layers are personal). A head that names no
layer or the whole model is refused with one line before any round. Every local step is plain SGD
on the whole model, so ``client_batch`` trains participants as one vectorised step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hpcfl.algorithms.base import (
    ClientContext,
    ClientData,
    ClientState,
    HyperParams,
    LocalTask,
    ServerState,
    check_weighting,
)
from hpcfl.algorithms.split import SplitAlgorithm, head_entries, module_names
from hpcfl.training.layout import Entry
from hpcfl.training.sgd import LocalResult


@dataclass(frozen=True)
class FedPerParams(HyperParams):
    """``head``: the personal layers (module names; default the classifier). ``weighting``: the
    server's mean of the body, ``samples`` (default, the paper's n_k/n) or ``uniform``."""

    head: tuple[str, ...] = ("classifier",)
    weighting: str = "samples"

    def __post_init__(self) -> None:
        check_weighting(self.weighting)
        object.__setattr__(self, "head", module_names(self.head, "head"))


@dataclass
class HeadState(ClientState):
    """head: the client's personal head (its slices of the state vector, in order); None until it
    trains (it then starts from the server's initial head)."""

    head: torch.Tensor | None = None


class FedPer(SplitAlgorithm[FedPerParams, HeadState]):
    name = "fedper"
    dp_refusal = "its upload is the shared body alone, its head client state (not analysed for DP)"
    Params = FedPerParams
    personalised = True

    def kept_entries(self) -> list[Entry]:
        """The head's trainable entries; a head that names no layer or the whole model is refused."""
        return head_entries(self.layout, self.params.head, self.name)

    def init_client(self, k: int, server: ServerState) -> HeadState:
        return HeadState()

    def start(self, server: ServerState, client: HeadState) -> torch.Tensor:
        """The model client ``k`` starts from (and is judged by): the server's body, its own head."""
        return self.split.with_kept(server.x, client.head)

    def personal_model(
        self, server: ServerState, client: HeadState, data: ClientData, ctx: ClientContext
    ) -> torch.Tensor:
        return self.start(server, client)

    def finish(self, y: torch.Tensor, data: ClientData, result: LocalResult) -> tuple[Any, HeadState]:
        """The body uploaded, the head kept."""
        return self.shared_upload(y, data, result), HeadState(head=self.split.kept_of(y))

    def local_task(
        self, server: ServerState, client: HeadState, data: ClientData, ctx: ClientContext
    ) -> LocalTask[HeadState]:
        return LocalTask(self.start(server, client), lambda y, result: self.finish(y, data, result))
