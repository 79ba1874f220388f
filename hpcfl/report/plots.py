"""The report's figures: accuracy per round, drift diversity as a heatmap, conformal coverage, the
clients' accuracy distribution (``client_eval``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hpcfl.files import save_figure
from hpcfl.metrics.conformal_spec import ALPHAS, METHODS
from hpcfl.report.summary import RunSummary


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_LINES = ("-", "--", "-.", ":")


def plot_accuracy(
    runs: list[RunSummary], path: Path, *, title: str = "test accuracy vs communication round"
) -> Path:
    """One curve per run; TCT's stage boundary is marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    draw_accuracy(ax, runs)
    ax.set_xlabel("communication round")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


def draw_accuracy(ax: Any, runs: list[RunSummary]) -> list[Any]:
    """One curve per run on ``ax`` (returned in run order), each with its own marker and line style;
    a run drawn earlier is wider, with larger hollow markers, under the later ones, so curves that
    coincide stay visible (TCT's stage 1 is FedAvg: it retraces FedAvg's curve of the same seed)."""
    lines = []
    n = len(runs)
    for i, r in enumerate(runs):
        under = (n - 1 - i) / max(n - 1, 1)  # 1 for the first run drawn, 0 for the last
        (line,) = ax.plot(
            [row["round"] for row in r.rows],
            [100 * row["test_accuracy"] for row in r.rows],
            marker=_MARKERS[i % len(_MARKERS)],
            ls=_LINES[i % len(_LINES)],
            lw=1.2 + 2.4 * under,
            ms=3.5 + 4.5 * under,
            mfc="none" if i < n - 1 else None,
            alpha=0.85,
            zorder=2 + i,
            label=r.name,
        )
        lines.append(line)
        stage2 = [row["round"] for row in r.rows if row.get("stage") == "stage2"]
        if stage2:
            ax.axvline(stage2[0] - 0.5, color="grey", ls=":", lw=1)
    return lines


def drift_runs(runs: list[RunSummary]) -> list[RunSummary]:
    """The runs whose rows carry per-layer drift diversity (``drift_diversity: true``)."""
    return [r for r in runs if any("drift_diversity" in row for row in r.rows)]


def plot_drift(runs: list[RunSummary], path: Path) -> Path:
    """FedPVR Figure 2's form: per run, log10 ξ as a heatmap of layers (rows, input to output) ×
    logged rounds (columns), on one shared colour scale."""
    import numpy as np

    plt = _pyplot()
    tables = []
    for r in runs:
        rows = [row for row in r.rows if "drift_diversity" in row]
        layers = list(rows[0]["drift_diversity"])
        grid = np.array([[row["drift_diversity"].get(layer, math.nan) for row in rows] for layer in layers])
        tables.append((r, layers, [row["round"] for row in rows], np.log10(np.maximum(grid, 1e-12))))
    lo = min(float(np.nanmin(t[3])) for t in tables)
    hi = max(float(np.nanmax(t[3])) for t in tables)
    fig, axes = plt.subplots(1, len(tables), figsize=(4.2 * len(tables) + 1, 3.8), squeeze=False)
    image = None
    for ax, (r, layers, rounds, grid) in zip(axes[0], tables, strict=True):
        image = ax.imshow(grid, aspect="auto", origin="lower", vmin=lo, vmax=hi, cmap="viridis")
        ax.set_title(r.name, fontsize=9)
        ax.set_xlabel("communication round")
        ax.set_xticks(range(0, len(rounds), max(1, len(rounds) // 6)))
        ax.set_xticklabels([str(rounds[i]) for i in range(0, len(rounds), max(1, len(rounds) // 6))])
        ax.set_yticks(range(len(layers)))
        same_rows = ax is not axes[0][0] and layers == tables[0][1]  # one label column serves all
        ax.set_yticklabels([] if same_rows else layers, fontsize=7)
    axes[0][0].set_ylabel("layer (input → output)")
    fig.colorbar(image, ax=axes[0].tolist(), label="log10 drift diversity ξ")
    return save_figure(fig, path, dpi=120)


def conformal_runs(runs: list[RunSummary]) -> list[RunSummary]:
    """The runs whose last row carries conformal coverage (``conformal: true``)."""
    return [r for r in runs if "lac_coverage_90" in r.rows[-1]]


def conformal_points(run: RunSummary) -> list[tuple[str, float, float, float]]:
    """(method, 1 − α, mean set size, empirical coverage) of the run's final model."""
    last = run.rows[-1]
    out = []
    for method in METHODS:
        for alpha in ALPHAS:
            pct = f"{100 * (1 - alpha):g}"
            if f"{method}_coverage_{pct}" in last:
                out.append(
                    (method, 1 - alpha, last[f"{method}_set_size_{pct}"], last[f"{method}_coverage_{pct}"])
                )
    return out


def plot_conformal(runs: list[RunSummary], path: Path) -> Path:
    """FedPVR Figure 3's form: empirical coverage against mean set size of the final model, one
    curve per run and method (points at 1 − α = 0.9, 0.95, 0.99), top-1 accuracy as a set of size 1."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, r in enumerate(runs):
        colour = f"C{i % 10}"
        pts = conformal_points(r)
        for method, marker, style in (("lac", "o", "-"), ("aps", "s", "--")):
            mine = [(size, cov) for m, _, size, cov in pts if m == method]
            if mine:
                ax.plot(
                    [1.0] + [s for s, _ in mine],
                    [100 * r.final_accuracy] + [100 * c for _, c in mine],
                    style,
                    marker=marker,
                    ms=4,
                    color=colour,
                    label=f"{r.name} {method.upper()}",
                )
    for alpha in ALPHAS:
        ax.axhline(100 * (1 - alpha), color="grey", lw=0.6, ls=":")
    ax.set_xlabel("mean prediction-set size (1 = top-1 prediction)")
    ax.set_ylabel("empirical coverage (%)")
    ax.set_title("split-conformal sets of the final model (targets 90/95/99%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)


def client_runs(runs: list[RunSummary]) -> list[RunSummary]:
    """The runs that evaluated the global model per client (``client_eval``)."""
    return [r for r in runs if "client_acc_mean" in r.rows[-1]]


def plot_clients(methods: list[tuple[str, list[RunSummary]]], path: Path) -> Path:
    """Left: per method, the final round's per-client accuracies of all its seeds as a violin with
    the quartile box (from ``client_metrics.jsonl``); right: per run, the clients' mean accuracy per
    round (line) between their worst-10 % and best-10 % means (band, ``client_acc_p10/p90``)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    labels, spreads = [], []
    for label, runs in methods:
        accs = [100 * v["accuracy"] for r in runs for v in (r.final_clients or {}).values()]
        if accs:
            labels.append(label)
            spreads.append(accs)
    if spreads:
        left.violinplot(spreads, showextrema=False)
        left.boxplot(spreads, widths=0.15, showfliers=False)
        left.set_xticks(range(1, len(labels) + 1), labels, rotation=20, fontsize=8)
    left.set_ylabel("client accuracy at the final round (%)")
    left.set_title("accuracy of the global model per client")
    left.grid(alpha=0.3)
    i = 0
    for _, runs in methods:
        for r in runs:
            rows = [row for row in r.rows if "client_acc_mean" in row]
            rounds = [row["round"] for row in rows]
            colour = f"C{i % 10}"
            right.plot(rounds, [100 * row["client_acc_mean"] for row in rows], color=colour, label=r.name)
            right.fill_between(
                rounds,
                [100 * row["client_acc_p10"] for row in rows],
                [100 * row["client_acc_p90"] for row in rows],
                color=colour,
                alpha=0.2,
                lw=0,
            )
            i += 1
    right.set_xlabel("communication round")
    right.set_ylabel("client accuracy (%): mean, p10–p90 band")
    right.set_title("clients' accuracy: worst 10 %, mean, best 10 %")
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)
