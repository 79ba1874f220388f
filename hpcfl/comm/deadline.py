"""The deadline of a collective, and how a rank that is gone is told from one that is slow.

A blocking MPI collective waits forever when a peer's host vanishes without its processes exiting
(a node lost, a link cut): nothing tells the survivors. So :class:`hpcfl.comm.mpi.MPIComm` starts
every collective as a nonblocking call and polls it with :func:`poll`. Waiting longer than
:attr:`CommDeadline.seconds` does not by itself end the job: the waiting rank then knocks on every
other rank's side channel (:mod:`hpcfl.comm.liveness`), whose serving thread answers whatever the
rank's main thread is doing. While every rank answers, the collective keeps waiting (a rank that
computes for ten minutes between two collectives is slow, not gone) and knocks again after another
:attr:`~CommDeadline.seconds`; a rank that does not answer twice within
:attr:`~CommDeadline.probe_s` is lost, and the job ends in one line. So a lost rank is noticed
within :attr:`CommDeadline.bound_s` of the moment its peers wait for it (35 s by default), at the
cost of one round of knocks per :attr:`~CommDeadline.seconds` of waiting.

The setting is ``comm_timeout`` (``auto`` = :data:`AUTO_S`, or seconds), which ``$HPCFL_COMM_TIMEOUT``
overrides; :meth:`CommDeadline.resolve` reads both once, and the communicator, the liveness check
and the run record (``determinism.json``) all read the one object it returns. This module holds
only the arithmetic and the polling loop; it never imports MPI.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hpcfl.errors import ConfigError

ENV = "HPCFL_COMM_TIMEOUT"
AUTO_S = 20.0  # auto: knock after this long in one collective (a lost rank is noticed within 35 s)
PROBE_MAX_S = 10.0  # a knock's answers are awaited min(PROBE_MAX_S, max(PROBE_MIN_S, seconds / 4))
# ... and never less than this: a busy or loaded host answers in milliseconds, but not always in 5
# (measured: a 0.02 s deadline's 5 ms wait took a computing rank on another emulated node for lost)
PROBE_MIN_S = 0.5
KNOCK_TRIES = 2  # a rank is lost only after this many unanswered knocks in a row
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


@dataclass(frozen=True)
class CommDeadline:
    """The failure policy of one run's collectives, resolved once (:meth:`resolve`).

    ``seconds``: how long a collective waits before it knocks on the other ranks (and again after
    each round of knocks that every rank answered); ``auto``: whether the setting was ``auto``;
    ``source``: who set it (``config``, ``environment HPCFL_COMM_TIMEOUT`` or ``argument``)."""

    seconds: float = AUTO_S
    auto: bool = True
    source: str = "config"

    @classmethod
    def resolve(cls, setting: object = "auto", environ: Mapping[str, str] | None = None) -> CommDeadline:
        """The deadline in force: ``$HPCFL_COMM_TIMEOUT`` when set (it overrides the config), else the
        config's ``comm_timeout`` (``setting``). A value that is not ``auto`` or a positive number
        is a ConfigError naming where it came from."""
        env = (os.environ if environ is None else environ).get(ENV, "").strip()
        if env:
            seconds = parse_timeout(env, f"environment variable {ENV}")
            return cls(AUTO_S if seconds is None else seconds, seconds is None, f"environment {ENV}")
        if isinstance(setting, CommDeadline):
            return setting
        seconds = parse_timeout(setting)
        return cls(AUTO_S if seconds is None else seconds, seconds is None, "config")

    @classmethod
    def given(cls, timeout: CommDeadline | float | None) -> CommDeadline:
        """``timeout`` as a deadline: itself, seconds given by a caller, or None for ``auto`` (no
        environment read: a program that builds its communicator itself chose)."""
        if isinstance(timeout, CommDeadline):
            return timeout
        if timeout is None:
            return cls()
        seconds = parse_timeout(timeout, "comm timeout")
        return cls(AUTO_S if seconds is None else seconds, seconds is None, "argument")

    @property
    def probe_s(self) -> float:
        """Seconds one round of knocks (and the count of who answers, when the job ends) waits."""
        return min(PROBE_MAX_S, max(PROBE_MIN_S, self.seconds / 4))

    @property
    def bound_s(self) -> float:
        """The longest a collective waits for a lost rank before the job speaks: ``seconds``, then
        :data:`KNOCK_TRIES` unanswered knocks, then the count of who still answers."""
        return self.seconds + (KNOCK_TRIES + 1) * self.probe_s

    def record(self) -> dict[str, Any]:
        """The run record's entries (``determinism.json``): the setting, who set it, and the bound."""
        return {
            "comm_timeout": "auto" if self.auto else self.seconds,
            "comm_timeout_from": self.source,
            "comm_knock_after_s": self.seconds,
            "comm_lost_noticed_within_s": self.bound_s,
        }


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
