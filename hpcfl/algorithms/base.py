"""The algorithm contract: an algorithm declares its round, the runner carries it out.

An algorithm is a small typed object, ``Algorithm[Params, ServerState, ClientState]``, with pure
steps over flat state vectors:

- :meth:`Algorithm.exchange` names what each participant contributes to a SUM (one allreduce for all
  of them, packed with the runner's own channels) and what is GATHERED (sizes may differ);
- :meth:`Algorithm.participants` says who trains this round (a pure function of the round's
  generator, so it is the same on any number of ranks and after a resume);
- :meth:`Algorithm.client_update` turns the server state into one participant's :class:`Upload`;
  an algorithm whose local work is "local SGD from x0 with a gradient correction, then arithmetic
  on the result" declares it as a :class:`LocalTask` (:meth:`Algorithm.local_task`) instead, so
  the runner can train many participants in one vectorised step (``client_batch``);
- :meth:`Algorithm.server_update` turns the :class:`Aggregate` into the next server state, on every
  rank identically, and may do "local product + one allreduce" work through ``ctx.reduce``;
- :meth:`Algorithm.stages` lists the stages of a run (one by default; TCT declares two).

Algorithms never see the communicator, the rank or the file system; their states are dataclasses
that the runner checkpoints as they are.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from abc import ABC
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch

from hpcfl.algorithms.participation import Participation, Population
from hpcfl.errors import ConfigError
from hpcfl.registry import STAGE_HOOKS
from hpcfl.training.batched import ClientJob, batched_local_sgd
from hpcfl.training.flat import FlatModel
from hpcfl.training.layout import StateLayout
from hpcfl.training.sgd import (
    Correction,
    LocalResult,
    LocalSchedule,
    LocalSteps,
    LossFn,
    Tallies,
    cross_entropy_loss,
    descend,
    read_many,
    read_result,
)

if TYPE_CHECKING:  # the stage contract's types (hpcfl.algorithms.stage_types builds on this module)
    from hpcfl.algorithms.stage_types import FederationView, StageInput, StagePlan

P = TypeVar("P", bound="HyperParams")
S = TypeVar("S", bound="ServerState")
C = TypeVar("C", bound="ClientState")
C_co = TypeVar("C_co", bound="ClientState", covariant=True)


class NonFiniteLoss(Exception):
    """Raised by a client whose local training produced NaN/inf (the runner turns it into a
    collective, user-facing :class:`hpcfl.errors.DivergenceError`)."""


@dataclass
class ServerState:
    """The global model state vector every rank holds identically.

    ``server_only`` names fields the participants never receive (e.g. FedAdam's moments): they are
    checkpointed like every field but not counted in ``bytes_down``.
    """

    server_only: ClassVar[tuple[str, ...]] = ()

    x: torch.Tensor

    def evaluated(self) -> dict[str, torch.Tensor]:
        """The models the runner evaluates, by metric-column suffix: ``""`` is the reported model
        (``test_accuracy``, and the validation and train columns); another suffix adds
        ``test_accuracy<suffix>``/``test_loss<suffix>`` (FedDyn: the plain client mean is reported,
        its h-corrected x is ``_corrected``). Default: x alone."""
        return {"": self.x}


@dataclass
class ClientState:
    """Per-client memory carried across rounds (empty for stateless algorithms)."""


@dataclass(frozen=True)
class ClientData:
    """One client's local training set, already on the training device."""

    k: int
    x: torch.Tensor
    y: torch.Tensor

    @property
    def n(self) -> int:
        return int(self.y.shape[0])


@dataclass(frozen=True)
class HyperParams:
    """Base class of the per-algorithm hyper-parameter dataclasses (frozen, documented fields).

    A subclass validates its own fields in ``__post_init__`` (one :class:`ConfigError` line naming
    the key), so the config validates every algorithm's section without knowing the algorithm.
    """

    def check_data(self, dataset: str, num_classes: int) -> None:
        """Refuse values the dataset rules out (called with its class count before any data is
        read; default: nothing to check)."""

    def entk_method(self) -> str | None:
        """The eNTK feature / Jacobian implementation these params choose (recorded with the run's
        eNTK settings in ``determinism.json``), or None when the algorithm computes neither."""
        return None


@dataclass(frozen=True)
class SumSpec:
    """A vector every participant adds into the round's sum.

    ``weighted``: the runner adds ``upload.weight * vector`` (a weighted average after dividing by
    the total weight); otherwise the plain vector (e.g. SCAFFOLD's Δc, averaged over |S|).
    """

    name: str
    length: int
    dtype: torch.dtype = torch.float32
    weighted: bool = True

    @property
    def nbytes(self) -> int:
        return self.length * self.dtype.itemsize


@dataclass(frozen=True)
class Received:
    """Of the server state's field ``field``, a participant receives only ``length`` entries: the
    rest it holds itself (a personalised method's head or normalisation slices live in the client
    state, or are the model's seeded initialisation, which every client builds for itself)."""

    field: str
    length: int


@dataclass(frozen=True)
class Exchange:
    """What one participant sends in a round (summed vectors and gathered objects, by name) and
    what it receives: every field of the server state but its ``server_only`` ones, whole, except
    those named in ``received``, of which it receives the declared length."""

    sums: tuple[SumSpec, ...]
    gathers: tuple[str, ...] = ()
    received: tuple[Received, ...] = ()

    def spec(self, name: str) -> SumSpec:
        return next(s for s in self.sums if s.name == name)

    def download_nbytes(self, server: ServerState) -> int:
        """Bytes one participant downloads: each tensor field of ``server`` but its ``server_only``
        ones, whole or as much of it as ``received`` declares (in the field's dtype)."""
        partial = {r.field: r.length for r in self.received}
        total = 0
        for f in dataclasses.fields(server):
            v = getattr(server, f.name)
            if f.name in server.server_only or not isinstance(v, torch.Tensor):
                continue
            total += partial.get(f.name, v.numel()) * v.element_size()
        return total


@dataclass
class Upload:
    """One participant's contribution: the declared sums, gathered objects, weight and metrics."""

    sums: dict[str, torch.Tensor]
    weight: float
    gathered: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Aggregate:
    """What the server step sees: each declared sum over the participants, the total weight, how
    many participants contributed, and the gathered objects in participant order."""

    sums: dict[str, torch.Tensor]
    weight: float
    count: int
    gathered: dict[str, list[Any]] = field(default_factory=dict)


class Trainer:
    """Runs a client's local training on the shared working model: load x0, train, read the result.

    Every way in reads the client's data through ONE primitive, :meth:`steps` (the round's
    mini-batches and each one's gradient): :meth:`train`, :meth:`train_tallies`, :meth:`run`, the
    batched :meth:`run_many`, and an algorithm's own local loop (APFL) only call it. A variant of
    local training overrides :meth:`steps` alone (DP-SGD: :class:`hpcfl.privacy.sgd.DPTrainer`), so
    no entry point, present or future, can train around it.
    """

    def __init__(
        self, flat: FlatModel, schedule: LocalSchedule, loss_fn: LossFn = cross_entropy_loss
    ) -> None:
        self.flat = flat
        self.schedule = schedule
        self.loss_fn = loss_fn  # the task's loss; algorithms may wrap it (MOON, FedCKA)

    def steps(
        self,
        data: ClientData,
        generator: torch.Generator,
        *,
        schedule: LocalSchedule | None = None,
        loss_fn: LossFn | None = None,
    ) -> LocalSteps:
        """THE primitive: client ``data``'s local steps of one round under ``schedule`` (default: the
        run's), their mini-batches drawn from ``generator`` now and each one's gradient of
        ``loss_fn`` (default: the task's) computed as it is iterated (:class:`LocalSteps`)."""
        return LocalSteps(
            self.flat, data.x, data.y, schedule or self.schedule, generator, loss_fn or self.loss_fn
        )

    def train(
        self,
        x0: torch.Tensor,
        data: ClientData,
        generator: torch.Generator,
        *,
        loss_fn: LossFn | None = None,
        correction: Correction | None = None,
        schedule: LocalSchedule | None = None,
    ) -> tuple[torch.Tensor, LocalResult]:
        """Local training from state ``x0``; returns the new state vector (a fresh tensor).

        ``schedule`` replaces the run's schedule for this call (FedPVR trains without momentum
        and applies its own in the correction)."""
        y, tallies = self.train_tallies(
            x0, data, generator, loss_fn=loss_fn, correction=correction, schedule=schedule
        )
        return y, read_phases(data, tallies)

    def train_tallies(
        self,
        x0: torch.Tensor,
        data: ClientData,
        generator: torch.Generator,
        *,
        loss_fn: LossFn | None = None,
        correction: Correction | None = None,
        schedule: LocalSchedule | None = None,
    ) -> tuple[torch.Tensor, Tallies]:
        """:meth:`train` without reading anything from the device: the new state and the run's
        tallies, for a client that trains twice per round and reads once (:func:`read_phases`)."""
        self.flat.load(x0)
        return self._descended(self.steps(data, generator, schedule=schedule, loss_fn=loss_fn), correction)

    def _descended(self, steps: LocalSteps, correction: Correction | None) -> tuple[torch.Tensor, Tallies]:
        """Local SGD from the loaded state along ``steps``: the new state (a fresh tensor), tallies."""
        tallies = descend(self.flat, steps, correction)
        return self.flat.vector.clone(), tallies

    def with_schedule(self, schedule: LocalSchedule) -> Trainer:
        """This trainer with another run schedule (a participant's own work under ``system.work``;
        the same model buffers, so it is as cheap as the trainer itself)."""
        if schedule == self.schedule:
            return self
        other = copy.copy(self)
        other.schedule = schedule
        return other

    def run(
        self, task: LocalTask, data: ClientData, generator: torch.Generator
    ) -> tuple[torch.Tensor, LocalResult]:
        """One declared local task, trained alone (exactly :meth:`train`)."""
        return self.train(
            task.x0, data, generator, loss_fn=task.loss_fn, correction=task.correction, schedule=task.schedule
        )

    def can_batch(self, tasks: Sequence[LocalTask]) -> bool:
        """Whether :meth:`run_many` takes ``tasks`` together: they share one schedule and none brings
        its own loss (a loss over extra per-client models does not vectorise)."""
        return bool(tasks) and all(t.loss_fn is None and t.schedule == tasks[0].schedule for t in tasks)

    def run_many(
        self, tasks: Sequence[LocalTask], data: Sequence[ClientData], generators: Sequence[torch.Generator]
    ) -> list[tuple[torch.Tensor, LocalResult]]:
        """Several declared tasks, each equal to :meth:`run` up to float32 rounding. A client whose
        loss became NaN/inf comes back with ``result.finite`` False (no exception: the others' results
        stand). Every client's steps come from :meth:`steps`; plain local SGD's (exactly
        :class:`LocalSteps`) have a vectorised form, one vectorised step per local step
        (:func:`batched_local_sgd`); any other (DP-SGD's) trains each task through its own steps."""
        assert self.can_batch(tasks)
        schedule = tasks[0].schedule or self.schedule
        sources = [self.steps(d, g, schedule=schedule) for d, g in zip(data, generators, strict=True)]
        if all(type(s) is LocalSteps for s in sources):  # exactly: a subclass's steps are its own
            jobs = [
                ClientJob(t.x0, d.x, d.y, g, t.correction)
                for t, d, g in zip(tasks, data, generators, strict=True)
            ]
            W, results = batched_local_sgd(
                self.flat, jobs, schedule, self.loss_fn, batches=[s.drawn for s in sources]
            )
            return [(W[i].clone(), r) for i, r in enumerate(results)]
        trained = []
        for t, s in zip(tasks, sources, strict=True):
            self.flat.load(t.x0)
            trained.append(self._descended(s, t.correction))
        return [(y, r) for (y, _), r in zip(trained, read_many([t for _, t in trained]), strict=True)]


def read_phases(data: ClientData, reported: Tallies, *others: Tallies) -> LocalResult:
    """One read of a client's local runs of a round: the loss is ``reported``'s mean, the run is
    finite only if every run's losses and final state are (:class:`NonFiniteLoss` otherwise)."""
    finite_steps, state_finite, steps = reported.finite_steps, reported.state_finite, reported.steps
    for t in others:
        finite_steps, state_finite, steps = (
            finite_steps + t.finite_steps,
            state_finite & t.state_finite,
            steps + t.steps,
        )
    mean_over = reported.mean_over
    if mean_over is None and others:
        mean_over = reported.steps
    result = read_result(reported.loss_sum, finite_steps, state_finite, steps, mean_over=mean_over)
    if not result.finite:
        raise NonFiniteLoss(f"client {data.k}: non-finite loss after {result.steps} local steps")
    return result


@dataclass
class LocalTask(Generic[C_co]):
    """A participant's local work, declared: local SGD from ``x0`` (with ``correction``, ``loss_fn``,
    ``schedule`` as in :meth:`Trainer.train`), then ``finish(y, result)`` turns the trained state into
    the upload and the new client state. The runner may train many tasks as one vectorised step."""

    x0: torch.Tensor
    finish: Callable[[torch.Tensor, LocalResult], tuple[Upload, C_co]]
    correction: Correction | None = None
    loss_fn: LossFn | None = None
    schedule: LocalSchedule | None = None


@dataclass(frozen=True)
class ClientContext:
    """What a participant's local step may use besides the states and its data."""

    round: int  # 0-based round of the current stage
    participants: tuple[int, ...]  # those that train this round (under ``system``: not the dropped)
    population: Population
    trainer: Trainer | None  # under ``system.work``: with this participant's own schedule
    generator: torch.Generator  # this client's, a pure function of (seed, round, client)


Reducer = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Arrival:
    """An update an asynchronous server step applies (:class:`hpcfl.algorithms.asynchronous.AsyncAlgorithm`): client
    ``client`` trained from the model of step ``version`` and arrived at simulated second ``time``;
    ``staleness`` is the step applying it minus ``version``."""

    client: int
    version: int
    time: float
    staleness: int


@dataclass(frozen=True)
class ServerContext:
    """What the server step may use: the round, who took part, and a sum-only reducer over ranks
    (``reduce(t)`` returns the sum of ``t`` over every rank; it is the only collective allowed).

    ``rank``/``world`` let a step share "local product + one reduce" work among ranks (NTK-FL's
    kernel blocks); the result must not depend on them beyond floating-point summation order.
    """

    round: int
    participants: tuple[int, ...]  # those whose uploads arrived (under ``system``: not the dropped)
    population: Population
    reduce: Reducer
    rank: int = 0
    world: int = 1
    #: an asynchronous algorithm's step: the updates it applies, in simulated-arrival order
    arrivals: tuple[Arrival, ...] = ()


#: A stage hook by name: a name of :data:`hpcfl.registry.STAGE_HOOKS` (the built-ins'
#: ``"tct.enter_stage2"``, ``"ntkfl.enter"``, ...; a plugin registers its own), or, for a plugin,
#: ``"package.module:function"``. Stage code (``hpcfl.tct.*``, ``hpcfl.ntk.stage``) sits above the
#: contract and depends on it, so an algorithm never imports it; the runner resolves the name when
#: it calls the hook.
HookRef = str


def resolve_hook(hook: Callable[..., Any] | HookRef) -> Callable[..., Any]:
    """The function a stage hook names (a callable is returned as it is)."""
    if callable(hook):
        return hook
    if ":" in hook:  # a plugin's "package.module:function"
        module, _, name = hook.partition(":")
        return getattr(importlib.import_module(module), name)
    if hook not in STAGE_HOOKS:
        raise ConfigError(f"stage hook {hook!r} is not registered (hpcfl.registry.STAGE_HOOKS)")
    return STAGE_HOOKS[hook]


@dataclass(frozen=True)
class Stage:
    """One stage of a run: ``rounds`` rounds of the algorithm ``enter`` builds.

    ``enter`` is None for the stage that trains the configured model with this algorithm; otherwise
    the runner calls it with a :class:`~hpcfl.algorithms.stage_types.StageInput` (the previous
    stage's server state, a read-only view of the run's federation and the communicator) and runs the
    :class:`~hpcfl.algorithms.stage_types.StagePlan` it returns.
    ``check`` runs before the first round of the run (a refusal that needs only the config and the
    data, e.g. disk space); ``finish`` runs when the stage's rounds are done (TCT keeps θ_T1). Each
    is a function or a :data:`HookRef` (:func:`resolve_hook`). Only the runner calls them, so
    algorithms stay free of I/O.
    """

    name: str
    rounds: int
    enter: Callable[[StageInput], StagePlan] | HookRef | None = None
    check: Callable[[FederationView, Path], None] | HookRef | None = None  # refuse before any round
    finish: Callable[[StageInput], None] | HookRef | None = None  # when the stage's rounds are done


class Algorithm(ABC, Generic[P, S, C]):
    """Base class: subclasses set ``name`` and ``Params`` and implement :meth:`local_task` (the
    participant's local training declared as a :class:`LocalTask`, which the runner trains alone or
    batched with others; every built-in and the example plugin do this) or, where the local work is
    not such a task, override :meth:`client_update` itself; :meth:`server_update` when the server
    step is not the weighted average.

    Defaults: the exchange is the model state (weighted by n_k), everyone participates (or the
    run's ``clients_per_round`` sample), the server takes the weighted average, one stage.
    """

    name: ClassVar[str]
    Params: ClassVar[type[HyperParams]] = HyperParams
    #: small hyper-parameters the contract tests (tests/test_contract.py) run it with on a tiny
    #: synthetic federation; None: ``Params()``
    example_params: ClassVar[HyperParams | None] = None
    #: top-level config sections of configs written before ``params:`` existed that belong to this
    #: algorithm: one named after the algorithm holds its params, one named after a params field
    #: holds that field (TCT's ``stage1``/``stage2``); the config moves them into ``params``
    legacy_sections: ClassVar[tuple[str, ...]] = ()
    #: whether the last stage logs ``val_accuracy`` on the held-out split (``validation``), which
    #: ``hpcfl sweep --search`` selects on; False where it evaluates its own way (TCT's stage 2)
    logs_validation: ClassVar[bool] = True
    #: why the participants train one by one when :meth:`local_task` declares nothing
    unbatched_reason: ClassVar[str] = "its local work is not a declared local task"
    #: whether each client is judged by a model of its own (personalised FL): per-client evaluation
    #: (``client_eval``) then also scores :meth:`personal_model` on every evaluated client's
    #: held-out share (the ``personal_acc_*`` columns, beside the global model's ``client_acc_*``)
    personalised: ClassVar[bool] = False
    #: the hyper-parameters (``Params`` fields) besides the learning rate whose size can make the
    #: model NaN/inf (a server step's rate, FedDyn's α): a divergence message names them
    divergence_params: ClassVar[tuple[str, ...]] = ()
    #: the differential-privacy levels (``privacy.level``: ``client``, ``sample``) this algorithm
    #: supports: client level (DP-FedAvg) clips and noises the upload, which must be the whole model
    #: ``x`` alone (else refused before the first round), and needs a server step that reads only
    #: its mean; sample level (DP-SGD) needs that every read of a client's training data is through
    #: ``ctx.trainer`` (any of its methods, or a loop over its :meth:`Trainer.steps`): each is then
    #: DP-SGD and every step accounted. Either way it may train through a declared task, trainer
    #: calls inside :meth:`local_task` or its own :meth:`client_update`. Empty (the default): no DP;
    #: ``privacy.level`` other than none is refused
    dp_levels: ClassVar[tuple[str, ...]] = ()
    #: why the levels not in :attr:`dp_levels` are refused: one clause, read in the refusal
    #: "privacy.level=L does not support algorithm 'A': <dp_refusal>"
    dp_refusal: ClassVar[str] = "it declares no differential-privacy support (Algorithm.dp_levels)"

    def __init__(self, params: P, *, layout: StateLayout, participation: Participation | None = None) -> None:
        self.params: P = params
        self.layout = layout
        self.num_params = layout.num_params  # trainable entries at the front of the state vector
        self.state_size = layout.size  # parameters + float buffers
        self.participation = participation or Participation()

    # -- the round's declaration -------------------------------------------------------------
    def exchange(self, dtype: torch.dtype = torch.float32) -> Exchange:
        """The model state, weighted by the client's sample count."""
        return Exchange(sums=(SumSpec("x", self.state_size, dtype),))

    def participants(self, rnd: int, population: Population, generator: torch.Generator) -> list[int]:
        """Who trains in round ``rnd`` (sorted ids): the run's participation rule."""
        return self.participation.sample(population, generator)

    def stages(self) -> Sequence[Stage]:
        """The run's stages; ``rounds`` of the single default stage is set by the runner."""
        return (Stage("train", -1),)

    def resolved(
        self, population: Population, schedule: LocalSchedule, *, heterogeneous: bool = False
    ) -> Algorithm[P, S, C]:
        """This algorithm with every ``auto`` choice that depends on the clients' sizes and the
        local schedule made (SCAFFOLD's ``form``); the runner calls it once, before the first round.
        ``heterogeneous``: the run's ``system`` section is on, so a participant's work may differ
        from ``schedule`` and participants may drop out (:mod:`hpcfl.algorithms.system`).
        Default: nothing to choose, ``self``."""
        return self

    # -- states ------------------------------------------------------------------------------
    def init_server(self, x0: torch.Tensor) -> S:
        return ServerState(x=x0.clone())  # type: ignore[return-value]

    def init_client(self, k: int, server: S) -> C:
        return ClientState()  # type: ignore[return-value]

    # -- the steps ---------------------------------------------------------------------------
    def local_task(self, server: S, client: C, data: ClientData, ctx: ClientContext) -> LocalTask[C] | None:
        """The participant's local work as a :class:`LocalTask`, or None when the algorithm trains
        inside :meth:`client_update` (then the runner trains its participants one by one)."""
        return None

    def client_update(self, server: S, client: C, data: ClientData, ctx: ClientContext) -> tuple[Upload, C]:
        """Local work of one participant in one round (default: its :meth:`local_task`, trained alone)."""
        task = self.local_task(server, client, data, ctx)
        if task is None:
            raise NotImplementedError(f"{type(self).__name__} must define client_update or local_task")
        assert ctx.trainer is not None
        y, result = ctx.trainer.run(task, data, ctx.generator)
        return task.finish(y, result)

    def personal_model(self, server: S, client: C, data: ClientData, ctx: ClientContext) -> torch.Tensor:
        """The state vector client ``data.k`` is judged by, from the server state and its own state
        (a personalised algorithm's answer; called only when :attr:`personalised`).

        Called at evaluation, by the rank that holds the client's state, with ``data`` its training
        samples and ``ctx.generator`` a stream of its own (never a training generator), so work done
        here (FedBABU's fine-tuning) never changes the run. It must not change ``server`` or
        ``client``. Default: the server's reported model."""
        return server.evaluated()[""]

    def server_update(
        self, server: S, aggregate: Aggregate, ctx: ServerContext
    ) -> tuple[S, dict[str, float]]:
        """Default server step: the weighted average of the uploaded states is the new state."""
        return dataclasses.replace(server, x=aggregate.sums["x"] / aggregate.weight), {}


#: How the server averages the participants' models: ``samples`` Σ n_k y_k / Σ n_k (FedAvg, McMahan
#: et al. 2017; NIID-Bench for every method), ``uniform`` the plain mean (1/|S|) Σ y_k (SCAFFOLD's
#: Algorithm 1, FedDyn's Algorithm 1, the FedPVR authors' code). Each algorithm that takes a
#: ``weighting`` param states its default and the reference it follows.
WEIGHTINGS = ("samples", "uniform")


def check_weighting(value: str) -> None:
    """Refuse a ``params.weighting`` outside :data:`WEIGHTINGS` (one clear line)."""
    if value not in WEIGHTINGS:
        raise ConfigError(f"config key 'params.weighting' must be samples or uniform, got {value!r}")


def upload_weight(data: ClientData, weighting: str = "samples") -> float:
    """A participant's weight in the server's model average: n_k (``samples``) or 1 (``uniform``)."""
    return float(data.n) if weighting == "samples" else 1.0


def model_upload(
    x: torch.Tensor,
    data: ClientData,
    result: LocalResult | None = None,
    *,
    weighting: str = "samples",
    **metrics: float,
) -> Upload:
    """The default upload: the local model ``x`` weighted by :func:`upload_weight` (n_k unless
    ``weighting`` is ``uniform``), with the local loss as a metric."""
    row = {"loss": result.loss} if result is not None else {}
    row.update(metrics)
    return Upload(sums={"x": x}, weight=upload_weight(data, weighting), metrics=row)


def state_to_dict(state: Any) -> dict[str, Any]:
    """A dataclass state as a plain dict (tensors kept), for ``torch.save(weights_only)``."""
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}


def state_from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Inverse of :func:`state_to_dict`."""
    return cls(**data)
