"""What the asynchronous algorithms (FedBuff, FedAsync) share: staleness weights, the server state
that holds the updates still in flight, and the local step (issue 54).

An asynchronous algorithm (a subclass of :class:`AsyncAlgorithm`: the runner checks the type) runs
on the virtual clock (:mod:`hpcfl.algorithms.clock`, :mod:`hpcfl.runner.asynchronous`): at most
``concurrency`` clients train at once; each starts from the server model current when it is
dispatched and its update arrives ``samples / speed + delay`` simulated seconds later. A round of
the runner is one server step: its participants are the clients dispatched from that step's model,
trained (spread over ranks, vectorised with ``client_batch``) as in a synchronous round, and its
server step applies the ``buffer_size`` updates that arrive next, in simulated-arrival order
(``ServerContext.arrivals``). An update arriving after the steps it missed has ``staleness`` = the
applying step − the step it trained from. The trained models are gathered (every rank holds every
update exactly) and kept in the server state's ``pending`` rows until applied, so a checkpoint holds
everything in flight and a resume is bit-identical.

Local steps: ``local: fedavg`` (plain local SGD) or ``fedprox`` (with the proximal term ``mu``).
These are the existing methods that can run asynchronously: their client step reads only the model it
starts from and keeps no client state. The others are refused: SCAFFOLD, FedPVR, FedDyn, MOON,
FedCKA, the personalised methods keep per-client state or control variates built from synchronous
aggregates, FedNova normalises one round's step counts, FedAvgM/FedAdam are server optimisers
(FedBuff's ``server_lr`` is its server step) and TCT/NTK-FL are staged synchronous methods.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch

from hpcfl.algorithms.base import (
    Aggregate,
    Algorithm,
    Arrival,
    ClientContext,
    ClientData,
    ClientState,
    Exchange,
    HyperParams,
    LocalTask,
    ServerContext,
    ServerState,
    Upload,
)
from hpcfl.algorithms.participation import Population
from hpcfl.errors import ConfigError
from hpcfl.training.batched import LinearCorrection
from hpcfl.training.sgd import LocalResult, LocalSchedule

STALENESS = ("constant", "polynomial", "hinge")
LOCAL_STEPS = ("fedavg", "fedprox")


def staleness_weight(kind: str, staleness: int, a: float, b: int) -> float:
    """s(τ) of Xie et al. 2019 (FedAsync, §5.2): ``constant`` 1; ``polynomial`` (τ + 1)^−a;
    ``hinge`` 1 for τ <= b, else 1 / (a(τ − b) + 1). FedBuff's 1/√(1 + τ) is polynomial, a = 0.5."""
    if kind == "constant":
        return 1.0
    if kind == "polynomial":
        return float((staleness + 1) ** -a)
    return 1.0 if staleness <= b else 1.0 / (a * (staleness - b) + 1.0)


@dataclass(frozen=True)
class AsyncParams(HyperParams):
    """The shared hyper-parameters of an asynchronous algorithm.

    ``concurrency``: clients training at once (None: the run's ``clients_per_round``, else every
    client); ``staleness``: the weight s(τ) of a stale update, ``constant``, ``polynomial`` with
    exponent ``a`` > 0, or ``hinge`` with slope ``a`` > 0 and threshold ``b`` >= 0 steps (Xie et al.
    2019); ``local``: the local step, ``fedavg`` or ``fedprox`` (with ``mu``)."""

    concurrency: int | None = None
    staleness: str = "polynomial"
    a: float = 0.5
    b: int = 4
    local: str = "fedavg"
    mu: float = 0.01

    def __post_init__(self) -> None:
        if self.concurrency is not None and (isinstance(self.concurrency, bool) or self.concurrency < 1):
            raise ConfigError(f"config key 'params.concurrency' must be >= 1, got {self.concurrency}")
        if self.staleness not in STALENESS:
            raise ConfigError(
                f"config key 'params.staleness' must be one of {', '.join(STALENESS)}, got {self.staleness!r}"
            )
        if self.staleness != "constant" and not (self.a > 0 and math.isfinite(self.a)):
            raise ConfigError(
                f"config key 'params.a' (the {self.staleness} staleness exponent) must be > 0 and finite, "
                f"got {self.a}"
            )
        if self.staleness == "hinge" and (isinstance(self.b, bool) or self.b < 0):
            raise ConfigError(
                f"config key 'params.b' (the hinge's threshold in steps) must be >= 0, got {self.b}"
            )
        if self.local not in LOCAL_STEPS:
            raise ConfigError(
                f"config key 'params.local' must be fedavg or fedprox, got {self.local!r}: only local steps "
                "that read nothing but the model they start from and keep no client state run asynchronously"
            )
        if not self.mu >= 0:
            raise ConfigError(f"config key 'params.mu' must be >= 0, got {self.mu}")


@dataclass
class AsyncServerState(ServerState):
    """The model ``x`` and the updates still in flight: ``pending`` holds one trained row per
    update (what the algorithm keeps of it), ``pending_keys`` its (version, client).

    The rows are slots: a key of (-1, -1) marks a free one, which the next step's updates fill in
    place. Rebuilding the matrix each step (concatenating the new rows, then indexing out the
    applied ones) copied every update in flight twice per step: at a concurrency of 100 with the
    MLP, more than half of an asynchronous run's time (issue 63)."""

    server_only: ClassVar[tuple[str, ...]] = ("pending", "pending_keys")

    pending: torch.Tensor  # (slots, state_size)
    pending_keys: torch.Tensor  # (slots, 2) int64: (version, client); (-1, -1): a free slot

    @property
    def in_flight(self) -> int:
        """How many updates are pending (a read of the keys from their device)."""
        return int((self.pending_keys[:, 0] >= 0).sum())


FREE = (-1, -1)
"""The key of a free slot of :attr:`AsyncServerState.pending`."""


P = TypeVar("P", bound=AsyncParams)


class AsyncAlgorithm(Algorithm[P, AsyncServerState, ClientState]):
    """The shared part of FedBuff and FedAsync: the local step, the exchange (each participant's
    trained model, gathered), the pending updates, and the resolved concurrency. A subclass sets
    :meth:`kept` (what is kept of a trained model) and :meth:`apply` (the server step)."""

    unbatched_reason = "none: the local step is a declared task"

    def __init__(self, params: P, **kwargs: object) -> None:
        super().__init__(params, **kwargs)  # type: ignore[arg-type]
        self.concurrency = params.concurrency or 0  # resolved() sets it from the population

    @property
    def buffer_size(self) -> int:
        """Updates per server step."""
        return 1

    def resolved(
        self, population: Population, schedule: LocalSchedule, *, heterogeneous: bool = False
    ) -> AsyncAlgorithm[P]:
        """The concurrency made concrete (``clients_per_round`` or every client) and checked
        against the population and the buffer, before any update."""
        concurrency = self.params.concurrency or self.participation.count or population.size
        if concurrency > population.size:
            raise ConfigError(
                f"params.concurrency is {concurrency} but the run has {population.size} clients: at most "
                "one update per client is in flight; lower it"
            )
        self.concurrency = concurrency  # first: a default buffer size follows it (FedBuff)
        if self.buffer_size > concurrency:
            raise ConfigError(
                f"params.buffer_size ({self.buffer_size}) is larger than the concurrency ({concurrency}): the "
                "buffer could never fill; lower buffer_size or raise concurrency (or clients_per_round)"
            )
        return self

    def exchange(self, dtype: torch.dtype = torch.float32) -> Exchange:
        """Each participant's trained model, gathered: the updates apply one by one, later."""
        return Exchange(sums=(), gathers=("y",))

    def participants(self, rnd: int, population: Population, generator: torch.Generator) -> list[int]:
        """Never asked: the runner's clock dispatches the participants (hpcfl.runner.asynchronous)."""
        raise RuntimeError(f"{self.name} is asynchronous: its participants come from the virtual clock")

    def init_server(self, x0: torch.Tensor) -> AsyncServerState:
        return AsyncServerState(
            x=x0.clone(),
            pending=x0.new_zeros((0, x0.numel())),
            pending_keys=torch.zeros((0, 2), dtype=torch.int64, device=x0.device),
        )

    def local_task(
        self, server: AsyncServerState, client: ClientState, data: ClientData, ctx: ClientContext
    ) -> LocalTask[ClientState]:
        correction = None
        if self.params.local == "fedprox":
            correction = LinearCorrection(pull=self.params.mu, anchor=server.x[: self.num_params])

        def finish(y: torch.Tensor, result: LocalResult) -> tuple[Upload, ClientState]:
            return Upload(sums={}, weight=1.0, gathered={"y": y}, metrics={"loss": result.loss}), client

        return LocalTask(server.x, finish, correction)

    def kept(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """What the server keeps of model ``y`` trained from ``x`` until it applies it."""
        raise NotImplementedError

    def apply(
        self, x: torch.Tensor, rows: list[torch.Tensor], arrivals: tuple[Arrival, ...]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The server step: ``x`` after the arrived updates (``rows[i]`` kept of ``arrivals[i]``)."""
        raise NotImplementedError

    def server_update(
        self, server: AsyncServerState, aggregate: Aggregate, ctx: ServerContext
    ) -> tuple[AsyncServerState, dict[str, float]]:
        """Keep the updates trained from this step's model, then apply the arrived ones in order."""
        trained = aggregate.gathered.get("y", [])
        pending = server.pending
        keys = server.pending_keys.tolist()  # host: the (slots, 2) keys, read once a step
        if trained:
            free = [i for i, key in enumerate(keys) if tuple(key) == FREE]
            short = len(trained) - len(free)
            if short > 0:  # more in flight than ever before (the first steps): grow by the shortfall
                size = pending.shape[0]
                pending = torch.cat([pending, pending.new_zeros((short, pending.shape[1]))])
                keys += [list(FREE)] * short
                free += range(size, size + short)
            # in place: a slot free in ``server`` holds nothing it still needs
            arrived = zip(ctx.participants, trained, strict=True)
            for slot, (k, y) in zip(free, arrived, strict=False):  # more free slots than updates: fine
                pending[slot] = self.kept(y.to(server.x.device), server.x)
                keys[slot] = [ctx.round, k]
        index = {(v, k): i for i, (v, k) in enumerate(keys) if (v, k) != FREE}
        try:
            chosen = [index[(a.version, a.client)] for a in ctx.arrivals]
        except KeyError as err:  # the clock and the pending rows disagree: a damaged checkpoint
            raise RuntimeError(f"{self.name}: update {err} arrived but is not pending") from None
        x, metrics = self.apply(server.x, [pending[i] for i in chosen], ctx.arrivals)
        for i in chosen:
            keys[i] = list(FREE)
        new_keys = torch.tensor(keys, dtype=torch.int64, device=server.pending_keys.device).view(-1, 2)
        return dataclasses.replace(server, x=x, pending=pending, pending_keys=new_keys), metrics
