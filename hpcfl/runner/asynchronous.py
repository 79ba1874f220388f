"""Simulated time: the asynchronous runs' schedule and every run's ``sim_time`` column (issue 54).

An asynchronous algorithm (:mod:`hpcfl.algorithms.asynchronous`) runs in the ordinary round loop,
one round per server step; this module decides, from the virtual clock alone
(:mod:`hpcfl.algorithms.clock`), never from wall time, what each step does:

1. at simulated second 0, ``concurrency`` clients are dispatched from model version 0 (under
   ``system.clock.starts: poisson``: trainings start at the times of a Poisson process instead, each
   taking a free slot, or waiting for one; steps 2 and 3 then refill no slot at once);
2. updates arrive in order of their simulated arrival (dispatch time + ``samples / speed + delay``;
   ties by dispatch order); each arrival frees its slot, which is given at once to a client drawn
   uniformly (from a generator that is a pure function of (seed, stage, version, dispatch index))
   among those not in flight and not yet dispatched from the current version, starting from the
   current model; a slot with no such client waits for the next version;
3. when ``buffer_size`` updates have arrived (a dropped participant's never does: its slot frees at
   the time it would have arrived), the server step applies them in arrival order, the version
   advances, and the waiting slots are filled.

So :class:`AsyncSchedule` (simulated step by step as the run reads it) is a pure function of the
seed, the population, the clock, the ``system`` draws and the algorithm's concurrency and buffer:
every rank computes the same schedule, and a resumed run recomputes it. Round v of the loop trains
the clients dispatched from version v
(placed on ranks and vectorised like any round's participants: each trains from x_v, which the
server holds during round v) and applies :attr:`Step.arrivals`, whose updates were trained in
rounds ≤ v and wait in the server state meanwhile.

:class:`ClockRecord` writes the simulated time into each metrics row: ``sim_time`` (simulated
seconds since the stage began: an asynchronous step's last arrival; a synchronous round lasts as
long as its slowest arrival), ``client_updates`` (updates applied so far) and, for an asynchronous
run, ``staleness`` and ``applied`` (the staleness and the client of every update applied since the
previous row, in order).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpcfl.algorithms.asynchronous import AsyncAlgorithm
from hpcfl.algorithms.base import Arrival
from hpcfl.algorithms.clock import UNIT_CLOCK, VirtualClock, update_samples
from hpcfl.algorithms.stage_types import Observer, RoundEnd, RoundPlan
from hpcfl.algorithms.system import RoundSystem
from hpcfl.errors import ConfigError
from hpcfl.training.seeds import seeded_rng

_DISPATCH_SALT = 0x64737063  # "dspc": the choice of the client a freed slot goes to


@dataclass(frozen=True)
class Step:
    """One asynchronous server step: the clients dispatched from its model (dispatch order, those
    that drop out included), the updates it applies (arrival order) and its simulated second."""

    dispatched: tuple[int, ...]
    arrivals: tuple[Arrival, ...]
    time: float


def _finite(seconds: float, rnd: int) -> float:
    """``seconds`` (the simulated time at the end of round ``rnd``, 0-based), or one
    :class:`ConfigError` line when the sum of finite durations overflowed to infinity."""
    if not math.isfinite(seconds):
        raise_not_finite(rnd)
    return seconds


def raise_not_finite(rnd: int) -> None:
    """The one line of a simulated time that passes the largest float at round ``rnd`` (0-based)."""
    raise ConfigError(
        f"system.clock: the simulated time passes the largest float at round {rnd + 1}; "
        "raise the speeds or lower the delays"
    )


def plan_clock(plan: RoundPlan) -> VirtualClock:
    """The plan's clock, or the unit clock (one sample per simulated second, no delay)."""
    return plan.clock if plan.clock is not None else VirtualClock(UNIT_CLOCK, plan.seed)


def _update(plan: RoundPlan, clock: VirtualClock, version: int, row_round: int, k: int) -> tuple[float, bool]:
    """(simulated seconds, dropped) of client ``k``'s update trained from ``version``."""
    assert plan.trainer is not None
    n = plan.population.sizes[k]
    dropped = False
    if plan.system is not None:
        drawn = plan.system.draw(plan.stage_index, version, row_round, (k,))
        steps, dropped = drawn.steps[k], k in drawn.dropped
    else:
        steps = plan.trainer.schedule.num_steps(n)
    samples = update_samples(steps, plan.trainer.schedule.batch_size, n)
    return clock.seconds(plan.stage_index, version, k, samples), dropped


class AsyncSchedule:
    """The server steps of the asynchronous algorithm of ``plan`` (module docstring), simulated as
    they are asked for: step ``t`` is computed when ``schedule[t]`` is first read, so a run of
    100,000 steps does no more work before its first step than one of 10 (issue 63). A step that can
    never fill its buffer (every update from then on drops out) is one :class:`ConfigError`.

    Steps are asked for in order (the round loop reads step ``t`` in round ``t``); the steps before
    the last one asked for are forgotten, so memory does not grow with the steps. :attr:`timeline`
    records every step's simulated second and applied updates for :class:`ClockRecord`."""

    def __init__(self, plan: RoundPlan, round_offset: int = 0) -> None:
        if not isinstance(plan.algorithm, AsyncAlgorithm):
            raise TypeError(
                f"{plan.algorithm.name} is not an AsyncAlgorithm: it has no virtual-clock schedule"
            )
        self.plan, self.algorithm, self.round_offset = plan, plan.algorithm, round_offset
        self.clock = plan_clock(plan)
        self.timeline = Timeline()
        self._heap: list[tuple[float, int, int, int, bool]] = []  # (arrival, seq, client, version, dropped)
        self._in_flight: set[int] = set()
        self._mine: list[int] = []  # dispatched from the current version, in dispatch order
        self._mine_set: set[int] = set()
        self._seq = 0
        self._steps: dict[int, Step] = {}
        self._next = 0  # the next step to simulate
        self._now = 0.0
        starts = self.clock.section.starts
        self._poisson = starts if starts.kind == "poisson" else None
        self._started = 0  # Poisson starts drawn so far
        self._start_at = self._next_start(0.0)  # the next Poisson start (inf: none)
        self._fill(0)

    def _dispatch(self, now: float, version: int) -> bool:
        """Give a freed slot to a client drawn among those not in flight and not yet dispatched from
        ``version`` (False when there is none)."""
        N = self.plan.population.size
        pool = [k for k in range(N) if k not in self._in_flight and k not in self._mine_set]
        if not pool:
            return False
        # host generator (deliberate): the choice depends on the seed, never on the rank
        rng = seeded_rng(self.plan.seed, _DISPATCH_SALT, self.plan.stage_index, version, len(self._mine))
        k = pool[int(rng.integers(len(pool)))]
        seconds, dropped = _update(self.plan, self.clock, version, self.round_offset + version + 1, k)
        heapq.heappush(self._heap, (_finite(now + seconds, version), self._seq, k, version, dropped))
        self._seq += 1
        self._in_flight.add(k)
        self._mine.append(k)
        self._mine_set.add(k)
        return True

    def _fill(self, version: int) -> None:
        """Refill every free slot at once (no ``starts`` process: the paper's simulation)."""
        if self._poisson is not None:
            return
        while len(self._in_flight) < self.algorithm.concurrency and self._dispatch(self._now, version):
            pass

    def _next_start(self, after: float) -> float:
        """The time of the next Poisson start, ``after`` plus the next gap (inf without starts)."""
        if self._poisson is None:
            return math.inf
        self._started += 1
        return after + self._poisson.gap(self.plan.seed, self.plan.stage_index, self._started)

    def _start(self, version: int, arrival: float) -> bool:
        """Under Poisson starts: dispatch the start due before the next ``arrival`` if a slot is free
        (a start that found every slot busy happens when one frees, at ``self._now``); False when no
        start is due, no slot is free, or no client is left to dispatch from ``version``."""
        if self._start_at > arrival or len(self._in_flight) >= self.algorithm.concurrency:
            return False
        when = max(self._start_at, self._now)
        if not self._dispatch(when, version):
            return False  # every client is in flight or dispatched from this version: wait
        self._now = when
        self._start_at = self._next_start(self._start_at)
        return True

    def _advance(self) -> None:
        """Simulate step ``self._next``: pop arrivals until the buffer is full, refilling each slot."""
        t, K = self._next, self.algorithm.buffer_size
        buffer: list[Arrival] = []
        while len(buffer) < K:
            if self._start(t, self._heap[0][0] if self._heap else math.inf):
                continue
            if not self._heap:
                raise ConfigError(
                    f"asynchronous step {self.round_offset + t + 1}: every update in flight dropped out and "
                    "no client is left to dispatch (system.dropout); lower the dropout or fix the trace"
                )
            self._now, _, k, version, dropped = heapq.heappop(self._heap)
            self._in_flight.discard(k)
            if not dropped:
                buffer.append(Arrival(k, version, self._now, t - version))
            if self._poisson is None:
                self._dispatch(self._now, t)  # the freed slot is refilled at once
        step = Step(tuple(self._mine), tuple(buffer), self._now)
        self._steps[t] = step
        self.timeline.add_step(t, step)
        self._mine, self._mine_set = [], set()
        self._next = t + 1
        self._fill(t + 1)

    def __getitem__(self, t: int) -> Step:
        while self._next <= t:
            self._advance()
        for old in [r for r in self._steps if r < t]:
            del self._steps[old]
        if t not in self._steps:
            raise IndexError(f"asynchronous step {t} was already forgotten (steps are read in order)")
        return self._steps[t]


def async_schedule(plan: RoundPlan, steps: int, round_offset: int = 0) -> tuple[Step, ...]:
    """The first ``steps`` server steps of :class:`AsyncSchedule` (tests and benchmarks)."""
    schedule = AsyncSchedule(plan, round_offset)
    return tuple(schedule[t] for t in range(steps))


@dataclass(frozen=True)
class Tick:
    """The clock at the end of one round: simulated seconds since the stage began, the updates
    applied so far and (asynchronous) the round's applied updates as (client, staleness)."""

    elapsed: float
    updates: int
    applied: tuple[tuple[int, int], ...] | None = None


class Timeline:
    """Each round's :class:`Tick`, recorded in round order as the round is drawn (synchronous) or
    simulated (asynchronous); :class:`ClockRecord` forgets the ones its rows have reported."""

    def __init__(self) -> None:
        self.ticks: dict[int, Tick] = {}
        self._total, self._updates, self._next = 0.0, 0, 0

    def add_round(self, rnd: int, seconds: float, arrived: int) -> None:
        """A synchronous round of ``seconds`` (its slowest arrival) with ``arrived`` updates."""
        assert rnd == self._next, (rnd, self._next)
        self._total = _finite(self._total + seconds, rnd)
        self._updates += arrived
        self.ticks[rnd] = Tick(self._total, self._updates)
        self._next += 1

    def add_step(self, rnd: int, step: Step) -> None:
        """An asynchronous server step."""
        assert rnd == self._next, (rnd, self._next)
        self._updates += len(step.arrivals)
        self.ticks[rnd] = Tick(
            step.time, self._updates, tuple((a.client, a.staleness) for a in step.arrivals)
        )
        self._next += 1

    def forget_before(self, rnd: int) -> None:
        """Drop the ticks of the rounds before ``rnd``."""
        while self.ticks and (first := next(iter(self.ticks))) < rnd:
            del self.ticks[first]


def round_seconds(
    plan: RoundPlan, rnd: int, who: Sequence[int], system: RoundSystem | None, clock: VirtualClock
) -> float:
    """A synchronous round's simulated seconds: its slowest arrival's update (0 with no arrival)."""
    assert plan.trainer is not None
    schedule = plan.trainer.schedule
    longest = 0.0
    for k in who:
        n = plan.population.sizes[k]
        steps = system.steps[k] if system is not None else schedule.num_steps(n)
        longest = max(
            longest, clock.seconds(plan.stage_index, rnd, k, update_samples(steps, schedule.batch_size, n))
        )
    return longest


class ClockRecord(Observer):
    """``sim_time``, ``round_sim_s``, ``client_updates`` and (asynchronous) ``staleness`` and
    ``applied`` of a row: from the :class:`Timeline` every rank records alike, so nothing is
    exchanged. ``since``: the first round whose updates no row reported yet."""

    group = "clock"
    columns = ("sim_time", "round_sim_s", "client_updates", "staleness", "applied")

    def __init__(self, timeline: Timeline, since: int) -> None:
        self.timeline, self.since = timeline, since
        timeline.forget_before(since - 1)

    def row(self, end: RoundEnd, slots: Mapping[str, Any]) -> dict[str, Any]:
        r, ticks = end.work.start.round, self.timeline.ticks
        tick = ticks[r]
        out: dict[str, Any] = {
            "sim_time": tick.elapsed,
            "round_sim_s": tick.elapsed - (ticks[r - 1].elapsed if r > 0 else 0.0),
            "client_updates": tick.updates,
        }
        if tick.applied is not None:
            updates = [u for q in range(self.since, r + 1) for u in ticks[q].applied or ()]
            out["staleness"] = [s for _, s in updates]
            out["applied"] = [k for k, _ in updates]
        self.since = r + 1
        self.timeline.forget_before(r)
        return out


def clock_record(plan: RoundPlan, start: int, timeline: Timeline | None) -> ClockRecord | None:
    """The :class:`ClockRecord` of the rounds from ``start`` (None without a ``timeline``: a
    synchronous run without a clock, or one that trains no model)."""
    if timeline is None:
        return None
    since = start - start % plan.eval_every  # the rounds after the last row before ``start``
    return ClockRecord(timeline, since)
