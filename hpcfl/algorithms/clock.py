"""The virtual clock: how long a participant's update takes in simulated seconds (issue 54).

Each client has a **speed** (samples its local training processes per simulated second) and a
network **delay** (simulated seconds of download plus upload per update). The ``system.clock``
section draws both from distributions, once per client (``per_update: false``, the default) or once
per update (``per_update: true``), or reads them from a ``trace`` file (CSV with the header
``client,speed,delay``; the clients it names take its values, the others the distributions').
Every draw comes from a generator that is a pure function of (seed, client) or (seed, stage, round,
client), so a run's clock is the same on any number of ranks and after a resume.

An update of ``samples`` samples then lasts ``samples / speed + delay`` simulated seconds, where
``samples`` is the participant's local steps times min(B, n_k) (the mini-batches it processes).
A synchronous round lasts as long as its slowest arrival (the ``sim_time`` metrics column adds them
up); an asynchronous run (:mod:`hpcfl.runner.asynchronous`) orders its updates by these times.

Distributions (``kind``): ``constant`` (``value``), ``uniform`` [``low``, ``high``], ``lognormal``
exp(N(``mu``, ``sigma``²)) (e.g. the FedBuff paper's heterogeneous client durations), clipped to
[:data:`LOGNORMAL_LOW`, :data:`LOGNORMAL_HIGH`] as ``system.work``'s lognormal is clipped to its bounds
(the logarithm is clipped before ``exp``, so no mu or sigma overflows or draws a zero speed). A speed
must be positive, a delay non-negative: a distribution that can draw otherwise is refused in one
line, and so is an update whose duration is not a finite number (a tiny constant speed, a huge
delay): the ``sim_time`` column must stay a number.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpcfl.errors import ConfigError
from hpcfl.training.seeds import seeded_rng

DISTRIBUTIONS = ("constant", "uniform", "lognormal")
#: the bounds a lognormal speed (samples per simulated second) or delay (seconds) is clipped to:
#: finite and positive, so every duration ``samples / speed + delay`` is finite (issue 61)
LOGNORMAL_LOW, LOGNORMAL_HIGH = 1e-9, 1e9
_LOG_LOW, _LOG_HIGH = math.log(LOGNORMAL_LOW), math.log(LOGNORMAL_HIGH)

# seed-sequence salts that keep the clock's draws apart from every other draw of the run
_SPEED_SALT = 0x73706564  # "sped"
_DELAY_SALT = 0x646C6179  # "dlay"


@dataclass
class Distribution:
    """One of :data:`DISTRIBUTIONS` (``none``: not set; a delay not set is the constant ``value``)."""

    kind: str = "none"
    value: float = 0.0  # constant
    low: float = 0.0  # uniform
    high: float = 0.0
    mu: float = 0.0  # lognormal: mean and standard deviation of the logarithm
    sigma: float = 1.0

    def draw(self, rng: np.random.Generator) -> float:
        if self.kind in ("constant", "none"):
            return float(self.value)
        if self.kind == "uniform":
            return float(rng.uniform(self.low, self.high))
        z = float(rng.normal(self.mu, self.sigma))  # may be ±inf for a sigma near the float limit
        z = min(_LOG_HIGH + 1.0, max(_LOG_LOW - 1.0, z))  # clipped before exp: never 0 nor an overflow
        return min(LOGNORMAL_HIGH, max(LOGNORMAL_LOW, math.exp(z)))


@dataclass
class ClockSection:
    """``system.clock``: each client's speed and network delay (module docstring); off while
    ``speed`` is unset."""

    speed: Distribution = field(default_factory=Distribution)  # samples per simulated second
    delay: Distribution = field(default_factory=Distribution)  # seconds (default: none, constant 0)
    per_update: bool = False  # draw anew for every update instead of once per client
    trace: str | None = None  # CSV ``client,speed,delay``

    @property
    def enabled(self) -> bool:
        return self.speed.kind != "none"


def _check_distribution(d: Distribution, key: str, *, positive: bool) -> None:
    """One :class:`ConfigError` line when ``d`` is unknown or can draw a value out of range."""
    if d.kind not in DISTRIBUTIONS:
        raise ConfigError(
            f"config key '{key}.kind' must be one of {', '.join(DISTRIBUTIONS)}, got {d.kind!r}"
        )
    what = "positive" if positive else "non-negative"
    bad = (lambda v: not v > 0) if positive else (lambda v: not v >= 0)
    if d.kind == "constant" and (bad(d.value) or not math.isfinite(d.value)):
        raise ConfigError(f"config key '{key}.value' must be {what} and finite, got {d.value}")
    if d.kind == "uniform":
        if bad(d.low) or not math.isfinite(d.high):
            raise ConfigError(
                f"config key '{key}.low' must be {what} (the distribution draws from [low, high]), got {d.low}"
            )
        if d.low > d.high:
            raise ConfigError(f"config keys '{key}.low' and '{key}.high' are reversed: {d.low} > {d.high}")
    if d.kind == "lognormal" and not (d.sigma >= 0 and math.isfinite(d.sigma) and math.isfinite(d.mu)):
        raise ConfigError(f"config key '{key}.sigma' must be >= 0 and finite, got {d.sigma}")


def validate_clock(section: ClockSection, num_clients: int) -> None:
    """Every check of ``system.clock`` that needs no data (one :class:`ConfigError` line)."""
    if not section.enabled:
        if section.trace is not None or section.delay.kind != "none" or section.delay.value != 0:
            raise ConfigError(
                "system.clock sets a delay or a trace but no speed: set system.clock.speed "
                "(e.g. {kind: constant, value: 100}: samples per simulated second)"
            )
        return
    _check_distribution(section.speed, "system.clock.speed", positive=True)
    delay = section.delay
    if delay.kind == "none":
        delay = Distribution("constant", delay.value)
    _check_distribution(delay, "system.clock.delay", positive=False)
    if section.trace is not None:
        read_clock_trace(section.trace, num_clients)


def read_clock_trace(path: str | Path, num_clients: int) -> dict[int, tuple[float, float]]:
    """Client → (speed, delay) of a clock trace (CSV, header ``client,speed,delay``); a missing
    file, a bad line, an unknown client, a non-positive speed or a negative delay is one
    :class:`ConfigError`."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise ConfigError(
            f"system.clock.trace {str(p)!r} cannot be read ({err.strerror}); fix the path"
        ) from None
    rows = list(csv.reader(line for line in text.splitlines() if line.strip()))
    if not rows or [c.strip() for c in rows[0]] != ["client", "speed", "delay"]:
        raise ConfigError(
            f"system.clock.trace {str(p)!r} must start with the header line 'client,speed,delay'"
        )
    out: dict[int, tuple[float, float]] = {}
    for lineno, row in enumerate(rows[1:], start=2):
        try:
            k, speed, delay = int(row[0]), float(row[1]), float(row[2])
            if len(row) != 3:
                raise ValueError
        except (ValueError, IndexError):
            raise ConfigError(
                f"system.clock.trace {str(p)!r} line {lineno}: expected 'client,speed,delay', got {','.join(row)!r}"
            ) from None
        if not 0 <= k < num_clients:
            raise ConfigError(
                f"system.clock.trace {str(p)!r} line {lineno} names client {k}, but the run has clients "
                f"0..{num_clients - 1}"
            )
        if not (speed > 0 and math.isfinite(speed)) or not (delay >= 0 and math.isfinite(delay)):
            raise ConfigError(
                f"system.clock.trace {str(p)!r} line {lineno}: speed must be positive and delay "
                f"non-negative, got speed {speed}, delay {delay}"
            )
        out[k] = (speed, delay)
    return out


#: the clock of a run without ``system.clock``: one sample per simulated second, no delay (an
#: asynchronous run still orders its updates by how many samples each processes)
UNIT_CLOCK = ClockSection(speed=Distribution(kind="constant", value=1.0))


@dataclass(frozen=True)
class VirtualClock:
    """A run's ``system.clock`` made concrete: the simulated seconds of each update."""

    section: ClockSection
    seed: int
    trace: tuple[tuple[int, tuple[float, float]], ...] = ()

    @staticmethod
    def of(section: ClockSection, seed: int, num_clients: int) -> VirtualClock | None:
        """The clock of an enabled section (None when off); reads the trace."""
        if not section.enabled:
            return None
        trace = read_clock_trace(section.trace, num_clients) if section.trace is not None else {}
        return VirtualClock(section, seed, tuple(sorted(trace.items())))

    def speed_delay(self, stage: int, rnd: int, k: int) -> tuple[float, float]:
        """Client ``k``'s (samples per second, delay in seconds) for its update of round ``rnd``."""
        traced = dict(self.trace).get(k)
        if traced is not None:
            return traced
        key = (stage, rnd, k) if self.section.per_update else (k,)
        speed = self.section.speed.draw(seeded_rng(self.seed, _SPEED_SALT, *key))
        delay = self.section.delay.draw(seeded_rng(self.seed, _DELAY_SALT, *key))
        return speed, delay

    def seconds(self, stage: int, rnd: int, k: int, samples: int) -> float:
        """How long client ``k``'s update of round ``rnd`` lasts: ``samples / speed + delay``; a
        duration that is not a finite number is one :class:`ConfigError` line."""
        speed, delay = self.speed_delay(stage, rnd, k)
        seconds = samples / speed + delay
        if not math.isfinite(seconds):
            raise ConfigError(
                f"system.clock: client {k}'s update of round {rnd + 1} ({samples} samples at speed {speed:g}, "
                f"delay {delay:g}) lasts {seconds} simulated seconds, not a finite number; raise the speed "
                "or lower the delay"
            )
        return seconds


def update_samples(steps: int, batch_size: int, n: int) -> int:
    """The samples an update of ``steps`` local steps processes (mini-batches of min(B, n))."""
    return steps * min(batch_size, n)
