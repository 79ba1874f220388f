"""Plot per-layer CKA between each client's model and the global model (FedCKA paper, Figure 2).

    python benchmarks/fedcka_similarity.py runs/my_run            # or .../metrics.jsonl
    python benchmarks/fedcka_similarity.py runs/my_run --out cka.png

Reads the ``cka`` entries that a run with ``cka_metrics: true`` writes into ``metrics.jsonl``
(``{"cka": {layer: [value of client 0, 1, ...]}}``) and draws two panels: CKA vs round for every
layer (mean over clients, shaded min–max), and the last measured round per layer and client (the
bar chart of the paper's Figure 2). Writes the PNG (default: ``<run>/plots/cka_layers.png``) and a
CSV of the means next to it, and prints the last round's table.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The metrics rows of a run that carry per-layer CKA."""
    metrics = path / "metrics.jsonl" if path.is_dir() else path
    if not metrics.exists():
        raise SystemExit(f"no metrics file at {metrics}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "cka" in r]
    if not rows:
        raise SystemExit(f"{metrics} has no 'cka' entries: rerun with cka_metrics: true")
    return rows


def plot(rows: list[dict[str, Any]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(rows[0]["cka"])
    rounds = [r["round"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    cmap = plt.get_cmap("viridis")
    for i, layer in enumerate(layers):
        values = [r["cka"][layer] for r in rows]
        mean = [sum(v) / len(v) for v in values]
        color = cmap(i / max(len(layers) - 1, 1))
        ax1.plot(rounds, mean, marker="o", ms=3, color=color, label=layer)
        ax1.fill_between(rounds, [min(v) for v in values], [max(v) for v in values], color=color, alpha=0.15)
    ax1.set_xlabel("round")
    ax1.set_ylabel("linear CKA (client vs global)")
    ax1.set_ylim(0, 1.02)
    ax1.legend(fontsize=7, ncol=2)
    ax1.set_title("per-layer CKA vs round (mean, min–max over clients)")
    last = rows[-1]["cka"]
    clients = len(next(iter(last.values())))
    width = 0.8 / clients
    for k in range(clients):
        ax2.bar([j + k * width for j in range(len(layers))], [last[layer][k] for layer in layers], width)
    ax2.set_xticks([j + 0.4 - width / 2 for j in range(len(layers))], layers, rotation=30, fontsize=8)
    ax2.set_ylim(0, 1.02)
    ax2.set_title(f"round {rows[-1]['round']}: each client vs the global model")
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="run directory or metrics.jsonl")
    p.add_argument("--out", type=Path, help="PNG path (default: <run>/plots/cka_layers.png)")
    args = p.parse_args(argv)
    rows = read_rows(args.run)
    run_dir = args.run if args.run.is_dir() else args.run.parent
    out = args.out or run_dir / "plots" / "cka_layers.png"
    plot(rows, out, title=str(run_dir))
    layers = list(rows[0]["cka"])
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["round", *layers])
        for r in rows:
            writer.writerow([r["round"], *(sum(r["cka"][lay]) / len(r["cka"][lay]) for lay in layers)])
    print("| layer | mean CKA | min | max |\n|---|---|---|---|")
    for layer, values in rows[-1]["cka"].items():
        print(f"| {layer} | {sum(values) / len(values):.3f} | {min(values):.3f} | {max(values):.3f} |")
    print(f"wrote {out} and {out.with_suffix('.csv')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
