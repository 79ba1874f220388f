"""The comparison protocol every report and benchmark table uses.

A single round's accuracy is a poor summary of a federated run: under label skew the global model
oscillates from round to round (FedAvg on Fashion-MNIST ``dir:0.1`` at momentum 0.9 logged 57.7,
35.5, 56.3, 35.6, 61.1 % in its last five rounds, issue 25), so a table of "final accuracy" of one
seed ranks methods by the phase of their oscillation. The headline numbers are therefore:

- **last-k mean**: the mean accuracy of the last ``k`` *evaluated* rounds of a run (rows of
  ``metrics.jsonl`` that carry the metric; default ``k = 5``), then the mean ± sample standard
  deviation of that over seeds;
- **rounds to target on a running mean**: the first logged round whose trailing mean over the last
  ``window`` evaluated rounds (fewer at the start of the run) reaches the target, so a single spike
  does not count as reaching it (``window = 1`` is the raw first crossing);
- the same last-k mean of ``val_accuracy`` is what a hyper-parameter search chooses on
  (:mod:`hpcfl.sweep.select`), never the test accuracy.

The single-round final and best accuracy stay in the reports as secondary columns.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hpcfl.errors import ConfigError

DEFAULT_LAST_K = 5
DEFAULT_WINDOW = 3
TEST = "test_accuracy"
VALIDATION = "val_accuracy"


@dataclass(frozen=True)
class Protocol:
    """How runs are summarised: the last ``last_k`` evaluated rounds are averaged; rounds to target
    are counted on a trailing mean of ``window`` evaluated rounds."""

    last_k: int = DEFAULT_LAST_K
    window: int = DEFAULT_WINDOW

    def __post_init__(self) -> None:
        if isinstance(self.last_k, bool) or not isinstance(self.last_k, int) or self.last_k < 1:
            raise ConfigError(f"--last must be a whole number of evaluated rounds >= 1, got {self.last_k!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ConfigError(
                f"--window must be a whole number of evaluated rounds >= 1, got {self.window!r}"
            )

    def label(self, runs: Iterable[Sequence[dict]] = (), key: str = TEST) -> str:
        """The K a last-K mean over ``runs`` (their metrics rows) really averages: ``last_k``, fewer
        where the runs have fewer evaluated rounds (``3`` for 3-round runs at ``--last 5``), a range
        ``2–5`` where they differ; ``last_k`` when no run is given."""
        used = {min(self.last_k, len(evaluated(rows, key))) for rows in runs} - {0}
        if not used:
            return str(self.last_k)
        lo, hi = min(used), max(used)
        return str(lo) if lo == hi else f"{lo}–{hi}"

    def describe(self, runs: Iterable[Sequence[dict]] = ()) -> str:
        """One sentence for a report's header, with the K the runs' last-K means really average."""
        k = self.label(runs)
        fewer = (
            f" (all of its evaluated rounds where it has fewer than --last {self.last_k})"
            if k != str(self.last_k)
            else ""
        )
        return (
            f"last-{k}: the mean test accuracy of a run's last {k} evaluated rounds{fewer}; "
            f"rounds to target: the first round whose running mean over the last {self.window} "
            "evaluated rounds reaches the target"
        )


def evaluated(rows: Sequence[dict], key: str = TEST) -> list[dict]:
    """The rows that carry ``key`` (rounds evaluated on that split)."""
    return [r for r in rows if key in r and r[key] is not None]


def last_k_mean(rows: Sequence[dict], k: int, key: str = TEST) -> float | None:
    """Mean of ``key`` over the last ``k`` rows that carry it (all of them if fewer); None if none."""
    values = [float(r[key]) for r in evaluated(rows, key)][-k:]
    return statistics.fmean(values) if values else None


def running_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean: entry i is the mean of ``values[max(0, i − window + 1) : i + 1]``."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(math.fsum(part) / len(part))
    return out


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n − 1; NaN for a single value, both NaN for none)."""
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


def fmt_mean_std(values: Sequence[float], scale: float = 100.0, digits: int = 2) -> str:
    """``"71.23 ± 1.05"`` (percent by default); ``"—"`` for no value, no ``±`` for one."""
    if not values:
        return "—"
    mean, std = mean_std(values)
    text = f"{scale * mean:.{digits}f}"
    return text + (f" ± {scale * std:.{digits}f}" if not math.isnan(std) else "")
