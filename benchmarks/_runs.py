"""Cached grid runs and the comparison protocol for the benchmark scripts.

:func:`run_cached` is a thin layer over :func:`hpcfl.sweep.run_point`. A run whose directory holds
DONE with the same config is not re-run, an unfinished one is resumed, one of another config is
started over, and one that failed with an hpcfl error (a diverging baseline, say) is recorded in
FAILED and reported rather than ending the whole grid (and not retried). Runs in spawned worker
processes (imports inside).

:func:`run_protocol` and :func:`write_tables` apply :mod:`hpcfl.report.protocol` to a list of
:class:`Setting` (method × partition): learning rate chosen per setting on the last-k mean of a
validation split, then every seed at the chosen value; tables of the last-k mean ± std over seeds,
rounds and MB to target on a running mean, curves with ± std bands — the same tables as
``hpcfl report SWEEP_DIR`` (:mod:`hpcfl.sweep.report`), so every benchmark reports alike.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcfl.report.methods import Cell
from hpcfl.report.protocol import Protocol
from hpcfl.report.targets import default_target

if TYPE_CHECKING:
    from hpcfl.sweep.select import Choice


def run_cached(cfg_dict: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """One run (in a worker process): skipped when DONE with this config, resumed when unfinished."""
    from hpcfl.config import config_from_dict
    from hpcfl.files import read_jsonl
    from hpcfl.sweep import run_point

    path = Path(run_dir)
    outcome = run_point(config_from_dict(cfg_dict), path, retry_failed=False, replace_other=True)
    print(f"{cfg_dict['name']:20s} {outcome.status} ({outcome.seconds:.0f} s)", flush=True)
    rows = read_jsonl(path / "metrics.jsonl") if (path / "metrics.jsonl").exists() else []
    return {"rows": rows, "seconds": outcome.seconds, "status": outcome.status}


# ---------------------------------------------------------------------------------------------
# the comparison protocol (hpcfl.report.protocol) for the benchmark tables


@dataclass(frozen=True)
class Setting:
    """One cell of a benchmark table to fill under the protocol: a method (``row``) in a setting
    (``column``, e.g. a partition), its config without ``lr`` and ``seed``, and the learning rates
    to choose among (one value: fixed, no search). With more than one, ``config`` must hold out a
    ``validation`` share: the choice is made on it, never on the test set."""

    row: str
    column: str
    config: dict[str, Any]
    lrs: tuple[float, ...]


def run_dir_of(out: Path, setting: Setting, lr: float, seed: int) -> Path:
    """``out/runs/<column>/<row>/lr=<lr>,seed=<seed>`` (names as ``hpcfl sweep`` makes them)."""
    from hpcfl.sweep.grid import point_name

    return (
        out
        / "runs"
        / point_name({"partition": setting.column})
        / point_name({"method": setting.row})
        / point_name({"lr": lr, "seed": seed})
    )


def _run_all(jobs: list[tuple[dict[str, Any], str]], parallel: int) -> None:
    """``run_cached`` over ``jobs``, ``parallel`` worker processes at a time (spawned)."""
    if parallel <= 1:
        for job in jobs:
            run_cached(*job)
        return
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=parallel, mp_context=ctx) as pool:
        list(pool.map(run_cached, *zip(*jobs, strict=True)))


def run_protocol(
    settings: list[Setting], *, seeds: list[int], out: Path, jobs: int, protocol: Protocol
) -> list[Cell]:
    """The protocol for each setting: (1) every candidate lr at the first seed; (2) the lr whose
    last-k mean validation accuracy is best (:func:`hpcfl.sweep.select.choose`); (3) the other
    seeds at that lr (the first seed's run is reused). Runs are cached (a finished one is not
    re-run), every config is validated before the first run starts. Returns one
    :class:`hpcfl.report.methods.Cell` per setting: the finished seeds at the chosen lr and the
    choice (None when the lr was fixed)."""
    from hpcfl.config import config_from_dict
    from hpcfl.report import summarise
    from hpcfl.report.protocol import VALIDATION, last_k_mean
    from hpcfl.sweep.select import choose

    def cfg(s: Setting, lr: float, seed: int) -> dict[str, Any]:
        return {**s.config, "name": f"{s.column}-{s.row}-lr{lr:g}-s{seed}", "lr": lr, "seed": seed}

    for s in settings:  # validate everything before the first run starts
        if len(s.lrs) > 1 and not s.config.get("validation"):
            raise ValueError(f"{s.row} on {s.column}: an lr search needs config key 'validation' > 0")
        for lr in s.lrs:
            config_from_dict(cfg(s, lr, seeds[0]))
    first = [(cfg(s, lr, seeds[0]), str(run_dir_of(out, s, lr, seeds[0]))) for s in settings for lr in s.lrs]
    _run_all(first, jobs)

    def finished(path: Path) -> list[dict[str, Any]] | None:
        return summarise(path).rows if (path / "DONE").exists() else None

    chosen: dict[int, Choice | None] = {}
    lr_of: dict[int, float | None] = {}
    for i, s in enumerate(settings):
        if len(s.lrs) == 1:
            chosen[i], lr_of[i] = None, s.lrs[0]
            continue
        vals = {}
        for j, lr in enumerate(s.lrs):
            rows = finished(run_dir_of(out, s, lr, seeds[0]))
            vals[j] = [] if rows is None else [last_k_mean(rows, protocol.last_k, VALIDATION)]
        chosen[i] = choose(s.lrs, vals)
        lr_of[i] = None if chosen[i] is None else chosen[i].value
    rest = [
        (cfg(s, lr_of[i], seed), str(run_dir_of(out, s, lr_of[i], seed)))
        for i, s in enumerate(settings)
        if lr_of[i] is not None
        for seed in seeds[1:]
    ]
    _run_all(rest, jobs)
    cells = []
    for i, s in enumerate(settings):
        lr = lr_of[i]
        dirs = [] if lr is None else [run_dir_of(out, s, lr, seed) for seed in seeds]
        runs = [summarise(d) for d in dirs if (d / "DONE").exists()]
        cells.append(Cell(s.row, s.column, runs, chosen[i]))
    return cells


def column_targets(cells: list[Cell], columns: list[str], protocol: Protocol) -> dict[str, float]:
    """Each column's default target (:func:`hpcfl.report.targets.default_target` over its runs, on
    the protocol's running mean); 0.5 for a column with no finished run."""
    targets = {}
    for column in columns:
        runs = [r for c in cells if c.column == column for r in c.runs]
        targets[column] = default_target(runs, window=protocol.window) if runs else 0.5
    return targets


def write_tables(
    cells: list[Cell], protocol: Protocol, targets: dict[str, float], stem: Path, header: str
) -> str:
    """``stem``.md (per column: the protocol's tables at that column's target, a fraction), .csv
    (hpcfl's sweep ``summary.csv`` layout), .json (every run's rows per cell) and .png (curves,
    mean ± std over seeds). Returns the markdown."""
    from hpcfl.sweep.report import plot_bands, protocol_markdown, summary_csv

    md = [header, "", f"Protocol: {protocol.describe()}.", ""]
    csv_parts = []
    for column in dict.fromkeys(c.column for c in cells):
        mine = [c for c in cells if c.column == column]
        md += [f"## {column} (target {100 * targets[column]:g}%)", ""]
        md += protocol_markdown(
            mine, protocol, targets[column], search="lr" if any(c.choice for c in mine) else None
        )
        md.append("")
        part = summary_csv(mine, targets[column], protocol)
        csv_parts.append(part if not csv_parts else part.split("\n", 1)[1])
    text = "\n".join(md) + "\n"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".csv").write_text("".join(csv_parts))
    stem.with_suffix(".json").write_text(
        json.dumps(
            [
                {
                    "method": c.row,
                    "column": c.column,
                    "chosen_lr": None if c.choice is None else c.choice.value,
                    "candidates_val_last_k": None if c.choice is None else c.choice.candidates,
                    "runs": [{"name": r.name, "rows": r.rows} for r in c.runs],
                }
                for c in cells
            ],
            indent=1,
        )
    )
    if any(c.runs for c in cells):
        plot_bands(cells, stem.with_suffix(".png"))
    return text
