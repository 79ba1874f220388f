"""A sweep's plan: every point's validated config and run directory, and the ``sweep.json`` manifest.

Every point is validated before anything runs or is queued (a bad point is named in one line), and
so is each point's run directory: one holding a run of another config is refused, since a re-run
of the sweep continues the runs it finds. The manifest records the grid and its points so that
``hpcfl status`` and ``hpcfl report`` need nothing but the sweep directory. Running the same sweep
with more values (another seed, say) adds points to the manifest; the finished ones are kept.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcfl.errors import ConfigError, HpcflError, RunDirError
from hpcfl.files import atomic_write_text, read_yaml
from hpcfl.runner.rundir import SWEEP_MANIFEST, SWEEP_RUNS
from hpcfl.sweep.grid import Axis, Point, expand

if TYPE_CHECKING:  # the config module imports every algorithm (torch): not for reading a manifest
    from hpcfl.config import Config

MANIFEST = SWEEP_MANIFEST  # defined beside the run directory's markers (loggers group a sweep's points)
RUNS = SWEEP_RUNS  # the points' run directories: SWEEP_DIR/runs/<point name>


@dataclass
class SweepPoint:
    """A point of a sweep: its name, grid values, run directory and validated config."""

    name: str
    values: dict[str, Any]
    run_dir: Path
    cfg: Config | None = None  # None when read back from a manifest

    @property
    def seed(self) -> Any:
        return self.values.get("seed")


@dataclass
class Sweep:
    """A sweep directory's manifest: the grid, the points, and what the sweep selects on."""

    sweep_dir: Path
    name: str
    axes: list[Axis]
    points: list[SweepPoint]
    rounds: dict[str, int] = field(default_factory=dict)  # per point, for status and ETA
    search: dict[str, Any] | None = None  # {"key": "lr", "metric": "val_accuracy"} for a selection

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": 1,
                "name": self.name,
                "axes": [{"key": a.key, "values": list(a.values)} for a in self.axes],
                "search": self.search,
                "points": [
                    {
                        "name": p.name,
                        "values": p.values,
                        "run_dir": str(p.run_dir.relative_to(self.sweep_dir)),
                        "rounds": self.rounds.get(p.name),
                    }
                    for p in self.points
                ],
                "updated": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            },
            indent=1,
        )

    def write(self) -> None:
        """Write ``sweep.json`` atomically (a reader never sees half a manifest)."""
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.sweep_dir / MANIFEST, self.to_json() + "\n")


def is_sweep_dir(path: Path) -> bool:
    """True when ``path`` holds a sweep's manifest."""
    return (Path(path) / MANIFEST).is_file()


def read_sweep(sweep_dir: Path) -> Sweep:
    """The manifest of ``sweep_dir`` (one line naming the problem when it is missing or damaged)."""
    sweep_dir = Path(sweep_dir).resolve()
    path = sweep_dir / MANIFEST
    try:
        data = json.loads(path.read_text())
        axes = [Axis(a["key"], tuple(a["values"])) for a in data["axes"]]
        points = [SweepPoint(p["name"], dict(p["values"]), _point_dir(path, p)) for p in data["points"]]
        rounds = {p["name"]: p["rounds"] for p in data["points"] if p.get("rounds") is not None}
        return Sweep(sweep_dir, str(data["name"]), axes, points, rounds, data.get("search"))
    except FileNotFoundError:
        raise RunDirError(
            f"{sweep_dir} holds no sweep ({MANIFEST} missing); start one with hpcfl sweep"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise RunDirError(
            f"{path} is damaged ({type(err).__name__}); re-run the hpcfl sweep command that made it"
        ) from None


def _point_dir(manifest: Path, point: dict[str, Any]) -> Path:
    """A manifest point's run directory, which must lie inside the sweep directory: ``status`` and
    ``report`` would otherwise read, and a re-run of the sweep write, a run that is not the sweep's."""
    sweep_dir = manifest.parent
    run_dir = (sweep_dir / str(point["run_dir"])).resolve()
    if not run_dir.is_relative_to(sweep_dir) or run_dir == sweep_dir:
        raise RunDirError(
            f"{manifest}: point {point['name']!r} names run directory {point['run_dir']!r}, outside the "
            f"sweep; set it back to {RUNS}/{point['name']} (or remove {MANIFEST} and re-run the hpcfl sweep "
            "command that made it)"
        )
    return run_dir


def _check_point_dir(point: SweepPoint) -> None:
    saved = point.run_dir / "config.yaml"
    if point.cfg is None or not saved.exists():
        return
    from hpcfl.config import config_differences

    diffs = config_differences(read_yaml(saved), point.cfg.to_dict())
    if diffs:
        raise RunDirError(
            f"grid point {point.name}: {point.run_dir} holds a run of another config (differs in: "
            f"{', '.join(diffs)}); use another sweep directory, or remove that run"
        )


def plan_sweep(
    config: str | Path | None,
    sets: list[str],
    data_root: str | None,
    axes: list[Axis],
    sweep_dir: Path,
    *,
    name: str,
    search: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> Sweep:
    """Expand the grid and validate every point (config and run directory) before anything runs.

    ``extra`` holds overrides every point gets after its grid values (the LR search's validation
    split). The result merges the points of an existing manifest of the same sweep directory.
    """
    from hpcfl.config import load_cli_config

    base = load_cli_config(config, sets, data_root)
    sweep_dir = Path(sweep_dir).resolve()
    points = []
    for point in expand(axes, base.algorithm):
        points.append(_validated(point, axes, config, sets, data_root, sweep_dir, extra or {}))
    sweep = Sweep(sweep_dir, name, axes, points, {p.name: _rounds(p.cfg) for p in points}, search)
    if is_sweep_dir(sweep_dir):
        old = read_sweep(sweep_dir)
        if (old.search or None) != (search or None):
            raise ConfigError(
                f"{sweep_dir} holds a sweep with another selection ({old.search}); use another --name"
            )
        known = {p.name for p in points}
        kept = [p for p in old.points if p.name not in known]
        sweep.points = kept + points
        sweep.rounds = {**old.rounds, **sweep.rounds}
        sweep.axes = _merged_axes(old.axes, axes)
    return sweep


def _validated(
    point: Point,
    axes: list[Axis],
    config: str | Path | None,
    sets: list[str],
    data_root: str | None,
    sweep_dir: Path,
    extra: dict[str, Any],
) -> SweepPoint:
    from hpcfl.config import load_cli_config

    values = {**point.overrides(axes), **extra, "name": point.name}
    try:
        cfg = load_cli_config(config, sets, data_root, values)
    except HpcflError as err:
        raise ConfigError(f"grid point {point.name}: {err}") from None
    if "validation" in extra:
        from hpcfl.sweep.select import check_searchable

        check_searchable(cfg.algorithm, point.name)
    out = SweepPoint(point.name, point.values, sweep_dir / RUNS / point.name, cfg)
    _check_point_dir(out)
    return out


def _rounds(cfg: Config | None) -> int:
    from hpcfl.runner.experiment import stage_rounds

    return stage_rounds(cfg)[1] if cfg is not None else 0


def _merged_axes(old: list[Axis], new: list[Axis]) -> list[Axis]:
    """The union of two grids' axes, values in first-seen order (old first)."""
    out: dict[str, list[Any]] = {}
    for axis in [*old, *new]:
        values = out.setdefault(axis.key, [])
        values += [v for v in axis.values if v not in values]
    return [Axis(k, tuple(v)) for k, v in out.items()]
