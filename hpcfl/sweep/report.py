"""``hpcfl report SWEEP_DIR``: a sweep in the papers' table layout, mean ± std over seeds.

One row per method (the ``algorithm`` axis, with an algorithm's own hyper-parameter values beside
it: ``fedprox (mu=0.01)``), one column per value of the other axes (``dir:0.1``, ``dir:0.5``);
each cell the mean ± sample standard deviation over the seeds of the finished points. The headline
table is the protocol's (:mod:`hpcfl.report.protocol`): each seed's mean test accuracy over its last
k evaluated rounds; then rounds to a target accuracy on a running mean, and, secondary, the final
and best single-round accuracy; the form an algorithm ran in where its runs record one. All in
``report.md`` and one long ``summary.csv``; where the runs evaluated per client (``client_eval``), the
worst-10 % client accuracy ``client_acc_p10`` (last-k mean, mean ± std over seeds) beside test
accuracy; ``curves.png`` draws the mean test accuracy per round
with a band of ± one standard deviation. With a ``--search``, each cell uses only the value chosen
on the validation split by the same last-k mean of ``val_accuracy`` — for a personalised method
that logs it, ``personal_val_acc_mean`` (each client's own model on its own validation share) —
(``selection.csv`` lists every candidate's).

:func:`protocol_markdown`, :func:`summary_csv` and :func:`plot_bands` take any list of
:class:`Cell`, so the benchmark scripts print the same tables (``benchmarks/_runs.py``).
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

from hpcfl.errors import RunDirError
from hpcfl.files import atomic_write_text
from hpcfl.report.methods import Cell
from hpcfl.report.protocol import VALIDATION, Protocol, last_k_mean, mean_std
from hpcfl.report.protocol import fmt_mean_std as _fmt
from hpcfl.report.summary import RunSummary, summarise
from hpcfl.report.targets import default_target
from hpcfl.runner.rundir import DONE
from hpcfl.sweep.grid import SEED, Axis
from hpcfl.sweep.plan import Sweep
from hpcfl.sweep.select import choose

CLIENT_P10 = "client_acc_p10"  # the worst-10 % client accuracy (client_eval), shown beside test accuracy
CLIENT_MEAN = "client_acc_mean"  # the global model's per-client mean (client_eval)
FINETUNE_MEAN = "finetune_acc_mean"  # the global model fine-tuned per client (finetune_eval)
PERSONAL_MEAN, PERSONAL_P10 = "personal_acc_mean", "personal_acc_p10"  # each client's own model (issue 41)
#: What a personalised method's search is chosen by: its clients' own models on their own validation
#: shares (logged with ``client_eval`` and ``validation``); the server model's ``val_accuracy`` is the
#: shared body with the initial head (FedPer, FedRep) or FedAvg's w (Ditto, APFL), not what is deployed.
PERSONAL_VAL = "personal_val_acc_mean"


def search_metric(runs: list[RunSummary]) -> str:
    """The validation figure a group of runs is chosen by: :data:`PERSONAL_VAL` where they log it
    (a personalised method), else ``val_accuracy``."""
    return PERSONAL_VAL if any(PERSONAL_VAL in row for r in runs for row in r.rows) else VALIDATION


def _show(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


def layout(sweep: Sweep) -> tuple[str | None, list[Axis], list[Axis]]:
    """(the row axis, the algorithm-scoped axes shown beside it, the column axes)."""
    search = (sweep.search or {}).get("key")
    free = [a for a in sweep.axes if a.key not in (SEED, search)]
    scoped = [a for a in free if a.algorithm is not None]
    plain = [a for a in free if a.algorithm is None]
    row = "algorithm" if any(a.key == "algorithm" for a in plain) else (plain[0].key if plain else None)
    return row, scoped, [a for a in plain if a.key != row]


def _labels(values: dict[str, Any], row: str | None, scoped: list[Axis], cols: list[Axis]) -> tuple[str, str]:
    label = _show(values[row]) if row is not None else "run"
    extra = [f"{a.key.partition('.')[2]}={_show(values[a.key])}" for a in scoped if a.key in values]
    if extra:
        label += f" ({', '.join(extra)})"
    column = ", ".join(_show(values[a.key]) for a in cols) or "all"
    return label, column


def collect(sweep: Sweep, protocol: Protocol | None = None) -> tuple[list[Cell], int]:
    """The table's cells in grid order, and how many points are not finished (left out). With a
    search, each cell keeps the value whose seeds have the best mean last-k validation figure
    (:func:`search_metric`)."""
    k = (protocol or Protocol()).last_k
    row, scoped, cols = layout(sweep)
    search = (sweep.search or {}).get("key")
    search_values = next((a.values for a in sweep.axes if a.key == search), ())
    groups: dict[tuple[str, str], dict[int, list[RunSummary]]] = {}
    missing = 0
    for point in sweep.points:
        key = _labels(point.values, row, scoped, cols)
        by_value = groups.setdefault(key, {})
        if not (point.run_dir / DONE).exists():
            missing += 1
            continue
        index = search_values.index(point.values[search]) if search else 0
        by_value.setdefault(index, []).append(summarise(point.run_dir))
    cells = []
    for (label, column), by_value in groups.items():
        cell = Cell(label, column)
        if search:
            metric = search_metric([r for runs in by_value.values() for r in runs])
            vals = {i: [last_k_mean(r.rows, k, metric) for r in runs] for i, runs in by_value.items()}
            cell.choice = choose(search_values, vals)
            if cell.choice is not None:
                cell.runs = by_value[search_values.index(cell.choice.value)]
        else:
            cell.runs = by_value.get(0, [])
        cells.append(cell)
    return cells, missing


def _grid(cells: list[Cell], value: Any) -> list[str]:
    """A markdown table: rows × columns, each cell ``value(cell)``."""
    rows = list(dict.fromkeys(c.row for c in cells))
    cols = list(dict.fromkeys(c.column for c in cells))
    at = {(c.row, c.column): c for c in cells}
    lines = ["| method | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for r in rows:
        lines.append(f"| {r} | " + " | ".join(value(at[(r, c)]) if (r, c) in at else "" for c in cols) + " |")
    return lines


def _rounds(cell: Cell, target: float, window: int, mb: bool = False) -> str:
    if not cell.runs:
        return "—"
    reached = cell.reached(target, window)
    if not reached:
        return "not reached"
    if mb:
        text = _fmt([b for _, b in reached], scale=1e-6, digits=1)
    else:
        text = _fmt([float(r) for r, _ in reached], scale=1.0, digits=1)
    return text + (f" ({len(reached)}/{cell.n})" if len(reached) != cell.n else "")


def protocol_markdown(
    cells: list[Cell], protocol: Protocol, target: float, *, search: str | None = None
) -> list[str]:
    """The tables (markdown lines): last-k mean test accuracy (the headline), rounds and MB to
    ``target`` on the running mean, final and best single-round accuracy, the form each method ran
    in (where its runs record one) and, with ``search`` (the searched key), the chosen values."""
    k, w, pct = protocol.last_k, protocol.window, f"{100 * target:g}%"
    rows = [r.rows for c in cells for r in c.runs]
    shown = protocol.label(rows)  # the K really averaged: fewer where the runs have fewer rounds
    md = [
        f"Last-{shown} test accuracy (%): each seed's mean over its last {shown} evaluated rounds, then "
        "mean ± std over seeds:",
        "",
        *_grid(cells, lambda c: _fmt(c.last_k(k))),
        "",
        f"Rounds to {pct} test accuracy on the running mean of {w} evaluated rounds ((r/n): only r of n "
        "seeds reached it):",
        "",
        *_grid(cells, lambda c: _rounds(c, target, w)),
        "",
        f"MB to {pct} (up + down, all participants; the seeds that reached it):",
        "",
        *_grid(cells, lambda c: _rounds(c, target, w, mb=True)),
        "",
        "Final test accuracy (%, one round; secondary):",
        "",
        *_grid(cells, lambda c: _fmt([r.final_accuracy for r in c.runs])),
        "",
        "Best test accuracy (%, one round; secondary):",
        "",
        *_grid(cells, lambda c: _fmt([r.best_accuracy for r in c.runs])),
    ]
    if any(c.last_k(k, CLIENT_P10) for c in cells):
        md += [
            "",
            f"Worst-10 % client accuracy (client_acc_p10, %: the mean accuracy of the worst 10 % of clients "
            f"on their held-out shares, each seed's mean over its last {protocol.label(rows, CLIENT_P10)} "
            "evaluated rounds, then mean ± std "
            "over seeds), beside the test accuracy:",
            "",
            *_grid(cells, lambda c: f"{_fmt(c.last_k(k, CLIENT_P10))} (test {_fmt(c.last_k(k))})"),
        ]
    if any(c.last_k(k, PERSONAL_MEAN) or c.last_k(k, FINETUNE_MEAN) for c in cells):
        md += [
            "",
            "Per-client accuracy, global and personalised side by side (%, each seed's last-"
            f"{k} mean, then mean ± std over seeds): the global model on each client's held-out "
            "share (client mean / p10), fine-tuned per client where the run did it (finetune_eval), "
            "and each client's own model where the method is personalised (personal mean / p10):",
            "",
            *_grid(
                cells,
                lambda c: " · ".join(
                    f"{name} {_fmt(c.last_k(k, key))}"
                    for name, key in (
                        ("global", CLIENT_MEAN),
                        ("p10", CLIENT_P10),
                        ("fine-tuned", FINETUNE_MEAN),
                        ("personal", PERSONAL_MEAN),
                        ("personal p10", PERSONAL_P10),
                    )
                    if c.last_k(k, key)
                ),
            ),
        ]
    if any(c.forms for c in cells):
        md += ["", "Form each method ran in (as its runs record it):", ""]
        md += _grid(cells, lambda c: ", ".join(c.forms) or "—")
    if search:
        md += [
            "",
            f"Chosen {search} (mean last-{protocol.label(rows, VALIDATION)} validation accuracy over "
            "seeds, %):",
            "",
        ]
        md += _grid(
            cells,
            lambda c: f"{_show(c.choice.value)} ({100 * c.choice.val_mean:.2f})" if c.choice else "—",
        )
    return md


def write_sweep_report(
    sweep: Sweep, out: Path, *, target: float | None = None, protocol: Protocol | None = None
) -> str:
    """report.md, summary.csv, curves.png (and selection.csv with a search) into ``out``; returns
    the markdown. ``target`` (a fraction) defaults to the level every finished run's running mean
    reaches."""
    protocol = protocol or Protocol()
    cells, missing = collect(sweep, protocol)
    runs = [r for c in cells for r in c.runs]
    if not runs:
        raise RunDirError(f"{sweep.sweep_dir}: no point has finished yet (hpcfl status {sweep.sweep_dir})")
    out.mkdir(parents=True, exist_ok=True)
    level = default_target(runs, window=protocol.window) if target is None else target
    seeds = sorted({c.n for c in cells})
    md = [
        f"# Sweep {sweep.name}",
        "",
        f"Mean ± sample standard deviation over seeds ({'/'.join(map(str, seeds))} finished seeds per cell)"
        + (f"; {missing} points not finished (failed or still to run) left out." if missing else "."),
        f"Protocol: {protocol.describe([r.rows for r in runs])}.",
    ]
    search = sweep.search["key"] if sweep.search else None
    if sweep.search:
        md.append(
            f"Each cell uses the {search} chosen by the mean validation accuracy of the last "
            f"{protocol.label([r.rows for r in runs], VALIDATION)} evaluated rounds (mean over seeds) on a "
            f"{100 * sweep.search['validation']:g}% split of the clients' training data (selection.csv; a "
            f"personalised method that logs {PERSONAL_VAL} is chosen by it: its clients' own models on their "
            "validation shares); the test set played no part in the choice."
        )
        atomic_write_text(out / "selection.csv", _selection_csv(cells, search, protocol.last_k))
    md += ["", *protocol_markdown(cells, protocol, level, search=search)]
    atomic_write_text(out / "summary.csv", summary_csv(cells, level, protocol))
    plot_bands(cells, out / "curves.png")
    md += ["", "Curves (mean ± std over seeds): curves.png; every number: summary.csv", ""]
    text = "\n".join(md)
    atomic_write_text(out / "report.md", text)
    return text


def summary_csv(cells: list[Cell], target: float, protocol: Protocol | None = None) -> str:
    """One line per cell: n, mean and std of the last-k mean, of final and best accuracy, and of
    rounds and bytes to target on the running mean; the form(s) and the chosen value."""
    protocol = protocol or Protocol()
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(
        ["method", "column", "n", "last_k", "last_k_mean", "last_k_std", "final_mean", "final_std",
         "best_mean", "best_std", "target", "window", "rounds_to_target_mean", "rounds_to_target_std",
         "bytes_to_target_mean", "bytes_to_target_std", "reached", "form", "chosen",
         "client_acc_p10_mean", "client_acc_p10_std", "finetune_acc_mean_mean", "finetune_acc_mean_std",
         "personal_acc_mean_mean", "personal_acc_mean_std", "personal_acc_p10_mean", "personal_acc_p10_std"]
    )  # fmt: skip
    for c in cells:
        last = mean_std(c.last_k(protocol.last_k))
        final = mean_std([r.final_accuracy for r in c.runs])
        best = mean_std([r.best_accuracy for r in c.runs])
        reached = c.reached(target, protocol.window)
        rounds = mean_std([float(r) for r, _ in reached])
        spent = mean_std([b for _, b in reached])
        chosen = _show(c.choice.value) if c.choice else ""
        writer.writerow(
            [c.row, c.column, c.n, protocol.last_k, *last, *final, *best, target, protocol.window,
             *rounds, *spent, len(reached), "/".join(c.forms), chosen,
             *mean_std(c.last_k(protocol.last_k, CLIENT_P10)),
             *mean_std(c.last_k(protocol.last_k, FINETUNE_MEAN)),
             *mean_std(c.last_k(protocol.last_k, PERSONAL_MEAN)),
             *mean_std(c.last_k(protocol.last_k, PERSONAL_P10))]
        )  # fmt: skip
    return buf.getvalue()


def _selection_csv(cells: list[Cell], key: str, k: int) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["method", "column", key, f"val_last{k}_mean", "chosen", "metric"])
    for c in cells:
        if c.choice is None:
            continue
        metric = search_metric(c.runs)
        for value, mean in c.choice.candidates.items():
            writer.writerow([c.row, c.column, value, mean, value == repr(c.choice.value), metric])
    return buf.getvalue()


def mean_curve(runs: list[RunSummary]) -> tuple[list[int], list[float], list[float]]:
    """Rounds logged by every run, with the mean and sample std of test accuracy there."""
    common = set.intersection(*({int(row["round"]) for row in r.rows} for r in runs))
    rounds = sorted(common)
    means, stds = [], []
    for rnd in rounds:
        accs = [next(float(row["test_accuracy"]) for row in r.rows if int(row["round"]) == rnd) for r in runs]
        mean, std = mean_std(accs)
        means.append(mean)
        stds.append(0.0 if math.isnan(std) else std)
    return rounds, means, stds


def plot_bands(cells: list[Cell], path: Path) -> Path:
    """One panel per column, one line per method: mean test accuracy with a ± std band."""
    from matplotlib.ticker import MaxNLocator

    from hpcfl.files import save_figure
    from hpcfl.report.plots import _pyplot

    plt = _pyplot()
    cols = list(dict.fromkeys(c.column for c in cells))
    rows = list(dict.fromkeys(c.row for c in cells))
    fig, axes = plt.subplots(1, len(cols), figsize=(4.6 * len(cols) + 0.6, 3.8), squeeze=False, sharey=True)
    for ax, col in zip(axes[0], cols, strict=True):
        if not any(c.runs for c in cells if c.column == col):  # a sweep stopped before these ran
            ax.text(0.5, 0.5, "no finished run yet", transform=ax.transAxes, ha="center", color="0.5")
        for i, cell in enumerate(c for c in cells if c.column == col):
            if not cell.runs:
                continue
            rounds, mean, std = mean_curve(cell.runs)
            colour = f"C{rows.index(cell.row) % 10}"
            lo = [100 * (m - s) for m, s in zip(mean, std, strict=True)]
            hi = [100 * (m + s) for m, s in zip(mean, std, strict=True)]
            ax.plot(
                rounds, [100 * m for m in mean], color=colour, label=f"{cell.row} (n={cell.n})", zorder=3 + i
            )
            ax.fill_between(rounds, lo, hi, color=colour, alpha=0.2, lw=0)
        ax.set_title(col, fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("communication round")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy (%), mean ± std over seeds")
    labelled: dict[str, Any] = {}  # every panel's lines: the last panel may have none
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            labelled.setdefault(label, handle)
    axes[0][-1].legend(list(labelled.values()), list(labelled), fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)
