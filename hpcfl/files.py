"""Files a run produces, written atomically: a reader never sees a half-written file under its final name.

The one place for temp-file-then-rename writes (text, ``torch.save``, figures, streamed downloads)
and for JSON-lines files; everything else in hpcfl writes through these helpers.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch


def _atomic(path: Path, write: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Call ``write(fh)`` on a temp file beside ``path``, then rename it to ``path``.

    If ``write`` raises, the temp file is removed and ``path`` is left as it was.
    """
    _atomic(path, write)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file and a rename."""
    _atomic(path, lambda fh: fh.write(text.encode()))


def atomic_torch_save(path: Path, obj: Any) -> None:
    """``torch.save`` through a temp file and a rename."""
    _atomic(path, lambda fh: torch.save(obj, fh))


def save_figure(fig: Any, path: Path, *, dpi: int = 120, fmt: str | None = None) -> Path:
    """Save a matplotlib figure atomically and return ``path``.

    ``fmt`` defaults to the file's suffix, and to PNG for a name without one.

    A pyplot figure is closed afterwards so a loop of plots does not keep every figure alive; a
    bare ``Figure`` (no pyplot state) is left to the garbage collector.
    """
    path = Path(path)
    fmt = fmt or path.suffix.lstrip(".").lower() or "png"
    try:
        _atomic(path, lambda fh: fig.savefig(fh, format=fmt, dpi=dpi))
    finally:
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is not None:
            pyplot.close(fig)
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All complete rows of a JSON-lines file (a torn last line is ignored)."""
    if not Path(path).exists():
        return []
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace a JSON-lines file atomically."""
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """Append one row and flush it to disk."""
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
