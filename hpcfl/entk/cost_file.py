"""A fitted layer-form constants file (``benchmarks/entk_layer_costs.py``'s JSON), read and checked:
the one reader both :mod:`hpcfl.entk.settings` (a run's ``entk.costs``, checked before any work) and
:mod:`hpcfl.entk.costs` (the constants in force) use."""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

from hpcfl.errors import ConfigError

COST_TERMS: tuple[str, ...] = ("launch", "mac", "mem", "pick", "term", "store")
"""The cost model's constants, in the order of :func:`hpcfl.entk.costs.form_features`' columns."""


@lru_cache(maxsize=4)
def fitted_file(path: str, where: str) -> tuple[str, dict[str, float]]:
    """(device type, fitted constants) of the file ``path``; ``where`` names it (the variable or the
    config key that gave it) in the one :class:`ConfigError` line a bad file gives."""
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
        device_type = "cuda" if str(report["device"]).startswith("cuda") else "cpu"
        fitted = {name: float(report["fitted"][name]) for name in COST_TERMS}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{where}: not a fitted-constants report of entk_layer_costs.py ({err})") from None
    bad = {name: v for name, v in fitted.items() if not (math.isfinite(v) and v >= 0)}
    if bad:
        name, value = next(iter(bad.items()))
        raise ConfigError(
            f"{where}: fitted constant {name!r} is {value}, but the constants are times (finite, "
            ">= 0); fit them again with benchmarks/entk_layer_costs.py or drop the setting"
        )
    return device_type, fitted
