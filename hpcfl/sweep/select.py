"""Choosing a hyper-parameter per method and setting on a validation split, never on the test set.

``--search lr=0.01,0.03,0.1`` adds the values as an axis of the grid and holds out a seeded share
of every client's training samples (``validation``, FedPVR's 1% by default): the clients never
train on it, the test set is untouched, and every evaluated round logs ``val_accuracy`` beside
``test_accuracy``. For each group of points that differ only in the searched value and the seed,
the value with the best validation accuracy is chosen — each seed's mean ``val_accuracy`` over its
last k evaluated rounds (the protocol's k, :mod:`hpcfl.report.protocol`, ``hpcfl report --last``),
then the mean over seeds; ties: the first value given — and only its test accuracy is reported.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hpcfl.errors import ConfigError
from hpcfl.sweep.grid import Axis, parse_grid_arg

DEFAULT_VALIDATION = 0.01
METRIC = "val_accuracy"


def search_options(
    search: str | None, validation: float | None
) -> tuple[dict[str, Any] | None, Axis | None, dict[str, Any]]:
    """(manifest entry, the searched axis, overrides for every point) of ``--search``/``--validation``."""
    if search is None:
        if validation is not None:
            raise ConfigError("--validation holds out data for --search; give --search KEY=V1,V2 too")
        return None, None, {}
    axis = parse_grid_arg(search)
    if axis.key == "seed":
        raise ConfigError("--search chooses a hyper-parameter; seeds are averaged over, not chosen")
    fraction = DEFAULT_VALIDATION if validation is None else validation
    if not 0 < fraction < 1:
        raise ConfigError(f"--validation must be a fraction in (0, 1), got {fraction:g}")
    entry = {"key": axis.key, "metric": METRIC, "validation": fraction}
    return entry, axis, {"validation": fraction}


def check_searchable(algorithm: str, point: str) -> None:
    """Refuse a search over an algorithm that logs no validation accuracy in its last stage."""
    from hpcfl.registry import ALGORITHMS

    if algorithm in ALGORITHMS and not ALGORITHMS[algorithm].logs_validation:
        raise ConfigError(
            f"grid point {point}: --search needs validation accuracy in the last round, which "
            f"{algorithm} does not log (its last stage evaluates on the test set only); search "
            "another algorithm's hyper-parameters, or sweep this one without --search"
        )


def personal_search_notes(configs: Sequence[Any]) -> list[str]:
    """One note per personalised algorithm a ``--search`` chooses for without ``client_eval``: its
    choice then reads the server model's ``val_accuracy`` (the shared body with the initial head,
    FedAvg's w), because its clients' own models are scored only with ``client_eval``."""
    from hpcfl.registry import ALGORITHMS

    names = sorted(
        {c.algorithm for c in configs if c.algorithm in ALGORITHMS and ALGORITHMS[c.algorithm].personalised}
        & {c.algorithm for c in configs if not c.client_eval}
    )
    return [
        f"hpcfl: note: --search chooses {name}'s value by the server model's val_accuracy, not by its "
        "clients' own models, because they are scored only with client_eval; add --set client_eval=0.2 "
        "to choose by personal_val_acc_mean"
        for name in names
    ]


@dataclass(frozen=True)
class Choice:
    """The chosen value of one group: its mean validation accuracy and the candidates' means."""

    value: Any
    val_mean: float
    candidates: dict[str, float]  # repr(value) -> mean validation accuracy (NaN: failed / missing)


def choose(values: Sequence[Any], val_by_value: dict[int, list[float | None]]) -> Choice | None:
    """The value (index into ``values``) with the best mean validation accuracy over its seeds.

    ``val_by_value[i]`` holds the validation accuracies of value ``i``'s seeds (each seed's last-k
    mean; None for a seed that logged none); a value with none (every seed failed) cannot be
    chosen. Ties go to the value given first.
    """
    best: tuple[float, int] | None = None
    means: dict[str, float] = {}
    for i, value in enumerate(values):
        accs = [a for a in val_by_value.get(i, []) if a is not None]
        mean = statistics.fmean(accs) if accs else float("nan")
        means[repr(value)] = mean
        if accs and (best is None or mean > best[0]):
            best = (mean, i)
    if best is None:
        return None
    return Choice(values[best[1]], best[0], means)
