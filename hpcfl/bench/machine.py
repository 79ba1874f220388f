"""The machine a benchmark figure was measured on, recorded beside the figure.

A throughput ratio measured on an AVX-512 EPYC and one measured on an AVX2 Xeon are different
facts (issue 66: the fused eNTK extractor went from 0.77x to 0.56x plain training when the project
moved machines, with no code change). So every JSON a benchmark writes carries a ``machine`` record
and every CSV row the same few columns: the CPU's model (and family/model/stepping, since virtual
machines often report only "AMD EPYC"), its vector extensions, the cores this process may use,
torch's version, the CPU kernels torch dispatches to and the thread count the figure used.

Use :func:`with_machine` on a JSON payload, :func:`with_machine_columns` on CSV rows (dicts) and
:func:`csv_with_machine` on a CSV document already written as text.
"""

from __future__ import annotations

import csv
import io
import os
import platform
from pathlib import Path
from typing import Any

from hpcfl.cpuinfo import VECTOR_EXTENSIONS as VECTOR_EXTENSIONS
from hpcfl.cpuinfo import cpu_model, vector_extensions


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def machine_record(threads: int | None = None) -> dict[str, Any]:
    """What a benchmark's JSON records about the machine.

    ``threads`` is the intra-op thread count the measured work ran with; left out, this process's
    ``torch.get_num_threads()`` (a benchmark whose workers set their own count passes it).
    """
    import torch

    record: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cpu_vector_extensions": vector_extensions(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": usable_cores(),
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "threads": int(threads if threads is not None else torch.get_num_threads()),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        if torch.cuda.is_available():
            record["cuda_device"] = torch.cuda.get_device_name(0)
    except (AssertionError, RuntimeError):  # a CPU build, or a driver that does not answer
        pass
    return record


def machine_columns(threads: int | None = None) -> dict[str, Any]:
    """The :func:`machine_record` fields a CSV row carries (flat: lists joined by spaces)."""
    record = machine_record(threads)
    return {
        "cpu_model": record["cpu_model"],
        "cpu_vector_extensions": " ".join(record["cpu_vector_extensions"]),
        "cores": record["cores"],
        "torch": record["torch"],
        "threads": record["threads"],
    }


def with_machine(payload: dict[str, Any], threads: int | None = None) -> dict[str, Any]:
    """``payload`` with a ``machine`` key (:func:`machine_record`) added, unless it has one."""
    if "machine" in payload:
        return payload
    return {**payload, "machine": machine_record(threads)}


def with_machine_columns(rows: list[dict[str, Any]], threads: int | None = None) -> list[dict[str, Any]]:
    """Each CSV row with :func:`machine_columns` added (a row's own fields win on a clash)."""
    columns = machine_columns(threads)
    return [{**row, **{k: v for k, v in columns.items() if k not in row}} for row in rows]


def csv_with_machine(text: str, threads: int | None = None) -> str:
    """A CSV document (header first) with :func:`machine_columns` appended to every row."""
    table = list(csv.reader(io.StringIO(text)))
    if not table:
        return text
    columns = machine_columns(threads)
    extra = [k for k in columns if k not in table[0]]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*table[0], *extra])
    for row in table[1:]:
        writer.writerow([*row, *(columns[k] for k in extra)])
    return out.getvalue()


def stamp_csv(path: Path, threads: int | None = None) -> None:
    """Rewrite the CSV file at ``path`` with :func:`machine_columns` appended to every row.

    For writers that emit rows one at a time (``csv.writer``); rows built as dicts take
    :func:`with_machine_columns` before they are written instead.
    """
    from hpcfl.files import atomic_write_text

    atomic_write_text(path, csv_with_machine(path.read_text(), threads))
