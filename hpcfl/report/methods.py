"""The headline table of ``hpcfl report RUN_DIR ...``: one line per method, mean ± std over seeds.

Run directories whose configs differ only in run-time keys (seed, name, threads, paths, ...) are
seeds of one method. Per method: the number of seeds, the last-k mean test accuracy (mean ± sample
std over seeds), rounds and MB to the target on the running mean (over the seeds that reached it),
and, secondary, the final single-round accuracy. Methods are labelled by algorithm and the form
it ran in (``scaffold (control_variates)``); two methods of one label and partition also show the
keys where their configs differ (``fedavg, lr=0.1``).
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hpcfl.report.protocol import TEST, Protocol, fmt_mean_std, last_k_mean, mean_std
from hpcfl.report.summary import RunSummary
from hpcfl.report.targets import rounds_to_target

if TYPE_CHECKING:
    from hpcfl.sweep.select import Choice

#: Config keys that do not change what a run computes, or that enumerate repeats of it.
RUN_ONLY = frozenset(
    {
        "name",
        "seed",
        "threads",
        "progress",
        "data_root",
        "download",
        "device",
        "comm",
        "checkpoint_every",
        "client_state_memory",
        "client_batch",
        "loggers",  # views of metrics.jsonl (TensorBoard, MLflow, W&B)
    }
)


@dataclass
class Cell:
    """The seeds of one method (``row``) in one setting (``column``: a partition, a grid value):
    one cell of a comparison table. Also the cells of ``hpcfl report SWEEP_DIR`` and of the
    benchmark tables."""

    row: str
    column: str
    runs: list[RunSummary] = field(default_factory=list)
    choice: Choice | None = None  # with a search: the value chosen on validation

    @property
    def n(self) -> int:
        return len(self.runs)

    def last_k(self, k: int, key: str = TEST) -> list[float]:
        """Each seed's mean of ``key`` (test accuracy) over its last ``k`` evaluated rounds."""
        return [v for v in (last_k_mean(r.rows, k, key) for r in self.runs) if v is not None]

    def paired_last_k(self, other: Cell, k: int, key: str = TEST) -> list[float]:
        """Per seed present in both cells, this cell's last-``k`` mean of ``key`` minus ``other``'s
        (same seed: same clients drawn, same data order), in seed order: the paired comparison of two
        methods, whose spread leaves out what the seeds share."""

        def by_seed(cell: Cell) -> dict[object, float]:
            return {
                r.config.get("seed"): v for r in cell.runs if (v := last_k_mean(r.rows, k, key)) is not None
            }

        mine, theirs = by_seed(self), by_seed(other)
        return [mine[s] - theirs[s] for s in sorted(set(mine) & set(theirs))]

    def reached(self, target: float, window: int) -> list[tuple[int, float]]:
        """(rounds, bytes) to ``target`` on the running mean, of the seeds that reached it."""
        hits = (rounds_to_target(r, target, window=window) for r in self.runs)
        return [(rounds, spent) for rounds, spent in hits if rounds is not None and spent is not None]

    @property
    def forms(self) -> list[str]:
        """The forms its runs record (SCAFFOLD's control_variates / one_model), if any."""
        return sorted({r.form for r in self.runs if r.form})


def _identity(run: RunSummary) -> dict:
    return {k: v for k, v in run.config.items() if k not in RUN_ONLY}


def group_methods(runs: list[RunSummary]) -> list[Cell]:
    """Runs grouped into methods (same config but for :data:`RUN_ONLY` keys), in order of first
    appearance."""
    groups: dict[str, Cell] = {}
    identity: dict[str, dict] = {}
    for run in runs:
        key = json.dumps(_identity(run), sort_keys=True, default=str) + f"|{run.label}|{run.partition}"
        if key not in groups:
            groups[key] = Cell(run.label, run.partition)
            identity[key] = _identity(run)
        groups[key].runs.append(run)
    by_label: dict[tuple[str, str], list[str]] = {}
    for key, method in groups.items():
        by_label.setdefault((method.row, method.column), []).append(key)
    for keys in by_label.values():
        if len(keys) < 2:
            continue
        differ = sorted(
            {k for key in keys for k in identity[key]}
            - {
                k
                for k in identity[keys[0]]
                if all(identity[key].get(k) == identity[keys[0]][k] for key in keys)
            }
        )
        for key in keys:
            shown = ", ".join(f"{k}={json.dumps(identity[key].get(k), default=str)}" for k in differ)
            groups[key].row += f", {shown}"
    return list(groups.values())


def method_markdown(methods: list[Cell], protocol: Protocol, target: float) -> str:
    """The headline table: last-k mean ± std and rounds/MB to target per method."""
    k, w, pct = protocol.last_k, protocol.window, f"{100 * target:g}%"
    rows = [r.rows for m in methods for r in m.runs]
    lines = [
        f"Per method, mean ± sample std over seeds ({protocol.describe(rows)}; target {pct}; (r/n): only "
        "r of n seeds reached it). The final single-round accuracy is secondary.",
        "",
        f"| method | partition | seeds | last-{protocol.label(rows)} test acc. (%) | rounds to {pct} (mean of {w}) "
        f"| MB to {pct} | final test acc. (%) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for m in methods:
        reached = m.reached(target, w)
        note = f" ({len(reached)}/{m.n})" if len(reached) != m.n else ""
        rounds = (
            fmt_mean_std([float(r) for r, _ in reached], scale=1.0, digits=1) if reached else "not reached"
        )
        mb = fmt_mean_std([b for _, b in reached], scale=1e-6, digits=1) if reached else "—"
        lines.append(
            f"| {m.row} | {m.column} | {m.n} | {fmt_mean_std(m.last_k(k))} | {rounds}{note} | {mb} "
            f"| {fmt_mean_std([r.final_accuracy for r in m.runs])} |"
        )
    return "\n".join(lines) + "\n"


def method_csv(methods: list[Cell], protocol: Protocol, target: float) -> str:
    """The headline table's numbers (fractions, bytes), one line per method."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(
        ["method", "partition", "n", "last_k", "last_k_mean", "last_k_std", "target", "window",
         "reached", "rounds_to_target_mean", "rounds_to_target_std", "bytes_to_target_mean",
         "bytes_to_target_std", "final_mean", "final_std"]
    )  # fmt: skip
    for m in methods:
        reached = m.reached(target, protocol.window)
        writer.writerow(
            [m.row, m.column, m.n, protocol.last_k, *mean_std(m.last_k(protocol.last_k)), target,
             protocol.window, len(reached), *mean_std([float(r) for r, _ in reached]),
             *mean_std([b for _, b in reached]), *mean_std([r.final_accuracy for r in m.runs])]
        )  # fmt: skip
    return buf.getvalue()
