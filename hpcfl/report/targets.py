"""Rounds and bytes to a target accuracy, with the speed-up over FedAvg (FedPVR Table 2's form).

A run reaches the target at the first logged round whose test accuracy is ≥ the target. Bytes to
target add each logged row's per-round traffic (``bytes_up + bytes_down``) times the rounds since
the previous logged row, so a run evaluated every few rounds is still charged for every round (the
traffic of a round is the same between evaluations unless participation varies, when it is the
logged round's figure).
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass

from hpcfl.report.summary import RunSummary


@dataclass(frozen=True)
class TargetRow:
    """One run's cost of reaching the target (``rounds`` None: never reached)."""

    run: RunSummary
    rounds: int | None
    bytes: float | None  # up + down, all participants, up to and including the target round
    speedup: float | None  # FedAvg's rounds / this run's rounds, same partition; None if either missed
    baseline: str | None  # the FedAvg run compared against


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


def rounds_to_target(run: RunSummary, target: float) -> tuple[int | None, float | None]:
    """(first round with test accuracy ≥ ``target``, bytes to that round), or (None, None)."""
    for row, spent in zip(run.rows, cumulative_bytes(run.rows), strict=True):
        if float(row["test_accuracy"]) >= target:
            return int(row["round"]), spent
    return None, None


def default_target(runs: list[RunSummary]) -> float:
    """The largest whole percent that every run reaches (its lowest best accuracy, floored), so the
    table compares every run; pass ``--target`` for the paper's fixed level."""
    return math.floor(100 * min(r.best_accuracy for r in runs)) / 100


def target_rows(runs: list[RunSummary], target: float) -> list[TargetRow]:
    """Each run's rounds and bytes to ``target`` and its speed-up over the FedAvg run of its
    partition (the first such run given)."""
    reached = {id(r): rounds_to_target(r, target) for r in runs}
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
        out.append(TargetRow(r, rounds, spent, speedup, base.name if base is not None else None))
    return out


def target_markdown(rows: list[TargetRow], target: float) -> str:
    """Table 2's form: rounds to the target with the speed-up over FedAvg in brackets."""
    pct = f"{100 * target:g}%"
    lines = [
        f"Rounds to {pct} test accuracy (speed-up over the FedAvg run of the same partition) and the "
        f"traffic until then (up + down, all participants).",
        "",
        f"| run | algorithm | partition | rounds to {pct} | MB to {pct} | final test acc. |",
        "|---|---|---|---:|---:|---:|",
    ]
    for t in rows:
        if t.rounds is None:
            rounds, mb = f"not in {t.run.rounds}", "—"
        else:
            rounds = f"{t.rounds}" + (f" ({t.speedup:.2f}×)" if t.speedup is not None else "")
            mb = f"{t.bytes / 1e6:,.1f}"
        lines.append(
            f"| {t.run.name} | {t.run.algorithm} | {t.run.partition} | {rounds} | {mb} "
            f"| {100 * t.run.final_accuracy:.2f}% |"
        )
    return "\n".join(lines) + "\n"


def target_csv(rows: list[TargetRow], target: float) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(
        [
            "run",
            "algorithm",
            "partition",
            "target",
            "rounds_to_target",
            "bytes_to_target",
            "speedup_vs_fedavg",
        ]
    )
    for t in rows:
        writer.writerow([t.run.name, t.run.algorithm, t.run.partition, target, t.rounds, t.bytes, t.speedup])
    return buf.getvalue()
