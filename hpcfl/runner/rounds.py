"""The round loop: who trains, local work, one allreduce, the server step, evaluation, bookkeeping.

The algorithm declares its round (:meth:`~hpcfl.algorithms.Algorithm.exchange`,
:meth:`~hpcfl.algorithms.Algorithm.participants`); this loop carries it out the same way for every
algorithm:

1. the participants are drawn from a generator that depends only on (seed, stage, round) and placed
   on ranks balanced by sample count (any rank can train any client; participants that drop out
   under ``system.dropout`` are placed too, then left out, so a client keeps its rank);
2. each rank runs its participants' local updates (one by one, or ``client_batch`` at a time as one
   vectorised step: :mod:`hpcfl.runner.executor`) and adds their uploads into one buffer
   (:class:`~hpcfl.runner.buffer.BufferLayout`); with ``reduction: float64`` it accumulates in
   float64 and rounds once after the allreduce, so the result does not depend on how participants
   are placed on ranks (bit-identical on 1, 2 or 3 ranks); a sum declared in float64 itself (TCT's
   closed-form stage 2) has no wider type to accumulate in, so each participant gets its own slot
   and the slots are added in draw order after the allreduce (:func:`ordered_sums`);
3. ONE allreduce (plus an allgather only when the algorithm gathers);
4. the same server update on every rank;
5. evaluation sharded over ranks (one allreduce of every count, the observers' included), and the
   metrics of the round's observers
   (:mod:`hpcfl.runner.observers`: client metrics, CKA, drift diversity, per-rank load, bytes,
   timing), which declare their own buffer channels and row columns;
6. bookkeeping (metrics, checkpoints, progress, stop requests) in the hook.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hpcfl.algorithms import ClientState, ServerState
from hpcfl.algorithms.asynchronous import AsyncAlgorithm
from hpcfl.algorithms.base import (
    Aggregate,
    ClientContext,
    Exchange,
    ServerContext,
    SumSpec,
    Upload,
    state_to_dict,
)
from hpcfl.algorithms.stage_types import (
    LocalWork,
    Observer,
    RoundEnd,
    RoundPlan,
    RoundStart,
)
from hpcfl.algorithms.system import RoundSystem
from hpcfl.comm.placement import place_round
from hpcfl.errors import ConfigError, DivergenceError
from hpcfl.runner.asynchronous import AsyncSchedule, Timeline, clock_record, raise_not_finite, round_seconds
from hpcfl.runner.buffer import BufferLayout
from hpcfl.runner.checkpoint import placed_state
from hpcfl.runner.executor import ClientExecutor
from hpcfl.runner.observers import RoundWatch, observer_segments, with_standard_observers
from hpcfl.runner.observers import _nbytes as _nbytes  # tests/test_ntkfl.py reads it here
from hpcfl.training.seeds import seeded_generator

if TYPE_CHECKING:
    from hpcfl.runner.checkpoint import Checkpoint

# Called after every round with (round_done, server, states, metrics_row or None); returns True to stop.
RoundHook = Callable[[int, ServerState, "ClientStore", dict[str, Any] | None], bool]


class ClientStore(Protocol):
    """Where client states live between rounds (memory or the on-disk client-state store)."""

    def get(self, k: int) -> ClientState: ...

    def put(self, k: int, state: ClientState) -> None: ...

    def written_elsewhere(self, k: int) -> None:
        """Another rank trained client ``k`` this round and stored its state."""

    def checkpoint(self) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
        """What a round checkpoint keeps: (per-client files this rank writes, entries of the
        checkpoint's ``extra``)."""
        ...

    def restore(self, ckpt: Checkpoint, reset: Iterable[int] = ()) -> None:
        """Return to ``ckpt``; the clients in ``reset`` start again from ``init(k)``."""


class MemoryStates:
    """Client states in a dict; a client never trained reads as ``init(k)``."""

    def __init__(
        self, init: Callable[[int], ClientState], states: dict[int, ClientState] | None = None
    ) -> None:
        self.init = init
        self.states: dict[int, ClientState] = dict(states or {})

    def get(self, k: int) -> ClientState:
        return self.states[k] if k in self.states else self.init(k)

    def put(self, k: int, state: ClientState) -> None:
        if fields(state):  # stateless algorithms keep nothing
            self.states[k] = state

    def written_elsewhere(self, k: int) -> None:
        """Nothing to do: in memory, a client is always trained on the same rank."""

    def checkpoint(self) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
        """One file per held client (the tensors themselves: saved before they change)."""
        return {k: state_to_dict(c) for k, c in self.states.items()}, {}

    def restore(self, ckpt: Checkpoint, reset: Iterable[int] = ()) -> None:
        """Take the checkpoint's per-client files (a zip CRC-checked by the loader), ``reset`` aside."""
        if "client_map" in ckpt.extra:
            raise RuntimeError("a checkpoint with a client-state store must restore into ClientStates")
        dropped, fresh = set(reset), self.init(0)  # fresh: where this run keeps each field
        self.states.update({k: placed_state(fresh, d) for k, d in ckpt.clients.items() if k not in dropped})


class StateIO:
    """Client-state reads and writes of one round, overlapped with training.

    One worker thread does every read and write in order: the next participant's state is read
    while the current one trains, and a new state is written behind. ``get``/``finish`` return
    only the time this rank actually WAITED for I/O (what the round pays for it). States in memory
    take the direct path: nothing to overlap.
    """

    def __init__(self, states: ClientStore, order: list[int]) -> None:
        self.states = states
        self.order = order
        self.waited = 0.0
        self._pool: Any = None
        self._next: dict[int, Any] = {}
        if not isinstance(states, MemoryStates) and order:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpcfl-state-io")
            self._writes: list[Any] = []
            self._prefetch(0)

    def _prefetch(self, index: int) -> None:
        if index < len(self.order):
            k = self.order[index]
            self._next[k] = self._pool.submit(self.states.get, k)

    def get(self, k: int) -> ClientState:
        if self._pool is None:
            return self.states.get(k)
        t = time.perf_counter()
        state = self._next.pop(k).result()
        self.waited += time.perf_counter() - t
        self._prefetch(self.order.index(k) + 1)
        return state

    def put(self, k: int, state: ClientState) -> None:
        if self._pool is None:
            self.states.put(k, state)
        else:
            self._writes.append(self._pool.submit(self.states.put, k, state))

    def finish(self) -> float:
        """Wait for the writes (and drop unused reads); returns the seconds spent waiting."""
        if self._pool is not None:
            t = time.perf_counter()
            for fut in [*self._writes, *self._next.values()]:
                fut.result()
            self._pool.shutdown()
            self.waited += time.perf_counter() - t
        return self.waited


def round_generator(seed: int, stage: int, rnd: int) -> torch.Generator:
    """The generator the participants of round ``rnd`` are drawn from: a pure function of (seed,
    stage, round), independent of ranks and resumes."""
    return seeded_generator(seed, 0x9A7, stage, rnd)


def round_observers(plan: RoundPlan, clock: Observer | None = None) -> tuple[Observer, ...]:
    """Every observer of the plan's rounds: the standard ones around the plan's own (and the
    simulated time's :class:`~hpcfl.runner.asynchronous.ClockRecord`, where given)."""
    return with_standard_observers(
        plan.observers, plan.client_metrics, system=plan.system is not None, clock=clock
    )


def round_layout(
    plan: RoundPlan, num_participants: int, dtype: torch.dtype, observers: Sequence[Observer] | None = None
) -> BufferLayout:
    """The round's buffer: every declared sum, the protocol's own channels (total weight,
    participant count, a non-finite flag per participant), then the observers' channels (by default
    the plan's: per-rank slots carry each rank's compute time, state I/O and peak memory, so load
    imbalance is measured without another collective)."""
    ex = plan.algorithm.exchange(dtype)
    watching = round_observers(plan) if observers is None else observers
    ordered = ordered_sums(plan, ex)
    return BufferLayout.of(
        [(f"sum:{s.name}", s.length * (num_participants if s.name in ordered else 1)) for s in ex.sums]
        + [("weight", 1), ("count", 1), ("nonfinite", num_participants)]
        + ([("weights", num_participants)] if ordered else [])
        + observer_segments(watching, num_participants, plan.population.size, plan.comm.size)
    )


def ordered_sums(plan: RoundPlan, ex: Exchange) -> frozenset[str]:
    """The declared sums that get one slot per participant, added in draw order after the allreduce:
    the float64 ones under ``reduction: float64`` on more than one rank.

    Accumulating them per rank would make their rounding depend on the placement (there is no wider
    type to accumulate in); a slot of a client trained elsewhere is zero, so the allreduce moves the
    slots exactly, and adding them in draw order repeats the one-rank running sum operation for
    operation. One rank needs no slots: its running sum already is that sum. Cost: the allreduced
    buffer holds participants × the sum's length (TCT's closed-form stage 2 with p = 100,000 and
    C = 10: 8 MB per participant instead of 8 MB per round); ``reduction: float32`` opts out.
    """
    if plan.reduction != "float64" or plan.comm.size == 1:
        return frozenset()
    return frozenset(s.name for s in ex.sums if s.dtype == torch.float64)


def buffer_dtype(plan: RoundPlan, dtype: torch.dtype) -> torch.dtype:
    """float64 for a placement-independent sum (or when a declared sum is float64), else float32."""
    ex = plan.algorithm.exchange(dtype)
    if plan.reduction == "float64" or any(s.dtype == torch.float64 for s in ex.sums):
        return torch.float64
    return ex.sums[0].dtype if ex.sums else dtype


def run_rounds(
    plan: RoundPlan,
    server: ServerState,
    states: ClientStore,
    start: int,
    stop: int,
    *,
    stage: str = "train",
    round_offset: int = 0,
    hook: RoundHook | None = None,
) -> tuple[ServerState, int]:
    """Run rounds ``start`` .. ``stop - 1``; returns the final server state and the rounds completed.

    ``round_offset`` shifts the round numbers written to metrics (TCT's stage 2 continues stage 1's
    count). What is measured is the observers' business (:mod:`hpcfl.runner.observers`): they see
    each step and add their columns to a round's metrics row; this loop is the protocol alone.
    """
    algo, comm = plan.algorithm, plan.comm
    dtype = server.x.dtype
    ex = algo.exchange(dtype)
    bdtype = buffer_dtype(plan, dtype)
    ordered = ordered_sums(plan, ex)
    # an asynchronous algorithm's steps come from the virtual clock (hpcfl.runner.asynchronous)
    steps = AsyncSchedule(plan, round_offset) if isinstance(algo, AsyncAlgorithm) else None
    draws = RoundDraws(plan, start, stop, round_offset, steps)  # refuses a round all drop out of
    timeline = steps.timeline if steps is not None else draws.timeline
    observers = round_observers(plan, clock_record(plan, start, timeline))
    executor = ClientExecutor(plan.client_batch, rank=comm.rank, threads=plan.client_threads)
    done = start
    for rnd in range(start, stop):
        t0 = time.perf_counter()
        # 1. who trains (the drawn participants but those that drop out this round; asynchronous:
        #    the clients dispatched from this step's model), and where
        who, system = draws.take(rnd)
        mine = _placed(plan, who, system, comm.rank, comm.size)
        layout = round_layout(plan, len(who), dtype, observers)
        buf = layout.allocate(bdtype, server.x.device)
        writes_row = (rnd + 1) % plan.eval_every == 0 or rnd + 1 == stop
        begun = RoundStart(
            rnd, who, plan.population, server, t0, writes_row, final=rnd + 1 == stop, system=system
        )
        watch = RoundWatch(observers, begun, layout, buf, comm.rank)
        gathered: list[tuple[int, dict[str, Any]]] = []
        io = StateIO(states, mine)  # reads the next participant's state while this one trains
        # 2. local updates of this rank's participants (one by one or in vectorised groups), added
        #    into the one buffer
        outcomes = executor.run(
            algo,
            server,
            plan.trainer,
            mine,
            io.get,
            plan.data,
            functools.partial(_client_context, plan, rnd, who, system),
        )
        diverged: list[int] = []
        for k, upload, new_state in outcomes:
            if upload is None:
                diverged.append(k)
                continue
            io.put(k, new_state)
            _accumulate(upload, layout, buf, ex, bdtype, begun.position[k], ordered)
            if ex.gathers:
                gathered.append((begun.position[k], {g: upload.gathered[g] for g in ex.gathers}))
            watch.client(k, upload)
        state_io = io.finish()
        _flag_nonfinite(layout.view(buf, "nonfinite"), begun, diverged, states)
        work = LocalWork(begun, trained=time.perf_counter(), state_io_s=state_io)
        watch.local_done(work)
        # 3. one allreduce per round (and one allgather when the algorithm gathers)
        comm.allreduce(buf)
        everything = sorted(p for part in comm.allgather(gathered) for p in part) if ex.gathers else []
        reduced = time.perf_counter()
        for k in set(who) - set(mine):
            states.written_elsewhere(k)
        _check_finite(layout.view(buf, "nonfinite"), who, round_offset + rnd + 1, _lr_hint(plan))
        # 4. the same server update on every rank
        sums, aggregate = _aggregate(layout, buf, ex, ordered, len(who), everything)
        arrivals = steps[rnd].arrivals if steps is not None else ()
        sctx = ServerContext(rnd, who, plan.population, comm.allreduce, comm.rank, comm.size, arrivals)
        server, server_metrics = algo.server_update(server, aggregate, sctx)
        _check_server_finite(server, plan, round_offset + rnd + 1)
        done = rnd + 1
        # 5. evaluation, sharded over ranks, and the observers' columns
        row = None
        if writes_row:
            end = RoundEnd(
                work,
                server,
                sums,
                aggregate,
                server_metrics,
                upload_bytes=sum(s.nbytes for s in ex.sums),
                download_bytes=ex.download_nbytes(begun.server),
                buffer_bytes=layout.nbytes(bdtype),
                reduced=reduced,
                client_state=states.get,
            )
            joint = watch.eval_counts(end)  # the observers' counts ride the evaluation's one allreduce
            evaluated = plan.evaluate(server, joint)
            joint.settle(comm)
            row = {"round": round_offset + done, "stage": stage, **evaluated, **watch.row(end)}
        # 6. bookkeeping (metrics, checkpoint, progress) lives in the hook
        if hook is not None and hook(done, server, states, row):
            return server, done
    return server, done


def _finite(state: ClientState) -> bool:
    """True when every tensor of a client state is finite (None fields count as finite)."""
    return all(
        bool(torch.isfinite(v).all())
        for f in fields(state)
        if isinstance(v := getattr(state, f.name), torch.Tensor) and v.is_floating_point()
    )


class RoundDraws:
    """Each round's participants and ``system`` draw (:func:`_draw_round`), every round drawn ONCE.

    The rounds of :func:`_drawn_up_front` are drawn before any work and kept until their turn, so
    that a round in which every participant drops out is refused before the first round; the others
    are drawn as they come. With an asynchronous schedule ``steps``, nothing is drawn up front.

    Under a virtual clock (synchronous), :attr:`timeline` records each round's simulated seconds as
    the round is taken, so a run of 100,000 rounds does no more work before round 1 than one of 10
    (issue 63: every round was drawn before the first, about 30 s for 10,000 rounds). A run resumed
    at ``start`` replays the draws of rounds 0 .. ``start - 1`` for the clock's running totals (a pure
    function of the seed; the values are the ones the whole run had)."""

    def __init__(
        self, plan: RoundPlan, start: int, stop: int, round_offset: int, steps: AsyncSchedule | None
    ) -> None:
        self.plan, self.round_offset, self.steps = plan, round_offset, steps
        self.drawn = 0  # rounds drawn so far (replayed ones included)
        timed = steps is None and plan.clock is not None and plan.trainer is not None
        self.timeline: Timeline | None = Timeline() if timed else None
        least = plan.clock.least_seconds() if timed and plan.clock is not None else 0.0
        if not math.isfinite(least * stop):  # certain to pass the largest float: one line before any round
            raise_not_finite(min(stop - 1, int(sys.float_info.max // least)))
        for r in range(start if timed else 0):  # the clock's totals before ``start``
            self._tick(r, self._draw(r))
        ahead: Iterable[int] = () if steps is not None else _drawn_up_front(plan, start, stop, round_offset)
        self._ahead = {r: self._draw(r) for r in ahead}

    def _draw(self, rnd: int) -> tuple[tuple[int, ...], RoundSystem | None]:
        self.drawn += 1
        return _draw_round(self.plan, rnd, self.round_offset, self.steps)

    def _tick(self, rnd: int, drawn: tuple[tuple[int, ...], RoundSystem | None]) -> None:
        if self.timeline is not None:
            assert self.plan.clock is not None
            who, system = drawn
            self.timeline.add_round(
                rnd, round_seconds(self.plan, rnd, who, system, self.plan.clock), len(who)
            )

    def take(self, rnd: int) -> tuple[tuple[int, ...], RoundSystem | None]:
        """Round ``rnd``'s (participants that train, ``system`` draw or None)."""
        drawn = self._ahead.pop(rnd) if rnd in self._ahead else self._draw(rnd)
        self._tick(rnd, drawn)
        return drawn


def _drawn_up_front(plan: RoundPlan, start: int, stop: int, round_offset: int) -> list[int]:
    """The rounds whose ``system`` draw is made before any work, so that a round in which every
    participant drops out is refused before the first round: the first one (stragglers all dropped)
    and those the dropout trace names (a trace that empties a round). The others are drawn as they
    come: drawing 10,000 rounds of 100 participants up front took 30 s, deaf to SIGTERM."""
    if plan.system is None or start >= stop:
        return []
    named = {r - round_offset - 1 for r, _ in plan.system.trace}
    return sorted({start} | {r for r in named if start <= r < stop})


def _draw_round(
    plan: RoundPlan, rnd: int, round_offset: int, steps: AsyncSchedule | None = None
) -> tuple[tuple[int, ...], RoundSystem | None]:
    """Round ``rnd``'s participants that train (draw order) and its ``system`` draw (None when off):
    a pure function of (seed, stage, round). A round whose every drawn participant drops out is one
    :class:`ConfigError` naming it. With an asynchronous schedule ``steps``, the participants are
    the clients dispatched from step ``rnd``'s model (a step may train none)."""
    if steps is not None:
        drawn = steps[rnd].dispatched
    else:
        generator = round_generator(plan.seed, plan.stage_index, rnd)
        drawn = tuple(plan.algorithm.participants(rnd, plan.population, generator))
    if plan.system is None:
        return drawn, None
    system = plan.system.draw(plan.stage_index, rnd, round_offset + rnd + 1, drawn)
    who = tuple(k for k in drawn if k not in system.dropped)
    if drawn and not who and steps is None:
        raise ConfigError(
            f"round {round_offset + rnd + 1}: every participant ({len(drawn)}) drops out under the system "
            "section (dropout probability, trace or dropped stragglers); lower the dropout or fix the trace"
        )
    return who, system


def _placed(
    plan: RoundPlan, who: tuple[int, ...], system: RoundSystem | None, rank: int, size: int
) -> list[int]:
    """The participants ``rank`` trains this round (sorted ids): every DRAWN participant is placed
    (balanced by sample count), then the dropped ones are taken out. Placing only those that arrived
    would move a client to another rank whenever someone else drops out, and a client whose state is
    held in memory (full participation) would then train on a rank that does not hold its state."""
    dropped = system.dropped if system is not None else ()
    drawn = who + dropped
    placed = place_round(drawn, [plan.population.sizes[k] for k in drawn], size)[rank]
    return [k for k in placed if k not in dropped] if dropped else placed


def _client_context(
    plan: RoundPlan, rnd: int, who: tuple[int, ...], system: RoundSystem | None, k: int
) -> ClientContext:
    trainer = plan.trainer
    if system is not None and trainer is not None:  # the participant's own work (``system.work``)
        trainer = trainer.with_schedule(system.schedule(trainer.schedule, k))
    return ClientContext(rnd, who, plan.population, trainer, plan.generator(rnd, k))


def _aggregate(
    layout: BufferLayout,
    buf: torch.Tensor,
    ex: Exchange,
    ordered: frozenset[str],
    participants: int,
    gathered: list[tuple[int, dict[str, Any]]],
) -> tuple[dict[str, torch.Tensor], Aggregate]:
    """The round's sums as the buffer holds them after the allreduce (an :func:`ordered_sums` sum
    added in draw order), and the :class:`Aggregate` the server update gets (each sum in its
    declared dtype, the gathered objects in draw order)."""
    sums = {
        s.name: _in_draw_order(layout, buf, s, participants)
        if s.name in ordered
        else layout.view(buf, f"sum:{s.name}")
        for s in ex.sums
    }
    aggregate = Aggregate(
        sums={s.name: sums[s.name].to(s.dtype) for s in ex.sums},
        weight=float(layout.view(buf, "weight")),
        count=int(layout.view(buf, "count")),
        gathered={g: [obj[g] for _, obj in gathered] for g in ex.gathers},
    )
    return sums, aggregate


def _accumulate(
    upload: Upload,
    layout: BufferLayout,
    buf: torch.Tensor,
    ex: Exchange,
    bdtype: torch.dtype,
    slot: int,
    ordered: frozenset[str],
) -> None:
    """Add one participant's upload into the round buffer: its declared sums (weighted where
    declared), its weight, and one to the participant count; an :func:`ordered_sums` sum and the
    weight are written into the participant's ``slot`` instead (its draw position)."""
    for spec in ex.sums:
        vec = upload.sums[spec.name]
        if vec.dtype != bdtype:
            vec = vec.to(bdtype)
        if spec.name in ordered:
            layout.view(buf, f"sum:{spec.name}")[slot * spec.length : (slot + 1) * spec.length] = vec
        elif spec.weighted:
            layout.view(buf, f"sum:{spec.name}").add_(vec, alpha=upload.weight)
        else:
            layout.view(buf, f"sum:{spec.name}").add_(vec)
    layout.view(buf, "weight").add_(upload.weight)
    layout.view(buf, "count").add_(1.0)
    if ordered:
        layout.view(buf, "weights")[slot] = upload.weight


def _in_draw_order(layout: BufferLayout, buf: torch.Tensor, spec: SumSpec, participants: int) -> torch.Tensor:
    """An :func:`ordered_sums` sum after the allreduce: the participants' slots added in draw order,
    each weighted as :func:`_accumulate` weights an accumulated sum (the same operations in the same
    order as one rank's running sum, so its bits do not depend on the placement)."""
    slots = layout.view(buf, f"sum:{spec.name}").view(participants, spec.length)
    weights = layout.view(buf, "weights").tolist()
    total = torch.zeros(spec.length, dtype=buf.dtype, device=buf.device)
    for i in range(participants):
        if spec.weighted:
            total.add_(slots[i], alpha=weights[i])
        else:
            total.add_(slots[i])
    return total


def _flag_nonfinite(flags: torch.Tensor, begun: RoundStart, diverged: list[int], states: ClientStore) -> None:
    """Flag this rank's participants whose local update became NaN/inf: 1, or 2 when the state it
    started from already held NaN/inf (a damaged state, not the learning rate)."""
    for k in diverged:
        flags[begun.position[k]] = 1.0 if _finite(states.get(k)) else 2.0


def _check_finite(flags: torch.Tensor, who: tuple[int, ...], rnd: int, lr_hint: str) -> None:
    """Every rank raises alike when a participant's local update became NaN/inf (flags allreduced)."""
    damaged = [who[i] for i in torch.nonzero(flags > 1.5).flatten().tolist()]
    if damaged:
        raise DivergenceError(
            f"loss became NaN/inf in round {rnd} on client {damaged[0]}, whose stored "
            f"state already held NaN/inf when it was read (clients {','.join(map(str, damaged))}): the "
            f"state is damaged, not the learning rate; resume with --reset-client-states "
            f"{','.join(map(str, damaged))} to re-initialise it"
        )
    bad = [who[i] for i in torch.nonzero(flags).flatten().tolist()]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise DivergenceError(
            f"loss became NaN/inf in round {rnd} on client {bad[0]}{more}; lower the learning rate{lr_hint}"
        )


def _named(settings: tuple[tuple[str, float], ...]) -> str:
    """``params.server_lr (1e+30), privacy.clip (1)``: settings with their values, for a message."""
    return ", ".join(f"{name} ({value:g})" for name, value in settings)


def _lr_hint(plan: RoundPlan) -> str:
    """How a local update's divergence names its causes after "lower the learning rate": the plan's
    :attr:`~RoundPlan.learning_rate` and :attr:`~RoundPlan.divergence_settings`."""
    lr = f" ({plan.learning_rate[0]} is {plan.learning_rate[1]:g})" if plan.learning_rate else ""
    return lr + (f", or {_named(plan.divergence_settings)}" if plan.divergence_settings else "")


def _check_server_finite(server: ServerState, plan: RoundPlan, rnd: int) -> None:
    """Every rank raises alike when the server step of round ``rnd`` (1-based) made the model NaN/inf
    from finite uploads (one sync a round)."""
    if not bool(torch.isfinite(server.x).all()):
        raise DivergenceError(
            f"the server step of round {rnd} ({plan.algorithm.name}) made the model NaN/inf "
            f"from finite uploads; "
            + (
                f"lower {_named(plan.divergence_settings)}"
                if plan.divergence_settings
                else "check the algorithm's server step"
            )
        )
