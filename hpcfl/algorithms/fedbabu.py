"""FedBABU (Oh, Kim & Yun, "FedBABU: Toward Enhanced Representation for Federated Image
Classification", ICLR 2022).

Federated training updates the body only: the head (the classifier) stays at its random
initialisation on every client and on the server for the whole run, and the server averages the
bodies as FedAvg does (Algorithm 1: the head's learning rate is 0 during federated training). The
upload is the body (the state vector without the head's slices; ``bytes_up`` counts that), and so
is the download (``bytes_down``): the head never changes, and its initial value is part of the
model's seeded initialisation that every client builds itself. A
client's personalised model is the global model fine-tuned on its own training data at evaluation
time, for τ_f epochs (Algorithm 1's fine-tuning stage); the run's trajectory never sees it.

Defaults, from the authors' code (junhyeog/FedBABU, a copy of jhoon-oh/FedBABU, which the searched
corpora do not hold): ``head`` = the classifier (the code's head is the layers named ``linear``, the
last one); ``finetune_epochs`` τ_f = 5 (``utils/options.py``: ``--ft_ep`` default 5, "the number of
epochs for fine-tuning"; Flower's FedBABU baseline uses 5 too) at the run's learning rate, batch
size and momentum; ``finetune`` = ``full``: the code fine-tunes body and head together
(``main_per_fedavg.py``: ``local.train(..., body_lr=lr, head_lr=lr)`` for ``ft_ep`` epochs), or
``head`` (the head alone, the body frozen: the issue's and the abstract's wording, "the head is
fine-tuned"). The paper's own text on the fine-tuned part was not at hand. A frozen part does not
move at all: its step direction, weight decay included, is zeroed
(:class:`~hpcfl.algorithms.split.Freeze`).

No client state: the personal model is rebuilt from the global one at every evaluation, from the
client's own generator stream, so it is the same on any rank and after a resume. The local step is
a declared task (plain SGD with the head frozen), so ``client_batch`` trains participants together.
"""

from __future__ import annotations

import dataclasses
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
from hpcfl.algorithms.split import Freeze, SplitAlgorithm, head_entries, module_names
from hpcfl.errors import ConfigError
from hpcfl.training.layout import Entry

FINETUNE_PARTS = ("full", "head")


@dataclass(frozen=True)
class FedBABUParams(HyperParams):
    """``head``: the layers frozen at their initialisation (default the classifier);
    ``finetune_epochs``: τ_f, epochs of fine-tuning at evaluation (default 5, >= 0; 0 judges each
    client by the global model); ``finetune``: ``full`` (default) or ``head``;
    ``weighting``: the server's mean of the bodies (``samples`` default, or ``uniform``)."""

    head: tuple[str, ...] = ("classifier",)
    finetune_epochs: int = 5
    finetune: str = "full"
    weighting: str = "samples"

    def __post_init__(self) -> None:
        check_weighting(self.weighting)
        object.__setattr__(self, "head", module_names(self.head, "head"))
        epochs = self.finetune_epochs
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
            raise ConfigError(f"config key 'params.finetune_epochs' must be an integer >= 0, got {epochs!r}")
        if self.finetune not in FINETUNE_PARTS:
            raise ConfigError(f"config key 'params.finetune' must be full or head, got {self.finetune!r}")


class FedBABU(SplitAlgorithm[FedBABUParams, ClientState]):
    name = "fedbabu"
    dp_refusal = "its upload is the body alone and it fine-tunes on client data (not analysed for DP)"
    Params = FedBABUParams
    example_params = FedBABUParams(finetune_epochs=1)
    personalised = True

    def kept_entries(self) -> list[Entry]:
        """The head's trainable entries (kept at their initialisation); a head that names no layer
        or the whole model is refused."""
        return head_entries(self.layout, self.params.head, self.name)

    def local_task(
        self, server: ServerState, client: ClientState, data: ClientData, ctx: ClientContext
    ) -> LocalTask[ClientState]:
        body = Freeze(self.split.param_mask(server.x, kept=False))  # the head's lr is 0

        def finish(y: torch.Tensor, result: Any) -> tuple[Any, ClientState]:
            return self.shared_upload(y, data, result), client

        return LocalTask(server.x, finish, body)

    def personal_model(
        self, server: ServerState, client: ClientState, data: ClientData, ctx: ClientContext
    ) -> torch.Tensor:
        """The global model fine-tuned for τ_f epochs on the client's training data."""
        if self.params.finetune_epochs == 0:
            return server.x
        trainer = ctx.trainer
        assert trainer is not None
        schedule = dataclasses.replace(trainer.schedule, epochs=self.params.finetune_epochs, steps=None)
        freeze = None
        if self.params.finetune == "head":
            freeze = Freeze(self.split.param_mask(server.x, kept=True))
        # not read here: the evaluation checks the tuned model and scores it (one read)
        tuned, _ = trainer.train_tallies(server.x, data, ctx.generator, correction=freeze, schedule=schedule)
        return tuned
