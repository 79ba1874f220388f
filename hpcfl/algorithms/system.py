"""System heterogeneity: unequal local work, stragglers and dropped participants (issue 42).

Clients do not all do the same work. The ``system:`` config section declares how, and
:class:`SystemModel` draws each round's outcome from generators that are a pure function of
(seed, stage, round, client) (the straggler choice: of (seed, stage, round) and the round's
participants), so it is the same on any number of ranks and after a resume:

- ``work``: how much local work participant k does in a round, in local ``epochs`` or ``steps``
  (``unit: auto`` follows the run's schedule: steps when ``local_steps`` is set):

  - ``none`` (default): the configured work (with ``local_epochs`` clients of unequal sizes
    already take unequal numbers of steps);
  - ``fixed``: ``per_client``, one value per client;
  - ``uniform``: drawn uniformly from the integers [``low``, ``high``] every round (FedNova,
    Wang et al. 2020, §6: local epochs uniform in [2, 5]);
  - ``lognormal``: round(exp(N(``mu``, ``sigma``²))) clipped to [``low``, ``high``];
  - ``stragglers``: FedProx's model (Li et al., MLSys 2020, §5.2): ``fraction`` of each round's
    participants are stragglers and do a uniformly drawn smaller part of the configured work E,
    an integer in [1, E − 1]. The paper's text says "between 1 and E"; its code
    (``flearn/trainers/fedprox.py``: ``np.random.randint(low=1, high=self.num_epochs)``, high
    exclusive) draws [1, E − 1], which is consistent with a straggler doing less work, so that is
    followed here. ``drop: true`` drops the stragglers instead (the paper's FedAvg baseline).

- ``dropout``: a participant fails mid-round: with ``probability`` (drawn per participant and
  round), or where the ``trace`` file says so (a CSV with a ``round,client`` header and one line
  per failure; rounds are 1-based, as in ``metrics.jsonl``). Its upload never arrives and its
  client state stays as it was. A trace may name rounds beyond this invocation's ``rounds``, so a
  run done in legs (``--resume`` with more ``rounds``) reads one trace; the run directory keeps a
  copy of the trace it started with, and a resume whose trace differs from it is refused
  (:func:`hpcfl.runner.rundir.keep_trace`).

The runner removes the dropped participants from the round right after the draw, so everything
after it (placement, the sums, ``aggregate.weight`` and ``count``, ``ServerContext.participants``,
``bytes_up``) is over the participants that arrived: each algorithm's server step renormalises as
its paper does over the clients it heard from (FedAvg/FedProx p_k = n_k/Σ_arrived n_j, FedNova's
p_k and τ_eff likewise, SCAFFOLD's c ← c + Σ_arrived Δc_k/N). The dropped participants' downloads
still count in ``bytes_down``. Each participant trains with its own drawn schedule
(:meth:`hpcfl.algorithms.Trainer.with_schedule` in its context), so every algorithm that reads
``ctx.trainer.schedule`` and ``result.steps`` sees the work actually done.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from hpcfl.algorithms.clock import ClockSection, validate_clock
from hpcfl.errors import ConfigError
from hpcfl.training.seeds import seeded_rng
from hpcfl.training.sgd import LocalSchedule

WORK_KINDS = ("none", "fixed", "uniform", "lognormal", "stragglers")
UNITS = ("auto", "epochs", "steps")

# seed-sequence salts that keep the draws apart from the participants' and the clients' SGD
_WORK_SALT = 0x776F726B  # "work"
_DROP_SALT = 0x64726F70  # "drop"
_STRAGGLER_SALT = 0x73747267  # "strg"


@dataclass
class WorkSection:
    """``system.work``: how much local work each participant does (module docstring)."""

    kind: str = "none"  # none | fixed | uniform | lognormal | stragglers
    unit: str = "auto"  # auto | epochs | steps
    low: int = 1  # uniform, lognormal: the bounds (inclusive)
    high: int = 1
    mu: float = 0.0  # lognormal: mean and standard deviation of log(work)
    sigma: float = 1.0
    per_client: list[int] = field(default_factory=list)  # fixed: one value per client
    fraction: float = 0.0  # stragglers: share of each round's participants
    drop: bool = False  # stragglers: drop them (FedProx's FedAvg baseline) instead of keeping their work


@dataclass
class DropoutSection:
    """``system.dropout``: participants that fail mid-round (module docstring)."""

    probability: float = 0.0
    trace: str | None = None  # CSV ``round,client``: one line per failure (1-based rounds)


@dataclass
class SystemSection:
    """``system``: unequal local work and dropped participants; off by default."""

    work: WorkSection = field(default_factory=WorkSection)
    dropout: DropoutSection = field(default_factory=DropoutSection)
    clock: ClockSection = field(default_factory=ClockSection)  # simulated time (hpcfl.algorithms.clock)

    @property
    def enabled(self) -> bool:
        """Whether the participants' work or arrival differs from the configured one (the clock
        alone changes no result: it only times the updates)."""
        return self.work.kind != "none" or self.dropout.probability > 0 or self.dropout.trace is not None


def work_unit(section: SystemSection, local_steps: int | None) -> str:
    """``epochs`` or ``steps``: ``auto`` follows the run's schedule."""
    unit = section.work.unit
    if unit == "auto":
        return "steps" if local_steps is not None else "epochs"
    return unit


#: the largest work a draw may produce: numpy's integer draws (``uniform``) take an int64 bound
MAX_WORK = 2**62


def validate_system(
    section: SystemSection,
    *,
    num_clients: int,
    local_epochs: int,
    local_steps: int | None,
    private: bool,
    asynchronous: bool = False,
) -> None:
    """Every check of the ``system`` section that needs no data (one :class:`ConfigError` line).

    ``asynchronous``: the algorithm runs on the virtual clock (:mod:`hpcfl.runner.asynchronous`),
    which draws each update's work alone, so work that depends on a round's other participants
    (``stragglers``) is refused."""
    w, d = section.work, section.dropout
    if w.kind not in WORK_KINDS:
        raise ConfigError(
            f"config key 'system.work.kind' must be one of {', '.join(WORK_KINDS)}, got {w.kind!r}"
        )
    if w.unit not in UNITS:
        raise ConfigError(f"config key 'system.work.unit' must be auto, epochs or steps, got {w.unit!r}")
    if w.unit == "epochs" and local_steps is not None:
        raise ConfigError(
            "config key 'system.work.unit' is epochs but local_steps is set: use unit: steps (or auto), "
            "or unset local_steps"
        )
    if w.kind in ("uniform", "lognormal"):
        if w.low < 1:
            raise ConfigError(f"config key 'system.work.low' must be >= 1, got {w.low}")
        if w.low > w.high:
            raise ConfigError(
                f"config keys 'system.work.low' and 'system.work.high' are reversed: low {w.low} > high {w.high}"
            )
        if w.high > MAX_WORK:
            raise ConfigError(
                f"config key 'system.work.high' must be <= 2^62 local {work_unit(section, local_steps)}, "
                f"got {w.high}"
            )
    if w.kind == "lognormal" and not w.sigma > 0:
        raise ConfigError(f"config key 'system.work.sigma' must be > 0, got {w.sigma}")
    if w.kind == "fixed":
        if not isinstance(w.per_client, list) or len(w.per_client) != num_clients:
            raise ConfigError(
                f"config key 'system.work.per_client' must list one work value per client ({num_clients}), "
                f"got {w.per_client!r}"
            )
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in w.per_client):
            raise ConfigError(
                f"config key 'system.work.per_client' must hold integers >= 1, got {w.per_client!r}"
            )
    if not 0 <= w.fraction <= 1:
        raise ConfigError(f"config key 'system.work.fraction' must be in [0, 1], got {w.fraction}")
    if w.kind == "stragglers" and work_unit(section, local_steps) == "epochs" and local_epochs < 2:
        raise ConfigError(
            f"system.work.kind: stragglers does a smaller part of the configured work, in [1, E - 1] local "
            f"epochs; local_epochs is {local_epochs}: set local_epochs >= 2 (or unit: steps)"
        )
    if w.kind == "stragglers" and local_steps is not None and local_steps < 2:
        raise ConfigError(
            f"system.work.kind: stragglers does [1, M - 1] local steps; local_steps is {local_steps}: "
            "set local_steps >= 2"
        )
    if not 0 <= d.probability <= 1:
        raise ConfigError(f"config key 'system.dropout.probability' must be in [0, 1], got {d.probability}")
    if d.probability == 1:
        raise ConfigError(
            "config key 'system.dropout.probability' is 1: every participant of every round would drop; "
            "use a probability < 1"
        )
    if d.trace is not None:
        read_trace(d.trace, num_clients)
    validate_clock(section.clock, num_clients, asynchronous=asynchronous)
    if asynchronous and w.kind == "stragglers":
        raise ConfigError(
            "system.work.kind: stragglers picks a share of a synchronous round's participants; an "
            "asynchronous algorithm has no rounds of participants: use uniform, lognormal or fixed work"
        )
    if private and section.enabled:
        raise ConfigError(
            "system (unequal work, dropout) and privacy cannot be combined: the privacy accountant "
            "assumes every participant's configured local steps; turn one of them off"
        )


def read_trace(path: str | Path, num_clients: int) -> frozenset[tuple[int, int]]:
    """The (round, client) failures of a dropout trace (CSV with a ``round,client`` header, 1-based
    rounds; a UTF-8 byte-order mark, as spreadsheet programs write, is skipped); a missing file, a bad
    line, an unknown client or a round below 1 is one :class:`ConfigError`. Rounds beyond the run's
    are kept: a resume with more ``rounds`` reaches them (a run done in legs)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")
    except OSError as err:
        raise ConfigError(
            f"system.dropout.trace {str(p)!r} cannot be read ({err.strerror}); fix the path"
        ) from None
    except UnicodeDecodeError:
        raise ConfigError(
            f"system.dropout.trace {str(p)!r} is not UTF-8 text: write it as a CSV with the header "
            "'round,client'"
        ) from None
    rows = list(csv.reader(line for line in text.splitlines() if line.strip()))
    if not rows or [c.strip() for c in rows[0]] != ["round", "client"]:
        raise ConfigError(f"system.dropout.trace {str(p)!r} must start with the header line 'round,client'")
    out = set()
    for lineno, row in enumerate(rows[1:], start=2):
        try:
            rnd, k = (int(c) for c in row)
        except ValueError:
            raise ConfigError(
                f"system.dropout.trace {str(p)!r} line {lineno}: expected two integers 'round,client', "
                f"got {','.join(row)!r}"
            ) from None
        if not 0 <= k < num_clients:
            raise ConfigError(
                f"system.dropout.trace {str(p)!r} line {lineno} names client {k}, but the run has clients "
                f"0..{num_clients - 1}"
            )
        if rnd < 1:
            raise ConfigError(
                f"system.dropout.trace {str(p)!r} line {lineno} names round {rnd}, but rounds start at 1 "
                "(as in metrics.jsonl)"
            )
        out.add((rnd, k))
    return frozenset(out)


@dataclass(frozen=True)
class RoundSystem:
    """One round's draw: the work (in ``unit``) of each participant that trains with other work
    than the configured one, the stragglers, and the participants that dropped out."""

    unit: str
    work: dict[int, int]
    steps: dict[int, int]  # the local steps every drawn participant takes (dropped ones: would have)
    stragglers: tuple[int, ...] = ()
    dropped: tuple[int, ...] = ()

    def schedule(self, base: LocalSchedule, k: int) -> LocalSchedule:
        """Participant ``k``'s local schedule: ``base`` with its drawn epochs or steps."""
        if k not in self.work:
            return base
        if self.unit == "epochs":
            return dataclasses.replace(base, epochs=self.work[k], steps=None)
        return dataclasses.replace(base, steps=self.work[k])


@dataclass(frozen=True)
class SystemModel:
    """A run's ``system`` section made concrete: draws each round's :class:`RoundSystem`."""

    section: SystemSection
    seed: int
    unit: str  # epochs | steps
    base: LocalSchedule
    sizes: tuple[int, ...]
    trace: frozenset[tuple[int, int]] = frozenset()

    @staticmethod
    def of(
        section: SystemSection, seed: int, base: LocalSchedule, sizes: tuple[int, ...]
    ) -> SystemModel | None:
        """The model of an enabled section (None when off); reads the dropout trace."""
        if not section.enabled:
            return None
        trace = read_trace(section.dropout.trace, len(sizes)) if section.dropout.trace else frozenset()
        return SystemModel(section, seed, work_unit(section, base.steps), base, sizes, trace)

    def full_work(self, k: int) -> int:
        """The configured work of client ``k`` in the model's unit."""
        if self.unit == "epochs":
            return self.base.epochs
        return self.base.num_steps(self.sizes[k])

    def _work(self, stage: int, rnd: int, k: int) -> int | None:
        w = self.section.work
        if w.kind == "fixed":
            return int(w.per_client[k])
        if w.kind == "uniform":
            return int(seeded_rng(self.seed, _WORK_SALT, stage, rnd, k).integers(w.low, w.high + 1))
        if w.kind == "lognormal":
            z = float(seeded_rng(self.seed, _WORK_SALT, stage, rnd, k).normal(w.mu, w.sigma))
            if z > math.log(w.high) + 1:  # exp(z) > high: clipped to it (exp(z) may overflow a float)
                return int(w.high)
            return int(min(w.high, max(w.low, round(math.exp(z)))))
        return None

    def draw(self, stage: int, rnd: int, row_round: int, who: tuple[int, ...]) -> RoundSystem:
        """Round ``rnd`` of stage ``stage`` (``row_round``: its 1-based number in the metrics rows,
        which a trace names) for the participants ``who`` in draw order."""
        w = self.section.work
        work = {k: v for k in who if (v := self._work(stage, rnd, k)) is not None}
        stragglers: tuple[int, ...] = ()
        dropped = set()
        if w.kind == "stragglers" and who:
            count = round(w.fraction * len(who))
            order = seeded_rng(self.seed, _STRAGGLER_SALT, stage, rnd).permutation(len(who))
            stragglers = tuple(sorted(who[i] for i in order[:count]))
            for k in stragglers:
                full = self.full_work(k)
                if w.drop:
                    dropped.add(k)
                elif full > 1:  # a client whose configured work is one step cannot do less
                    work[k] = int(seeded_rng(self.seed, _WORK_SALT, stage, rnd, k).integers(1, full))
        p = self.section.dropout.probability
        for k in who:
            if p > 0 and float(seeded_rng(self.seed, _DROP_SALT, stage, rnd, k).random()) < p:
                dropped.add(k)
            if (row_round, k) in self.trace:
                dropped.add(k)
        drawn = RoundSystem(self.unit, work, {}, stragglers, tuple(k for k in who if k in dropped))
        drawn.steps.update({k: drawn.schedule(self.base, k).num_steps(self.sizes[k]) for k in who})
        return drawn
