"""One line per run directory: its headline numbers as a markdown and a CSV table."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

from hpcfl.errors import RunDirError
from hpcfl.files import read_jsonl, read_yaml


@dataclass
class RunSummary:
    """The headline numbers of one run directory."""

    name: str
    algorithm: str
    partition: str
    rounds: int
    final_accuracy: float
    best_accuracy: float
    seconds: float
    rows: list[dict]
    participation: str = "all"  # "all", or "M of K (each client trained a..b times)"


def summarise(run_dir: Path) -> RunSummary:
    """Read one run directory's config and metrics."""
    run_dir = Path(run_dir)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if not (run_dir / "config.yaml").exists() or not rows:
        raise RunDirError(f"{run_dir} holds no finished round (no config.yaml or empty metrics.jsonl)")
    cfg = read_yaml(run_dir / "config.yaml")
    return RunSummary(
        name=str(cfg.get("name", run_dir.name)),
        algorithm=str(cfg.get("algorithm")),
        partition=str(cfg.get("partition")),
        rounds=int(rows[-1]["round"]),
        final_accuracy=float(rows[-1]["test_accuracy"]),
        best_accuracy=max(float(r["test_accuracy"]) for r in rows),
        seconds=sum(float(r.get("seconds", 0.0)) for r in rows),
        rows=rows,
        participation=_participation(cfg, rows),
    )


def _participation(cfg: dict, rows: list[dict]) -> str:
    """Who trained: every client every round, or M of K per round with how often each trained
    (counted over the rounds that wrote a metrics row; every round when eval_every is 1)."""
    drawn = [r["participants"] for r in rows if "participants" in r]
    if not drawn:
        return "all"
    K = int(cfg.get("num_clients", 0)) or 1 + max(k for who in drawn for k in who)
    times = [0] * K
    for who in drawn:
        for k in who:
            times[k] += 1
    return f"{len(drawn[-1])} of {K} (each trained {min(times)}..{max(times)}× in {len(drawn)} logged rounds)"


def markdown_table(runs: list[RunSummary]) -> str:
    """A markdown table with one line per run."""
    lines = [
        "| run | algorithm | partition | participants per round | rounds | final test acc. | best test acc. "
        "| time of all rounds (s) |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r.name} | {r.algorithm} | {r.partition} | {r.participation} | {r.rounds} | {100 * r.final_accuracy:.2f}% "
            f"| {100 * r.best_accuracy:.2f}% | {r.seconds:.1f} |"
        )
    return "\n".join(lines) + "\n"


def csv_table(runs: list[RunSummary]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(
        ["run", "algorithm", "partition", "rounds", "final_test_accuracy", "best_test_accuracy", "seconds"]
    )
    for r in runs:
        writer.writerow(
            [r.name, r.algorithm, r.partition, r.rounds, r.final_accuracy, r.best_accuracy, r.seconds]
        )
    return buf.getvalue()
