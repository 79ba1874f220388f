"""Timing one method of ``hpcfl bench entk`` in this process: best and median of ``repeats`` runs
and the peak memory above the steady state (:func:`worker`). ``python -m hpcfl.bench.entk.worker
SPEC`` is the fresh process :func:`hpcfl.bench.entk.measure.run_child` starts: it prints the row."""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

from hpcfl.bench.entk.runners import make_runner


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Time one method in this (fresh) process → result row."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    row: dict[str, Any] = {"method": spec["method"], "threads": torch.get_num_threads()}
    try:
        run, samples, note, _ = make_runner(spec)
    except (ImportError, RuntimeError, NotImplementedError, ValueError, TypeError) as err:
        row.update(status="skipped", note=f"{type(err).__name__}: {err}".splitlines()[0][:200])
        return row
    cuda = spec["device"] == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    try:
        run()  # warm-up (plans, caches, lazy init)
        sync()
    except Exception as err:  # noqa: BLE001 - a third-party method failing is a result, not a crash
        row.update(status="failed", note=f"{type(err).__name__}: {err}".splitlines()[0][:200])
        return row
    if cuda:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    reset = _reset_peak()
    base_kb = _rss_kb("VmRSS")
    times = []
    for _ in range(spec["repeats"]):
        t0 = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t0)
    if cuda:
        peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak_mb = max(0, _rss_kb("VmHWM") - base_kb) / 1024
    best, median = min(times), statistics.median(times)
    row.update(
        status="ok",
        samples=samples,
        seconds_best=best,
        seconds_median=median,
        samples_per_s=samples / best,
        samples_per_s_median=samples / median,
        peak_mb=peak_mb,
        peak_method="cuda max_memory_allocated" if cuda else ("VmHWM reset" if reset else "VmHWM - RSS"),
        note=note,
    )
    return row


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.argv[1]))), flush=True)
