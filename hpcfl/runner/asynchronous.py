"""Simulated time: the asynchronous runs' schedule and every run's ``sim_time`` column (issue 54).

An asynchronous algorithm (:mod:`hpcfl.algorithms.asynchronous`) runs in the ordinary round loop,
one round per server step; this module decides, from the virtual clock alone
(:mod:`hpcfl.algorithms.clock`), never from wall time, what each step does:

1. at simulated second 0, ``concurrency`` clients are dispatched from model version 0;
2. updates arrive in order of their simulated arrival (dispatch time + ``samples / speed + delay``;
   ties by dispatch order); each arrival frees its slot, which is given at once to a client drawn
   uniformly (from a generator that is a pure function of (seed, stage, version, dispatch index))
   among those not in flight and not yet dispatched from the current version, starting from the
   current model; a slot with no such client waits for the next version;
3. when ``buffer_size`` updates have arrived (a dropped participant's never does: its slot frees at
   the time it would have arrived), the server step applies them in arrival order, the version
   advances, and the waiting slots are filled.

So :func:`async_schedule` is a pure function of the seed, the population, the clock, the ``system``
draws and the algorithm's concurrency and buffer: every rank computes the same schedule, and a
resumed run recomputes it. Round v of the loop trains the clients dispatched from version v
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

import numpy as np

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
        raise ConfigError(
            f"system.clock: the simulated time passes the largest float at round {rnd + 1}; "
            "raise the speeds or lower the delays"
        )
    return seconds


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


def async_schedule(plan: RoundPlan, steps: int, round_offset: int = 0) -> tuple[Step, ...]:
    """The first ``steps`` server steps of the asynchronous algorithm of ``plan`` (module docstring);
    a step that can never fill its buffer (every update from then on drops out) is one
    :class:`ConfigError`."""
    algo = plan.algorithm
    clock = plan_clock(plan)
    N, C, K = plan.population.size, algo.concurrency, algo.buffer_size
    heap: list[tuple[float, int, int, int, bool]] = []  # (arrival, seq, client, version, dropped)
    in_flight: set[int] = set()
    dispatched: list[list[int]] = [[]]
    seq = 0

    def dispatch(now: float, version: int) -> bool:
        nonlocal seq
        mine = dispatched[version]
        pool = [k for k in range(N) if k not in in_flight and k not in mine]
        if not pool:
            return False
        # host generator (deliberate): the choice depends on the seed, never on the rank
        rng = seeded_rng(plan.seed, _DISPATCH_SALT, plan.stage_index, version, len(mine))
        k = pool[int(rng.integers(len(pool)))]
        seconds, dropped = _update(plan, clock, version, round_offset + version + 1, k)
        heapq.heappush(heap, (_finite(now + seconds, version), seq, k, version, dropped))
        seq += 1
        in_flight.add(k)
        mine.append(k)
        return True

    out: list[Step] = []
    now = 0.0
    while len(in_flight) < C and dispatch(now, 0):
        pass
    for t in range(steps):
        buffer: list[Arrival] = []
        while len(buffer) < K:
            if not heap:
                raise ConfigError(
                    f"asynchronous step {round_offset + t + 1}: every update in flight dropped out and no "
                    "client is left to dispatch (system.dropout); lower the dropout or fix the trace"
                )
            now, _, k, version, dropped = heapq.heappop(heap)
            in_flight.discard(k)
            if not dropped:
                buffer.append(Arrival(k, version, now, t - version))
            dispatch(now, t)
        out.append(Step(tuple(dispatched[t]), tuple(buffer), now))
        dispatched.append([])
        while len(in_flight) < C and dispatch(now, t + 1):
            pass
    return tuple(out)


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
    ``applied`` of a row:
    from the schedule every rank computed alike, so nothing is exchanged.

    ``elapsed[r]``/``updates[r]``: simulated seconds and applied updates at the end of round r;
    ``applied[r]``: round r's applied updates as (client, staleness) (None: synchronous);
    ``since``: the first round whose updates no row reported yet."""

    group = "clock"
    columns = ("sim_time", "round_sim_s", "client_updates", "staleness", "applied")

    def __init__(
        self,
        elapsed: Sequence[float],
        updates: Sequence[int],
        applied: Sequence[Sequence[tuple[int, int]]] | None,
        since: int,
    ) -> None:
        self.elapsed, self.updates, self.applied, self.since = elapsed, updates, applied, since

    def row(self, end: RoundEnd, slots: Mapping[str, Any]) -> dict[str, Any]:
        r = end.work.start.round
        out: dict[str, Any] = {
            "sim_time": self.elapsed[r],
            "round_sim_s": self.elapsed[r] - (self.elapsed[r - 1] if r > 0 else 0.0),
            "client_updates": self.updates[r],
        }
        if self.applied is not None:
            updates = [u for step in self.applied[self.since : r + 1] for u in step]
            out["staleness"] = [s for _, s in updates]
            out["applied"] = [k for k, _ in updates]
        self.since = r + 1
        return out


def clock_record(
    plan: RoundPlan,
    start: int,
    stop: int,
    draws: Sequence[tuple[Sequence[int], RoundSystem | None]],
    schedule: Sequence[Step] | None,
) -> ClockRecord | None:
    """The :class:`ClockRecord` of rounds ``start`` .. ``stop - 1`` (None when the run has no clock
    and is synchronous, or trains no model); ``draws``: every round's (arrived, system draw) from 0."""
    if schedule is not None:
        elapsed = [s.time for s in schedule]
        applied = [[(a.client, a.staleness) for a in s.arrivals] for s in schedule]
        counts = [len(s.arrivals) for s in schedule]
    elif plan.clock is not None and plan.trainer is not None:
        clock, total, elapsed, applied = plan.clock, 0.0, [], None
        for r, (who, system) in enumerate(draws):
            total = _finite(total + round_seconds(plan, r, who, system, clock), r)
            elapsed.append(total)
        counts = [len(who) for who, _ in draws]
    else:
        return None
    updates = list(np.cumsum(counts, dtype=np.int64).tolist())
    since = start - start % plan.eval_every  # the rounds after the last row before ``start``
    return ClockRecord(elapsed[:stop], updates[:stop], applied, since)
