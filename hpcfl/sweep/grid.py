"""A sweep's grid: axes from ``--grid key=v1,v2`` or a grid file, expanded to named points.

An axis is a config key (dotted for sections: ``params.mu``, ``stage2.lr``) with its values. A key
whose first part is an algorithm's name (``fedprox.mu``, ``tct.stage2.lr``) is that algorithm's
hyper-parameter: it varies only the points that run that algorithm (and sets ``params.<rest>``
there), so ``algorithm=fedavg,fedprox`` × ``fedprox.mu=0.01,0.1`` is three points, not four.
Seeds are the last axis (``seed``), so reports average over them.

Point names are built from the values alone (``algorithm=fedavg,partition=dir-0.1,seed=0``), so
the same grid always names the same run directories and a re-run finds its finished points.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hpcfl.errors import ConfigError
from hpcfl.files import read_yaml

SEED = "seed"
_NAME_MAX = 150  # a point name is a directory and a config name; longer ones end in a hash


@dataclass(frozen=True)
class Axis:
    """One dimension of the grid: a config key and the values it takes, in the order given."""

    key: str
    values: tuple[Any, ...]

    @property
    def algorithm(self) -> str | None:
        """The algorithm this axis belongs to (``fedprox`` for ``fedprox.mu``), or None."""
        from hpcfl.algorithms import ALGORITHMS

        head, dot, _ = self.key.partition(".")
        return head if dot and head in ALGORITHMS else None

    def config_key(self) -> str:
        """The key the value is written to (``params.mu`` for ``fedprox.mu``)."""
        if self.algorithm is None:
            return self.key
        return "params." + self.key.partition(".")[2]


@dataclass(frozen=True)
class Point:
    """One grid point: its name and the axis values that apply to it (``{axis key: value}``)."""

    name: str
    values: dict[str, Any]

    def overrides(self, axes: list[Axis]) -> dict[str, Any]:
        """``{dotted config key: value}`` for this point (algorithm-scoped axes mapped to params)."""
        by_key = {a.key: a for a in axes}
        return {by_key[k].config_key() if k in by_key else k: v for k, v in self.values.items()}


def _scalar(text: str) -> Any:
    """A value as ``--set`` reads it (YAML scalar: ``0.1`` a number, ``dir:0.1`` a string), with
    ``1e-3`` a number too (YAML 1.1 reads it as a string, and a name would then say ``1e-3``)."""
    if re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", text):
        return float(text)
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def parse_grid_arg(text: str) -> Axis:
    """``key=v1,v2,...`` (``--grid``); a value holding a comma needs a grid file."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or not raw.strip():
        raise ConfigError(
            f"--grid expects KEY=V1,V2,... (e.g. --grid partition=dir:0.1,dir:0.5), got {text!r}"
        )
    values = [_scalar(v.strip()) for v in raw.split(",")]
    return _axis(key, values, f"--grid {key}")


def _axis(key: str, values: list[Any], where: str) -> Axis:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", key):
        raise ConfigError(f"{where}: {key!r} is no config key (letters, digits, _ and dots)")
    if key == "name":
        raise ConfigError(f"{where}: 'name' is set by the sweep (each point is named after its values)")
    if not values:
        raise ConfigError(f"{where}: no values")
    seen: list[str] = []
    for v in values:
        text = json.dumps(v, sort_keys=True)
        if text in seen:
            raise ConfigError(f"{where}: the value {v!r} is given twice")
        seen.append(text)
    return Axis(key, tuple(values))


def read_grid_file(path: str | Path) -> tuple[list[Axis], int | None]:
    """Axes and seed count of a grid file::

    grid:
      algorithm: [fedavg, scaffold, tct]
      partition: [dir:0.1, dir:0.5]
      fedprox.mu: [0.01, 0.1]
    seeds: 3
    """
    data = read_yaml(path)
    unknown = sorted(set(data) - {"grid", "seeds"})
    if unknown:
        raise ConfigError(f"grid file {str(path)!r}: unknown key {unknown[0]!r}; it holds 'grid' and 'seeds'")
    grid = data.get("grid") or {}
    if not isinstance(grid, dict):
        raise ConfigError(f"grid file {str(path)!r}: 'grid' must map config keys to lists of values")
    axes = []
    for key, values in grid.items():
        if not isinstance(values, list):
            values = [values]
        axes.append(_axis(str(key), values, f"grid file {str(path)!r}, key {key}"))
    seeds = data.get("seeds")
    if seeds is not None and (isinstance(seeds, bool) or not isinstance(seeds, int)):
        raise ConfigError(f"grid file {str(path)!r}: 'seeds' must be a whole number, got {seeds!r}")
    return axes, seeds


def combine_axes(axes: list[Axis], seeds: int | None, base_seed: int) -> list[Axis]:
    """The grid's axes with the seed axis last: ``seeds`` N gives ``base_seed .. base_seed+N-1``.

    Refuses a key given twice and ``--seeds`` beside a ``seed`` axis."""
    keys = [a.key for a in axes]
    for key in keys:
        if keys.count(key) > 1:
            raise ConfigError(f"grid key {key!r} is given twice; give all its values once (KEY=V1,V2)")
    if seeds is not None:
        if seeds < 1:
            raise ConfigError(f"--seeds must be at least 1, got {seeds}")
        if SEED in keys:
            raise ConfigError("give the seeds either as --seeds N or as --grid seed=..., not both")
        axes = [*axes, Axis(SEED, tuple(range(base_seed, base_seed + seeds)))]
    elif SEED in keys:  # keep seeds last, where reports average over them
        axes = [a for a in axes if a.key != SEED] + [a for a in axes if a.key == SEED]
    return axes


def _slug(value: Any) -> str:
    if isinstance(value, float) and float(f"{value:g}") == value:
        text = f"{value:g}"  # 1e-05 rather than 1e-05's repr, 1e+12 rather than 1000000000000.0
    else:
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", text) or "x"


def point_name(values: dict[str, Any]) -> str:
    """The directory name of a point: ``key=value`` pairs in axis order, joined by commas; values
    reduced to letters, digits and ``.+-`` (``dir:0.1`` → ``dir-0.1``)."""
    name = ",".join(f"{k}={_slug(v)}" for k, v in values.items()) or "base"
    if len(name) > _NAME_MAX:
        digest = hashlib.sha1(json.dumps(values, sort_keys=True).encode()).hexdigest()[:10]
        name = name[: _NAME_MAX - 11] + "-" + digest
    return name


def expand(axes: list[Axis], algorithm: str) -> list[Point]:
    """Every point of the Cartesian grid, in axis order (the last axis varies fastest).

    ``algorithm`` is the base config's algorithm, for points whose algorithm no axis sets. An axis
    scoped to an algorithm applies only to the points running it; the duplicates that leaves are
    dropped. Two points whose names coincide (``dir:0.1`` and ``dir-0.1``) are refused.
    """
    points: list[Point] = []
    names: dict[str, dict[str, Any]] = {}
    for combo in itertools.product(*(a.values for a in axes)):
        chosen = dict(zip((a.key for a in axes), combo, strict=True))
        algo = str(chosen.get("algorithm", algorithm))
        values = {a.key: chosen[a.key] for a in axes if a.algorithm is None or a.algorithm == algo}
        name = point_name(values)
        if name in names:
            if names[name] != values:
                raise ConfigError(
                    f"grid points {names[name]} and {values} get the same name {name!r}; "
                    "use values that differ in letters or digits"
                )
            continue
        names[name] = values
        points.append(Point(name, values))
    return points
