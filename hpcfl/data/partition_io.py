"""Partition files and pictures: ``partition.json``, the class-count table, and the heatmap PNG.

``partition.json`` is what a run reads back to train on exactly the same split; it is written to a
temp name and renamed, so a file under that name is always complete. One client per line keeps it
greppable: ``{"client": k, "size": n, "counts": [...], "indices": [...]}``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpcfl.errors import DataError
from hpcfl.files import atomic_write_text, save_figure

FORMAT = "hpcfl-partition"
VERSION = 1
_ANNOTATE_MAX_CELLS = 400  # beyond this the numbers no longer fit in the cells


@dataclass(frozen=True)
class SavedPartition:
    """A partition read back from ``partition.json``."""

    spec: str
    seed: int
    parts: list[torch.Tensor]  # sorted int64 indices per client
    counts: np.ndarray  # int64 (clients, classes)
    dataset: str | None = None


def _json_path(path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    return path / "partition.json" if path.is_dir() else path


def save_partition(
    path: str | os.PathLike[str],
    parts: Sequence[torch.Tensor],
    spec: str,
    seed: int,
    counts: np.ndarray,
    *,
    dataset: str | None = None,
) -> Path:
    """Write ``partition.json`` atomically (temp file + rename); returns its path.

    ``path`` is the file to write, or a directory to write ``partition.json`` into.
    """
    target = _json_path(path)
    counts = np.asarray(counts, dtype=np.int64)
    if counts.ndim != 2 or counts.shape[0] != len(parts):
        raise ValueError(f"counts must be (clients, classes) with {len(parts)} rows, got {counts.shape}")
    head: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "spec": spec,
        "seed": int(seed),
        "dataset": dataset,
        "num_clients": len(parts),
        "num_classes": int(counts.shape[1]),
        "num_samples": int(sum(int(p.numel()) for p in parts)),
    }
    lines = []
    for k, (part, row) in enumerate(zip(parts, counts, strict=True)):
        client = {"client": k, "size": int(part.numel()), "counts": row.tolist(), "indices": part.tolist()}
        lines.append("  " + json.dumps(client, separators=(",", ":")))
    text = json.dumps(head)[:-1] + ',\n "clients": [\n' + ",\n".join(lines) + "\n ]}\n"
    atomic_write_text(target, text)
    return target


def load_partition(path: str | os.PathLike[str]) -> SavedPartition:
    """Read a ``partition.json`` (or the one in a directory); malformed → DataError."""
    source = _json_path(path)
    fix = "regenerate it with `hpcfl partition`"
    try:
        doc = json.loads(source.read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"cannot read partition file {source} ({err}); {fix}") from err
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise DataError(f"{source} is not an hpcfl partition file (format {FORMAT!r} v{VERSION}); {fix}")
    try:
        clients = doc["clients"]
        num_classes = int(doc["num_classes"])
        if len(clients) != int(doc["num_clients"]):
            raise ValueError(f"{len(clients)} clients listed, num_clients says {doc['num_clients']}")
        parts, rows = [], []
        for k, client in enumerate(clients):
            idx = np.asarray(client["indices"], dtype=np.int64).reshape(-1)
            row = np.asarray(client["counts"], dtype=np.int64)
            if int(client["client"]) != k or idx.size != int(client["size"]) or row.shape != (num_classes,):
                raise ValueError(f"client entry {k} is inconsistent")
            if int(row.sum()) != idx.size:
                raise ValueError(f"client {k}: counts sum to {int(row.sum())}, size is {idx.size}")
            parts.append(torch.from_numpy(idx))  # host: index bookkeeping
            rows.append(row)
        counts = np.stack(rows) if rows else np.zeros((0, num_classes), dtype=np.int64)
        return SavedPartition(
            spec=str(doc["spec"]),
            seed=int(doc["seed"]),
            parts=parts,
            counts=counts,
            dataset=doc.get("dataset"),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise DataError(f"{source} is malformed ({err}); {fix}") from err


def format_partition_table(counts: np.ndarray) -> str:
    """A plain-text table: one row per client, one column per class, the client's total last, and
    an ``all`` row with the class totals."""
    counts = np.asarray(counts, dtype=np.int64)
    k, c = counts.shape
    totals, col = counts.sum(axis=1), counts.sum(axis=0)
    cell = max(len(str(v)) for v in [c - 1, 0, *col.tolist()])  # a class total bounds its cells
    total = max(len("total"), len(str(int(totals.sum()))))
    label = max(len("client"), len(str(k - 1)))

    def line(name: object, cells: Sequence[object], last: object) -> str:
        return f"{name!s:>{label}} " + " ".join(f"{v!s:>{cell}}" for v in cells) + f" {last!s:>{total}}"

    rows = [line(i, counts[i].tolist(), int(totals[i])) for i in range(k)]
    return "\n".join([line("client", range(c), "total"), *rows, line("all", col.tolist(), int(totals.sum()))])


def plot_partition_heatmap(
    counts: np.ndarray, path: str | os.PathLike[str], *, title: str | None = None
) -> Path:
    """Save a clients × classes heatmap of ``counts`` as PNG (atomically); cells are annotated
    with their counts when the grid is small enough to read them. Returns the path written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg: no display needed, no pyplot state
    from matplotlib.figure import Figure

    counts = np.asarray(counts, dtype=np.int64)
    k, c = counts.shape
    fig = Figure(
        figsize=(min(max(4.0, 0.45 * c + 2.0), 24.0), min(max(3.0, 0.3 * k + 1.5), 30.0)),
        layout="constrained",
    )
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(counts, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="samples")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    if c <= 40:
        ax.set_xticks(range(c))
    if k <= 50:
        ax.set_yticks(range(k))
    if k * c <= _ANNOTATE_MAX_CELLS and counts.size:
        threshold = counts.max() / 2
        for i in range(k):
            for j in range(c):
                color = "black" if counts[i, j] > threshold else "white"
                ax.text(j, i, str(counts[i, j]), ha="center", va="center", fontsize=7, color=color)
    ax.set_title(title or f"{k} clients x {c} classes")
    return save_figure(fig, Path(path), dpi=100, fmt="png")
