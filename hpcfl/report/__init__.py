"""Turn run directories into what a person reads: tables and figures.

- :mod:`hpcfl.report.protocol`: the comparison protocol (last-k mean, running-mean rounds to target);
- :mod:`hpcfl.report.methods`: the headline table, one line per method, mean ± std over seeds;
- :mod:`hpcfl.report.summary`: one line per run (final and best accuracy, participation, time);
- :mod:`hpcfl.report.targets`: rounds and bytes to a target accuracy with the speed-up over FedAvg;
- :mod:`hpcfl.report.plots`: accuracy curves, drift-diversity heatmaps, conformal coverage curves,
  the clients' accuracy distribution.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from hpcfl.files import atomic_write_text
from hpcfl.report.methods import group_methods, method_csv, method_markdown
from hpcfl.report.plots import (
    client_runs,
    conformal_points,
    conformal_runs,
    drift_runs,
    plot_accuracy,
    plot_clients,
    plot_conformal,
    plot_drift,
)
from hpcfl.report.protocol import Protocol
from hpcfl.report.summary import RunSummary, csv_table, markdown_table, summarise
from hpcfl.report.targets import default_target, target_csv, target_markdown, target_rows

__all__ = ["Protocol", "RunSummary", "markdown_table", "summarise", "write_report"]


def write_report(
    run_dirs: list[Path], out: Path, *, target: float | None = None, protocol: Protocol | None = None
) -> list[RunSummary]:
    """Into ``out``: report.md (per method: last-k mean ± std over seeds and rounds/MB to ``target``
    on the running mean; then per run: final results, rounds/bytes to target, conformal table),
    methods.csv, report.csv, targets.csv, accuracy.png; drift_diversity.png, conformal.{png,csv} and
    clients.{png,csv} (per-client accuracy, ``client_eval``) when the runs recorded them. ``target`` (a fraction) defaults to the level every run's running
    mean reaches."""
    protocol = protocol or Protocol()
    runs = [summarise(d) for d in run_dirs]
    out.mkdir(parents=True, exist_ok=True)
    level = default_target(runs, window=protocol.window) if target is None else target
    rows = target_rows(runs, level, window=protocol.window)
    methods = group_methods(runs)
    md = [
        method_markdown(methods, protocol, level),
        "Per run (single rounds):\n",
        markdown_table(runs),
        target_markdown(rows, level, window=protocol.window),
    ]
    atomic_write_text(out / "methods.csv", method_csv(methods, protocol, level))
    atomic_write_text(out / "report.csv", csv_table(runs))
    atomic_write_text(out / "targets.csv", target_csv(rows, level, window=protocol.window))
    plot_accuracy(runs, out / "accuracy.png")
    if drifting := drift_runs(runs):
        plot_drift(drifting, out / "drift_diversity.png")
        md.append("Drift diversity per layer and round: drift_diversity.png\n")
    if evaluated := client_runs(runs):
        plot_clients([(m.row, [r for r in m.runs if r in evaluated]) for m in methods], out / "clients.png")
        atomic_write_text(out / "clients.csv", _clients_csv(evaluated))
        md.append(_clients_markdown(evaluated))
    if covering := conformal_runs(runs):
        plot_conformal(covering, out / "conformal.png")
        atomic_write_text(out / "conformal.csv", _conformal_csv(covering))
        md.append(_conformal_markdown(covering))
    atomic_write_text(out / "report.md", "\n".join(md))
    return runs


def _conformal_markdown(runs: list[RunSummary]) -> str:
    lines = [
        "Split-conformal sets of the final model: empirical coverage / mean set size (conformal.png).",
        "",
        "| run | top-1 | LAC 90% | LAC 95% | LAC 99% | APS 90% | APS 95% | APS 99% |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        cells = [f"{100 * cov:.1f}% / {size:.2f}" for _, _, size, cov in conformal_points(r)]
        lines.append(f"| {r.name} | {100 * r.final_accuracy:.1f}% | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _conformal_csv(runs: list[RunSummary]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["run", "method", "target_coverage", "mean_set_size", "coverage"])
    for r in runs:
        for method, level, size, cov in conformal_points(r):
            writer.writerow([r.name, method, level, size, cov])
    return buf.getvalue()


_CLIENT_COLUMNS = ("client_acc_mean", "client_acc_p10", "client_acc_p90", "client_acc_min", "client_acc_std")
_FINETUNE_COLUMNS = ("finetune_acc_mean", "finetune_acc_p10", "finetune_acc_p90")
#: a personalised algorithm's figure: each client's own model on its held-out share (issue 41)
_PERSONAL_COLUMNS = ("personal_acc_mean", "personal_acc_p10", "personal_acc_p90")


def _final(run: RunSummary, key: str) -> float | None:
    """``key`` of the last row that carries it (fine-tuning may run at the last round only)."""
    return next((float(row[key]) for row in reversed(run.rows) if key in row), None)


def _clients_markdown(runs: list[RunSummary]) -> str:
    lines = [
        "Per-client accuracy of the global model at the final evaluated round (clients.png; every "
        "client counts once: p10 / p90 are the mean accuracy of the worst / best 10 % of clients), "
        "after local fine-tuning where the run did it (finetune_eval), and each client's own model "
        "where the algorithm is personalised (FedBN, FedPer, FedRep, FedBABU, Ditto, APFL):",
        "",
        "| run | test acc. | clients | client mean | p10 | p90 | min | std | fine-tuned mean | fine-tuned p10 "
        "| fine-tuned p90 | personal mean | personal p10 | personal p90 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    unaccounted = False
    for r in runs:
        cells = [_pct(_final(r, k)) for k in (*_CLIENT_COLUMNS, *_FINETUNE_COLUMNS, *_PERSONAL_COLUMNS)]
        if any(row.get("personal_private") is False for row in r.rows):  # built outside the accountant
            cells[-3:] = [c if c == "—" else f"{c} (non-private)" for c in cells[-3:]]
            unaccounted = True
        n = _final(r, "client_eval_clients")
        lines.append(
            f"| {r.name} | {100 * r.final_accuracy:.2f}% | {int(n) if n is not None else '—'} | "
            + " | ".join(cells)
            + " |"
        )
    if unaccounted:
        lines += [
            "",
            "non-private: a personal model built at evaluation time under DP is outside the accountant; "
            "its figures are not covered by the run's ε.",
        ]
    return "\n".join(lines) + "\n"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.2f}%"


def _clients_csv(runs: list[RunSummary]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    columns = (*_CLIENT_COLUMNS, *_FINETUNE_COLUMNS, *_PERSONAL_COLUMNS)
    writer.writerow(["run", "method", "round", "test_accuracy", *columns])
    for r in runs:
        values = [_final(r, k) for k in columns]
        writer.writerow(
            [r.name, r.label, r.rounds, r.final_accuracy, *["" if v is None else v for v in values]]
        )
    return buf.getvalue()
