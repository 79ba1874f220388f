"""The rows of a run's ``metrics.jsonl`` and ``client_metrics.jsonl`` as their readers need them.

``hpcfl report`` and ``hpcfl status`` read run directories others may have written or edited. A
row hpcfl could not have written (``"round": "two"``, ``"test_accuracy": "high"``, ``NaN`` or
``Infinity`` where a count or an accuracy belongs, a key every row has missing, bytes that are no
UTF-8) is named on stderr with its file and line and skipped; the other rows are reported.
Light: no torch, so the commands that only read files stay fast.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hpcfl.files import read_jsonl

#: columns every metrics row has, with the finite numbers they hold (DESIGN.md, "Run directory")
_FINITE = ("test_accuracy", "seconds", "bytes_up", "bytes_down", "epsilon")
#: numeric columns that may hold NaN when hpcfl writes them (a client evaluation with no samples)
_NUMBERS = ("test_loss", "val_accuracy", "val_loss", "train_accuracy", "train_loss")
_NUMBER_PREFIXES = ("client_acc_",)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _round_problem(row: dict[str, Any]) -> str | None:
    if "round" not in row:
        return "it has no 'round'"
    rnd = row["round"]
    if isinstance(rnd, bool) or not isinstance(rnd, int) or rnd < 0:
        return f"'round' is {rnd!r}, not a round number"
    return None


def metrics_row_problem(row: dict[str, Any]) -> str | None:
    """Why ``row`` cannot be a ``metrics.jsonl`` row hpcfl wrote, or None when it can."""
    if (problem := _round_problem(row)) is not None:
        return problem
    if "test_accuracy" not in row:
        return "it has no 'test_accuracy'"
    for key in _FINITE:
        if key in row and not (_is_number(row[key]) and math.isfinite(row[key])):
            return f"{key!r} is {row[key]!r}, not a finite number"
    for key, value in row.items():
        if (key in _NUMBERS or key.startswith(_NUMBER_PREFIXES)) and not _is_number(value):
            return f"{key!r} is {value!r}, not a number"
    if "stage" in row and not isinstance(row["stage"], str):
        return f"'stage' is {row['stage']!r}, not a name"
    who = row.get("participants", [])
    if not isinstance(who, list) or not all(
        isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in who
    ):
        return f"'participants' is {who!r}, not a list of client ids"
    return None


def client_row_problem(row: dict[str, Any]) -> str | None:
    """Why ``row`` cannot be a ``client_metrics.jsonl`` row hpcfl wrote, or None when it can."""
    if (problem := _round_problem(row)) is not None:
        return problem
    clients = row.get("clients")
    if not isinstance(clients, dict) or not all(
        isinstance(v, dict) and _is_number(v.get("accuracy")) for v in clients.values()
    ):
        return "'clients' is not a table of per-client accuracies"
    return None


def read_metrics_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` hpcfl could have written; each other line is named and skipped."""
    return read_jsonl(path, check=metrics_row_problem)


def read_client_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``client_metrics.jsonl`` hpcfl could have written; each other line is named and skipped."""
    return read_jsonl(path, check=client_row_problem)
