"""The stage contract: what the runner hands stage code, what stage code gives back, and the round
plan with its observers (public, below the runner; exported from :mod:`hpcfl.algorithms`).

An algorithm with several stages (TCT) or its own round set-up (NTK-FL) names an ``enter`` hook
(:class:`hpcfl.algorithms.Stage`). The runner calls it with a :class:`StageInput`: the run's
:class:`FederationView` (what stage code may READ of the federation: data, partition, model,
algorithm, seeds; never the communicator), the communicator as a separate argument (collectives
only through it), the run directory and the previous stage's final state. The hook returns a
:class:`StagePlan`: a :class:`RoundPlan`, the stage's initial server state and its clients' initial
states, which the runner drives. Stage code (``hpcfl.tct``, ``hpcfl.ntk``) depends on this module
only, never on :mod:`hpcfl.runner`, which implements :class:`FederationView` and fills these types.

The round's metrics are :class:`Observer` objects (defined here because a :class:`RoundPlan` carries
them; the standard observers and the loop that calls them live in :mod:`hpcfl.runner.observers`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import torch

from hpcfl.algorithms.base import (
    Aggregate,
    Algorithm,
    ClientData,
    ClientState,
    ServerState,
    Trainer,
    Upload,
)
from hpcfl.algorithms.clock import VirtualClock
from hpcfl.algorithms.participation import Population
from hpcfl.algorithms.system import RoundSystem, SystemModel

if TYPE_CHECKING:  # annotations only: the communicator, data and model types sit below the contract
    from torch import nn

    from hpcfl.comm.base import Communicator
    from hpcfl.data import Dataset
    from hpcfl.training.evaluate import JointCounts
    from hpcfl.training.flat import FlatModel

# -- round observers -------------------------------------------------------------------------------

# What a channel holds one slot of: the whole round (every contribution added), each participant
# of the round (in draw order), each client of the population (by id), or each rank.
Per = Literal["round", "participant", "client", "rank"]
# A value for a channel: a slot's content, or for a per-round channel an addend, optionally scaled
# (``(v, a)`` adds a·v in one fused step, as the loop adds weighted uploads).
Value = torch.Tensor | float | tuple[torch.Tensor, float]


@dataclass(frozen=True)
class Channel:
    """A segment of the round's buffer owned by one observer: ``width`` floats per slot."""

    name: str
    width: int
    per: Per = "round"

    def length(self, participants: int, clients: int, ranks: int) -> int:
        slots = {"round": 1, "participant": participants, "client": clients, "rank": ranks}[self.per]
        return self.width * slots


@dataclass(frozen=True)
class RoundStart:
    """A round as it begins."""

    round: int  # 0-based, within the stage
    who: tuple[int, ...]  # the participants, in draw order (slot i of a per-participant channel)
    population: Population
    server: ServerState  # the state the participants start from
    started: float  # time.perf_counter() when the round began
    writes_row: bool  # whether the round ends with a metrics row (costly observers work only then)
    final: bool = False  # the stage's last round (observers that work only at the end)
    system: RoundSystem | None = None  # the round's drawn work and dropouts (``system``), None when off

    @property
    def dropped(self) -> tuple[int, ...]:
        """The participants drawn for the round that dropped out (not in :attr:`who`)."""
        return self.system.dropped if self.system is not None else ()

    @functools.cached_property
    def position(self) -> dict[int, int]:
        """Each participant's index in :attr:`who` (its slot in per-participant channels)."""
        return {k: i for i, k in enumerate(self.who)}


@dataclass(frozen=True)
class LocalWork:
    """This rank's local work of a round, done (before the allreduce)."""

    start: RoundStart
    trained: float  # time.perf_counter() when the local updates and their state I/O ended
    state_io_s: float  # seconds this rank waited for client-state reads and writes


@dataclass(frozen=True)
class RoundEnd:
    """A finished round: allreduced and server-updated (evaluated by the time :meth:`Observer.row`
    sees it)."""

    work: LocalWork
    server: ServerState  # after the server update
    sums: Mapping[str, torch.Tensor]  # the declared sums as allreduced, in the buffer's dtype
    aggregate: Aggregate
    server_metrics: Mapping[str, Any]  # what the algorithm's server update reported
    upload_bytes: int  # one participant's declared sums, in bytes
    download_bytes: int  # what one participant receives (Exchange.download_nbytes), in bytes
    buffer_bytes: int  # the round's allreduced buffer, in bytes
    reduced: float  # time.perf_counter() after the allreduce (and the allgather, if any)
    #: a client's state after the round (read on the rank that may read it: any rank from the
    #: on-disk store, the training rank from memory), for personal models' evaluation; None: none
    client_state: Callable[[int], ClientState] | None = None


class Observer:
    """A metric of the round loop; the hooks' defaults do nothing (override what you need)."""

    group: ClassVar[str] = "metrics"  # the namespace a logger files the columns under
    columns: tuple[str, ...] = ()  # the row keys it may write

    def channels(self) -> tuple[Channel, ...]:
        return ()

    def start(self, start: RoundStart) -> None:
        """A round begins (keep what :meth:`client` compares against)."""

    def client(self, start: RoundStart, k: int, upload: Upload) -> dict[str, Value]:
        """Participant ``k`` trained on this rank: values for its channels."""
        return {}

    def local_done(self, work: LocalWork) -> dict[str, Value]:
        """This rank's local work is done: values for its per-rank (or per-round) channels."""
        return {}

    def eval_counts(self, end: RoundEnd) -> torch.Tensor | None:
        """In a round that writes a row, before the evaluation: this rank's share (float64, 1-D) of
        values to sum over ranks in the evaluation's ONE allreduce (per-client evaluation's table),
        or None. :meth:`row` finds their sum in ``slots[EVAL_SLOT]``."""
        return None

    def row(self, end: RoundEnd, slots: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The round's columns; ``slots`` holds its channels, summed over ranks (and, under
        :data:`EVAL_SLOT`, its :meth:`eval_counts` summed with the evaluation's counts)."""
        return {}


#: The ``slots`` key of an observer's :meth:`Observer.eval_counts`, summed over ranks.
EVAL_SLOT = "eval"


# -- the round plan ----------------------------------------------------------------------------------

# Evaluates the server state; returns metric columns (test_accuracy, test_loss, ...). Its counts
# over ranks and the observers' ``eval_counts`` (the JointCounts) are summed in ONE allreduce
# (JointCounts.reduce); an evaluator with nothing to sum over ranks may leave the JointCounts alone.
Evaluator = Callable[[ServerState, "JointCounts"], dict[str, float]]
# The RNG of client k in round r (a pure function of seed, round and client).
GeneratorFn = Callable[[int, int], torch.Generator]


@dataclass
class RoundPlan:
    """What the loop needs besides the states: who may train, on what, and how results are judged."""

    algorithm: Algorithm
    comm: Communicator
    data: Callable[[int], ClientData]  # any client's data, on the training device
    trainer: Trainer | None
    population: Population
    generator: GeneratorFn
    evaluate: Evaluator
    seed: int = 0
    stage_index: int = 0
    eval_every: int = 1
    reduction: str = "float64"  # float64 (placement-independent) | float32
    #: the step size a local update's divergence is blamed on first, as (name, value): ("lr", 0.05);
    #: None: the message names no value
    learning_rate: tuple[str, float] | None = None
    #: the other settings a divergence may come from, as (name, value): (("params.server_lr", 1.0),)
    divergence_settings: tuple[tuple[str, float], ...] = ()
    observers: tuple[Observer, ...] = ()  # metrics chosen by the config (CKA, drift diversity, ...)
    client_metrics: tuple[str, ...] = ("loss",)  # what the participants' local updates report
    #: participants per vectorised training step, ``auto`` already resolved (resolve_client_batch)
    client_batch: int = 1
    #: participants trained at once in Python threads on the CPU (``client_threads``)
    client_threads: int = 1
    system: SystemModel | None = None  # unequal work and dropped participants (``system``), None when off
    clock: VirtualClock | None = None  # simulated time (``system.clock``), None when off


# -- what stage code may read, and what it returns -----------------------------------------------


class FederationView(Protocol):
    """The static part of a run as stage code may read it on one rank (read-only; no communicator:
    collectives go through :attr:`StageInput.comm`). The runner's ``Federation`` implements it."""

    @property
    def device(self) -> torch.device: ...

    @property
    def dataset(self) -> Dataset: ...

    @property
    def parts(self) -> list[torch.Tensor]:
        """Train indices of every client (every rank knows all of them)."""
        ...

    @property
    def flat(self) -> FlatModel:
        """The configured model, flattened (stage code may load a state into it)."""
        ...

    @property
    def algorithm(self) -> Algorithm: ...

    @property
    def trainer(self) -> Trainer: ...

    @property
    def population(self) -> Population: ...

    @property
    def clients(self) -> dict[int, ClientData]:
        """The data of the clients this rank owns under the static placement."""
        ...

    @property
    def client_eval(self) -> list[torch.Tensor] | None:
        """Each client's held-out share (train indices, ``client_eval``), or None when off."""
        ...

    @property
    def system(self) -> SystemModel | None:
        """The run's unequal work and dropped participants (``system``), or None when off."""
        ...

    def client_evaluation(
        self,
        score: Callable[[torch.Tensor, int], tuple[float, float]],
        place: Callable[[list[int]], list[int]],
        finetune: Callable[[torch.Tensor, int, int], torch.Tensor | None] | None,
    ) -> Observer | None:
        """Per-client evaluation (``client_eval``, issue 28) of a model the stage evaluates itself
        (TCT's stage 2), with the run's sample, spread and ``client_metrics.jsonl``; None when off.
        ``score(x, k)``: (accuracy, loss) of server vector x on client k's held-out share;
        ``place(ids)``: which of the evaluated clients this rank scores; ``finetune(x, k, steps)``:
        the vector after ``finetune_eval.steps`` local steps from x, None when they diverged (the
        argument None: not offered)."""
        ...

    @property
    def seed(self) -> int: ...

    @property
    def reduction(self) -> str:
        """``float64`` (placement-independent sums) or ``float32``."""
        ...

    @property
    def chosen_metrics(self) -> tuple[str, ...]:
        """The config keys of the optional round metrics turned on (``cka_metrics``, ``drift_diversity``)."""
        ...

    @property
    def model_name(self) -> str:
        """The configured model's registry name (for messages)."""
        ...

    @property
    def flat_inputs(self) -> bool:
        """Whether the configured model flattens its input into an ``nn.Linear`` first layer
        (:attr:`hpcfl.registry.ModelSpec.flat_inputs`)."""
        ...

    def client_data(self, k: int) -> ClientData:
        """Client ``k``'s training samples on the device."""
        ...

    def build_model(self, input_shape: tuple[int, int, int]) -> nn.Module:
        """The configured model (its options) for inputs of ``input_shape``, initialised from the
        run's seed, on the device."""
        ...

    def model_plan(self) -> RoundPlan:
        """The round plan the runner gives a stage that trains the configured model."""
        ...


@dataclass(frozen=True)
class StageInput:
    """The run as a stage sees it on entry."""

    fed: FederationView
    comm: Communicator  # the only way stage code talks to other ranks
    run_dir: Path
    previous: ServerState | None  # the previous stage's final state; None when resuming inside the stage
    stage_index: int
    stop: Callable[[], bool] | None = None  # polled inside long set-up work (True: a stop was asked for)
    sweep: bool = False  # entered by `hpcfl tct-stage2` on a run's stored inputs: read them, never rewrite


@dataclass
class StagePlan:
    """A stage's rounds: the plan, its initial server state and its clients' initial states."""

    plan: RoundPlan
    server: ServerState
    init_client: Callable[[int], ClientState]
