"""The deadline of a collective: how long one may wait for its peers before the job is ended.

A blocking MPI collective waits forever when a peer's host vanishes without its processes exiting
(a node lost, a link cut): nothing tells the survivors. So :class:`hpcfl.comm.mpi.MPIComm` starts
every collective as a nonblocking call and polls it with :func:`poll` against a deadline from
:class:`Deadline`. The deadline is the setting ``comm_timeout`` (or ``$HPCFL_COMM_TIMEOUT``, which
overrides it): a number of seconds, or ``auto`` = the larger of :data:`FLOOR_S` (start-up and
TCT's feature extraction between two collectives fit in it) and :data:`FACTOR` times the longest
interval between the starts of two consecutive collectives this rank has seen so far.

This module holds only the arithmetic and the polling loop; it never imports MPI.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

from hpcfl.errors import ConfigError

ENV = "HPCFL_COMM_TIMEOUT"
FLOOR_S = 300.0  # auto: never less than this
FACTOR = 10.0  # auto: this many times the longest interval between collectives seen so far
# Polling: spin (each test drives MPI's progress engine, and a large message needs many of those)
# for SPIN_S, then sleep between tests, doubling from SLEEP_MIN_S up to SLEEP_CAP_S so a collective
# whose peers arrive late still completes within about SLEEP_CAP_S of their arrival.
SPIN_S = 0.02
SLEEP_MIN_S = 5e-5
SLEEP_CAP_S = 1e-3


def parse_timeout(value: object, name: str = "config key 'comm_timeout'") -> float | None:
    """Seconds of a ``comm_timeout`` setting, or None for ``auto``; a ConfigError naming ``name``
    for anything but ``auto`` or a positive, finite number."""
    text = str(value).strip().lower()
    if text == "auto":
        return None
    try:
        seconds = float(text) if not isinstance(value, bool) else math.nan
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(
            f"{name} must be auto or a positive number of seconds (the deadline of a collective), "
            f"got {value!r}"
        )
    return seconds


def resolve_timeout(setting: object) -> tuple[float | None, str]:
    """The deadline in force (seconds, or None for ``auto``) and where it came from: ``$HPCFL_COMM_TIMEOUT``
    when set (it overrides the config), else the config's ``comm_timeout``."""
    env = os.environ.get(ENV, "").strip()
    if env:
        return parse_timeout(env, f"environment variable {ENV}"), f"environment {ENV}"
    return parse_timeout(setting), "config"


def describe(seconds: float | None) -> str:
    """The setting as the run record states it: ``auto`` with its rule, or the seconds."""
    if seconds is None:
        return f"auto (max({FLOOR_S:g} s, {FACTOR:g} x the longest interval between collectives))"
    return f"{seconds:g}"


class Deadline:
    """The time limit of each collective of one communicator (fixed, or ``auto`` from the intervals
    this communicator measured between the starts of consecutive collectives)."""

    def __init__(self, seconds: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self._clock = clock
        self._last_start: float | None = None
        self._longest = 0.0

    def limit(self) -> float:
        """Seconds the next collective may wait."""
        if self.seconds is not None:
            return self.seconds
        return max(FLOOR_S, FACTOR * self._longest)

    def start(self) -> tuple[float, float]:
        """Note that a collective starts now; return (its limit in seconds, the clock time it must end by)."""
        now = self._clock()
        if self._last_start is not None:
            self._longest = max(self._longest, now - self._last_start)
        self._last_start = now
        limit = self.limit()
        return limit, now + limit


def poll(
    done: Callable[[], bool],
    until: float,
    *,
    idle: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Call ``done()`` until it returns True (then True) or the clock passes ``until`` (then False).

    Spins for :data:`SPIN_S`, then sleeps between calls (at most :data:`SLEEP_CAP_S`), calling
    ``idle()`` (if given) before each sleep; ``idle`` may raise to end the wait.
    """
    start = clock()
    while True:
        if done():
            return True
        now = clock()
        if now >= until:
            return False
        if now - start >= SPIN_S:
            break
    pause = SLEEP_MIN_S
    while True:
        if idle is not None:
            idle()
        time.sleep(min(pause, max(0.0, until - clock())))
        if done():
            return True
        if clock() >= until:
            return False
        pause = min(2 * pause, SLEEP_CAP_S)
