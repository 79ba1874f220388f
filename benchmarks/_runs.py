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

import argparse
import concurrent.futures
import json
import multiprocessing
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcfl.comm.guard import die_with_parent
from hpcfl.report.methods import Cell
from hpcfl.report.protocol import VALIDATION, Protocol
from hpcfl.report.targets import default_target

if TYPE_CHECKING:
    from hpcfl.sweep.select import Choice


def add_option_arguments(parser: argparse.ArgumentParser) -> None:
    """``--dataset-option`` and ``--model-option KEY=VALUE ...``: the runs' ``dataset_options`` and
    ``model_options`` (read by :func:`options`)."""
    parser.add_argument(
        "--dataset-option",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="dataset_options, e.g. sample_roles=100 test_samples=4000 split=temporal (shakespeare); "
        "whole numbers are read as numbers",
    )
    parser.add_argument(
        "--model-option",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="model_options, e.g. d_model=32 layers=1 heads=2 (char-transformer)",
    )


def options(pairs: list[str]) -> dict[str, int | str]:
    """``KEY=VALUE`` pairs: a whole number as a number, anything else as written."""
    split = (o.split("=", 1) for o in pairs)
    return {k: int(v) if v.lstrip("-").isdigit() else v for k, v in split}


def federation_keys(args: argparse.Namespace) -> dict[str, Any]:
    """The config keys of a benchmark's federation, from its ``--dataset``, ``--dataset-option``,
    ``--partition``, ``--clients``, ``--per-round``, ``--model``, ``--model-option`` and
    ``--data-root`` (left out when not given: ``$HPCFL_DATA`` decides)."""
    keys: dict[str, Any] = dict(
        dataset=args.dataset,
        dataset_options=options(args.dataset_option),
        partition=args.partition,
        num_clients=args.clients,
        clients_per_round=args.per_round,
        model=args.model,
        model_options=options(args.model_option),
    )
    if args.data_root:
        keys["data_root"] = args.data_root
    return keys


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
    to choose among (one value: fixed, no search). With more than one candidate, ``config`` must
    hold out a ``validation`` share: the choice is made on it, never on the test set.

    ``own``: the method's own weight searched beside the lr, ``(params key, values)`` (every lr ×
    every value); ``judge``: the per-round metric the choice is made by (default the server model's
    ``val_accuracy``; a personalised method's ``personal_val_acc_mean``: each client's own model on
    its own validation share); ``lr_keys``: the config keys a candidate's lr sets (``a.b``: key b of
    section a), e.g. ``("lr", "finetune_eval.lr")`` for fine-tuning at the run's lr."""

    row: str
    column: str
    config: dict[str, Any]
    lrs: tuple[float, ...]
    own: tuple[str, tuple[float, ...]] | None = None
    judge: str = VALIDATION
    lr_keys: tuple[str, ...] = ("lr",)

    def candidates(self) -> list[Any]:
        """What is chosen among: the lrs, or (lr, own value) pairs."""
        if self.own is None:
            return list(self.lrs)
        return [(lr, v) for lr in self.lrs for v in self.own[1]]

    def overrides(self, candidate: Any) -> dict[str, Any]:
        """The config keys a candidate sets (sections merged with the config's)."""
        lr, value = (candidate, None) if self.own is None else candidate
        out: dict[str, Any] = {}
        for key in self.lr_keys:
            section, _, name = key.rpartition(".")
            if section:
                out[section] = {**self.config.get(section, {}), name: lr}
            else:
                out[name] = lr
        if self.own is not None:
            out["params"] = {**self.config.get("params", {}), self.own[0]: value}
        return out


def run_dir_of(out: Path, setting: Setting, candidate: Any, seed: int) -> Path:
    """``out/runs/<column>/<row>/lr=<lr>[,<own key>=<value>],seed=<seed>`` (names as ``hpcfl sweep``
    makes them)."""
    from hpcfl.sweep.grid import point_name

    point: dict[str, Any] = {"lr": candidate if setting.own is None else candidate[0]}
    if setting.own is not None:
        point[setting.own[0]] = candidate[1]
    return (
        out
        / "runs"
        / point_name({"partition": setting.column})
        / point_name({"method": setting.row})
        / point_name({**point, "seed": seed})
    )


def _run_all(jobs: list[tuple[dict[str, Any], str]], parallel: int) -> None:
    """``run_cached`` over ``jobs``, ``parallel`` worker processes at a time (spawned)."""
    if parallel <= 1:
        for job in jobs:
            run_cached(*job)
        return
    with worker_pool(parallel) as pool:
        list(pool.map(run_cached, *zip(*jobs, strict=True)))


def worker_pool(parallel: int) -> concurrent.futures.ProcessPoolExecutor:
    """``parallel`` spawned worker processes that end with this one: a killed benchmark sends its
    workers SIGTERM, so a run in flight checkpoints and stops (orphans used to go on training and
    writing into the run directories a later invocation resumes)."""
    return concurrent.futures.ProcessPoolExecutor(
        max_workers=parallel,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=die_with_parent,
        initargs=(signal.SIGTERM,),
    )


def run_protocol(
    settings: list[Setting], *, seeds: list[int], out: Path, jobs: int, protocol: Protocol
) -> list[Cell]:
    """The protocol for each setting: (1) every candidate (lr, or lr × own weight) at the first
    seed; (2) the one whose last-k mean of the setting's ``judge`` metric (a validation figure) is
    best (:func:`hpcfl.sweep.select.choose`: ties to the first, i.e. the smaller lr); (3) the other
    seeds at that candidate (the first seed's run is reused). Runs are cached (a finished one is not
    re-run), every config is validated before the first run starts. Returns one
    :class:`hpcfl.report.methods.Cell` per setting: the finished seeds at the chosen candidate and
    the choice (None when nothing was searched)."""
    from hpcfl.config import config_from_dict
    from hpcfl.report import summarise
    from hpcfl.report.protocol import last_k_mean
    from hpcfl.sweep.select import choose

    def label(s: Setting, c: Any) -> str:
        return f"lr{c:g}" if s.own is None else f"lr{c[0]:g}-{s.own[0]}{c[1]:g}"

    def cfg(s: Setting, c: Any, seed: int) -> dict[str, Any]:
        return {
            **s.config,
            **s.overrides(c),
            "name": f"{s.column}-{s.row}-{label(s, c)}-s{seed}",
            "seed": seed,
        }

    for s in settings:  # validate everything before the first run starts
        if len(s.candidates()) > 1 and not s.config.get("validation"):
            raise ValueError(f"{s.row} on {s.column}: a search needs config key 'validation' > 0")
        for c in s.candidates():
            config_from_dict(cfg(s, c, seeds[0]))
    first = [
        (cfg(s, c, seeds[0]), str(run_dir_of(out, s, c, seeds[0]))) for s in settings for c in s.candidates()
    ]
    _run_all(first, jobs)

    def finished(path: Path) -> list[dict[str, Any]] | None:
        return summarise(path).rows if (path / "DONE").exists() else None

    chosen: dict[int, Choice | None] = {}
    pick: dict[int, Any] = {}
    for i, s in enumerate(settings):
        cands = s.candidates()
        if len(cands) == 1:
            chosen[i], pick[i] = None, cands[0]
            continue
        vals = {}
        for j, c in enumerate(cands):
            rows = finished(run_dir_of(out, s, c, seeds[0]))
            vals[j] = [] if rows is None else [last_k_mean(rows, protocol.last_k, s.judge)]
        chosen[i] = choose(cands, vals)
        pick[i] = None if chosen[i] is None else chosen[i].value
    rest = [
        (cfg(s, pick[i], seed), str(run_dir_of(out, s, pick[i], seed)))
        for i, s in enumerate(settings)
        if pick[i] is not None
        for seed in seeds[1:]
    ]
    _run_all(rest, jobs)
    cells = []
    for i, s in enumerate(settings):
        c = pick[i]
        dirs = [] if c is None else [run_dir_of(out, s, c, seed) for seed in seeds]
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
    from hpcfl.bench.machine import csv_with_machine, with_machine
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
    stem.with_suffix(".csv").write_text(csv_with_machine("".join(csv_parts)))
    stem.with_suffix(".json").write_text(
        json.dumps(
            with_machine(
                {
                    "cells": [
                        {
                            "method": c.row,
                            "column": c.column,
                            "chosen_lr": None if c.choice is None else c.choice.value,  # (lr, own) with own
                            "candidates_val_last_k": None if c.choice is None else c.choice.candidates,
                            "runs": [{"name": r.name, "rows": r.rows} for r in c.runs],
                        }
                        for c in cells
                    ]
                }
            ),
            indent=1,
        )
    )
    if any(c.runs for c in cells):
        plot_bands(cells, stem.with_suffix(".png"))
    return text
