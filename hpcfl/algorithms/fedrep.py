"""FedRep (Collins, Hassani, Mokhtari & Shakkottai, "Exploiting Shared Representations for
Personalized Federated Learning", ICML 2021).

FedPer's split (:mod:`hpcfl.algorithms.fedper`: a shared body φ averaged by the server, a personal
head h_k in the client state, only the body exchanged), but each round client k trains them in turn
(Algorithm 1): first τ_h updates of its head with the body frozen,
h_k ← GRD(f_k(h_k, φ^t), h_k, η), then τ_φ updates of the body with its new head frozen,
φ_k ← GRD(f_k(h_k, φ_k), φ^t, η); it uploads φ_k and the server sets φ^{t+1} to their mean. The
authors' code (``models/Update.py`` of lgcollins/FedRep, read in copies of it: the repository itself
is not in the searched corpora) does it as ``head_eps = local_eps − local_rep_ep`` head epochs, then
``local_rep_ep`` body epochs, with one SGD optimiser whose frozen parameters (``requires_grad``
False) it skips: the body's momentum is therefore zero when its phase starts, as a fresh buffer per
phase here.

Defaults: ``head_epochs = 10`` and ``body_epochs = 1``, the paper's Sec. 5 setting: "FedRep executes
ten local epochs of SGD with momentum to train the local head, followed by one or five epochs for
the representation, in each local update (depending on the dataset)" (quoted by
https://ri.k117.org/papers/exploiting_shared_representations_for_personalized_federated_learning__03f7ff75;
the code's default ``--local_rep_ep`` is 1 as well). Each counts passes of the run's
local schedule: a phase of E passes trains E × ``local_epochs`` epochs (or E × ``local_steps``
steps). A frozen part does not move at all (its step direction, weight decay included, is zeroed:
:class:`~hpcfl.algorithms.split.Freeze`); BatchNorm statistics, which belong to the body, follow
the forward passes of both phases as in the authors' code (the model is in training mode in both).

Two local phases per participant: trained one by one under ``client_batch`` (no declared task).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hpcfl.algorithms.base import ClientContext, ClientData, LocalTask, ServerState, Upload, read_phases
from hpcfl.algorithms.fedper import FedPer, FedPerParams, HeadState
from hpcfl.algorithms.split import Freeze
from hpcfl.errors import ConfigError
from hpcfl.training.sgd import LocalSchedule


@dataclass(frozen=True)
class FedRepParams(FedPerParams):
    """``head``/``weighting`` as FedPer's; ``head_epochs`` (τ_h, default 10) and ``body_epochs``
    (τ_φ, default 1): passes of the run's local schedule for each phase (module docstring)."""

    head_epochs: int = 10
    body_epochs: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if (
            isinstance(self.head_epochs, bool)
            or not isinstance(self.head_epochs, int)
            or self.head_epochs < 0
        ):
            raise ConfigError(
                f"config key 'params.head_epochs' must be an integer >= 0, got {self.head_epochs!r}"
            )
        if (
            isinstance(self.body_epochs, bool)
            or not isinstance(self.body_epochs, int)
            or self.body_epochs < 1
        ):
            raise ConfigError(
                f"config key 'params.body_epochs' must be an integer >= 1, got {self.body_epochs!r}"
            )


def passes(schedule: LocalSchedule, times: int) -> LocalSchedule:
    """The run's local schedule taken ``times`` times (epochs, or steps when it counts steps)."""
    if schedule.steps is not None:
        return dataclasses.replace(schedule, steps=schedule.steps * times)
    return dataclasses.replace(schedule, epochs=schedule.epochs * times)


class FedRep(FedPer):
    name = "fedrep"
    dp_refusal = "its upload is the shared body alone, its head client state (not analysed for DP)"
    Params = FedRepParams  # type: ignore[assignment]
    example_params = FedRepParams(head_epochs=2, body_epochs=1)
    unbatched_reason = "each participant trains its head, then its body (two local phases)"

    def local_task(
        self, server: ServerState, client: HeadState, data: ClientData, ctx: ClientContext
    ) -> LocalTask[HeadState] | None:
        return None

    def client_update(
        self, server: ServerState, client: HeadState, data: ClientData, ctx: ClientContext
    ) -> tuple[Upload, HeadState]:
        trainer = ctx.trainer
        assert trainer is not None
        p: FedRepParams = self.params  # type: ignore[assignment]
        x = self.start(server, client)
        head = self.split.param_mask(x, kept=True)  # 1 on the head's parameters
        runs = []
        if p.head_epochs:
            x, run = trainer.train_tallies(
                x,
                data,
                ctx.generator,
                correction=Freeze(head),
                schedule=passes(trainer.schedule, p.head_epochs),
            )
            runs.append(run)
        y, body_run = trainer.train_tallies(
            x,
            data,
            ctx.generator,
            correction=Freeze(1.0 - head),
            schedule=passes(trainer.schedule, p.body_epochs),
        )
        result = read_phases(data, body_run, *runs)  # one read for both phases; the body phase's loss
        return self.finish(y, data, result)
