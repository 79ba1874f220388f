"""Rounds and bytes to a target accuracy, with the speed-up over FedAvg (FedPVR Table 2's form).

A run reaches the target at the first logged round whose running mean of test accuracy over the
last ``window`` evaluated rounds (:func:`hpcfl.report.protocol.running_mean`; fewer at the start)
is ≥ the target, so one spike of an oscillating run does not count (``window`` 1: the raw first
crossing; reports use the protocol's window, 3 by default). Bytes to
target add each logged row's per-round traffic (``bytes_up + bytes_down``) times the rounds since
the previous logged row, so a run evaluated every few rounds is still charged for every round (the
traffic of a round is the same between evaluations unless participation varies, when it is the
logged round's figure). A run with simulated time (``sim_time``: ``system.clock`` or an
asynchronous algorithm, :mod:`hpcfl.runner.asynchronous`) also reports the simulated seconds and the
client updates to the target round, so synchronous and asynchronous methods compare at equal
simulated time.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass

from hpcfl.report.protocol import TEST, running_mean
from hpcfl.report.summary import RunSummary


@dataclass(frozen=True)
class TargetRow:
    """One run's cost of reaching the target (``rounds`` None: never reached)."""

    run: RunSummary
    rounds: int | None
    bytes: float | None  # up + down, all participants, up to and including the target round
    speedup: float | None  # FedAvg's rounds / this run's rounds, same partition; None if either missed
    baseline: str | None  # the FedAvg run compared against
    sim_time: float | None = None  # simulated seconds to the target round (None: no clock, or missed)
    updates: int | None = None  # client updates applied to the target round (with ``sim_time``)


def cumulative_bytes(rows: list[dict], keys: tuple[str, ...] = ("bytes_up", "bytes_down")) -> list[float]:
    """Traffic (the ``keys`` of each row: up + down by default) summed to each logged row, charging
    every round in between."""
    total, last, out = 0.0, 0, []
    for row in rows:
        rnd = int(row["round"])
        per_round = sum(float(row.get(key, 0.0)) for key in keys)
        total += per_round * max(rnd - last, 0)
        last = rnd
        out.append(total)
    return out


def smoothed(run: RunSummary, window: int) -> list[float]:
    """The run's test accuracy per logged row as a trailing mean over ``window`` evaluated rounds."""
    return running_mean([float(row[TEST]) for row in run.rows], window)


def rounds_to_target(run: RunSummary, target: float, *, window: int = 1) -> tuple[int | None, float | None]:
    """(first round whose running mean of test accuracy over ``window`` evaluated rounds is
    ≥ ``target``, bytes to that round), or (None, None)."""
    curve = smoothed(run, window)
    for row, acc, spent in zip(run.rows, curve, cumulative_bytes(run.rows), strict=True):
        if acc >= target:
            return int(row["round"]), spent
    return None, None


def sim_time_to_target(run: RunSummary, target: float, *, window: int = 1) -> tuple[float | None, int | None]:
    """(simulated seconds, client updates) at the round :func:`rounds_to_target` finds, or (None,
    None) when the run has no simulated time or never reaches ``target``."""
    curve = smoothed(run, window)
    for row, acc in zip(run.rows, curve, strict=True):
        if acc >= target:
            if "sim_time" not in row:
                return None, None
            return float(row["sim_time"]), int(row["client_updates"])
    return None, None


def default_target(runs: list[RunSummary], *, window: int = 1) -> float:
    """The largest whole percent that every run's running mean reaches (the lowest of their best
    running means, floored), so the table compares every run; pass ``--target`` for the paper's
    fixed level."""
    return math.floor(100 * min(max(smoothed(r, window)) for r in runs)) / 100


def target_rows(runs: list[RunSummary], target: float, *, window: int = 1) -> list[TargetRow]:
    """Each run's rounds and bytes to ``target`` (running mean over ``window`` evaluated rounds) and
    its speed-up over the FedAvg run of its partition (the first such run given)."""
    reached = {id(r): rounds_to_target(r, target, window=window) for r in runs}
    fedavg = {}
    for r in runs:
        if r.algorithm == "fedavg":
            fedavg.setdefault(r.partition, r)
    out = []
    for r in runs:
        rounds, spent = reached[id(r)]
        base = fedavg.get(r.partition)
        base_rounds = reached[id(base)][0] if base is not None else None
        speedup = base_rounds / rounds if rounds and base_rounds else None
        sim, updates = sim_time_to_target(r, target, window=window)
        out.append(
            TargetRow(r, rounds, spent, speedup, base.name if base is not None else None, sim, updates)
        )
    return out


def target_markdown(rows: list[TargetRow], target: float, *, window: int = 1) -> str:
    """Table 2's form, per run: rounds to the target with the speed-up over FedAvg in brackets."""
    pct = f"{100 * target:g}%"
    smooth = f"running mean over {window} evaluated rounds" if window > 1 else "single rounds"
    timed = any("sim_time" in r for t in rows for r in t.run.rows[:1])
    lines = [
        f"Rounds to {pct} test accuracy ({smooth}; speed-up over the FedAvg run of the same partition) "
        f"and the traffic until then (up + down, all participants)"
        + (", the simulated seconds and the client updates until then" if timed else "")
        + ", per run.",
        "",
        f"| run | algorithm | partition | rounds to {pct} | MB to {pct} "
        + (f"| sim. s to {pct} | updates to {pct} " if timed else "")
        + "| final test acc. |",
        "|---|---|---|---:|---:|" + ("---:|---:|" if timed else "") + "---:|",
    ]
    for t in rows:
        if t.rounds is None:
            rounds, mb = f"not in {t.run.rounds}", "—"
        else:
            rounds = f"{t.rounds}" + (f" ({t.speedup:.2f}×)" if t.speedup is not None else "")
            mb = f"{t.bytes / 1e6:,.1f}"
        sim = ""
        if timed:
            sim = "| — | — " if t.sim_time is None else f"| {t.sim_time:,.1f} | {t.updates} "
        lines.append(
            f"| {t.run.name} | {t.run.label} | {t.run.partition} | {rounds} | {mb} {sim}"
            f"| {100 * t.run.final_accuracy:.2f}% |"
        )
    return "\n".join(lines) + "\n"


def target_csv(rows: list[TargetRow], target: float, *, window: int = 1) -> str:
    """The per-run target table's numbers, with the running-mean window."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(
        [
            "run",
            "algorithm",
            "partition",
            "target",
            "window",
            "rounds_to_target",
            "bytes_to_target",
            "speedup_vs_fedavg",
            "sim_time_to_target",
            "updates_to_target",
        ]
    )
    for t in rows:
        writer.writerow(
            [
                *(t.run.name, t.run.algorithm, t.run.partition, target, window),
                *(t.rounds, t.bytes, t.speedup, t.sim_time, t.updates),
            ]
        )
    return buf.getvalue()
