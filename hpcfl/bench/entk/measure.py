"""Running one method of ``hpcfl bench entk``: in this process (:func:`run_here`) or in a fresh one
(:func:`run_child`, ``python -m hpcfl.bench.entk.worker SPEC``), both timed by
:func:`hpcfl.bench.entk.worker.worker`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(256 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
"""glibc allocator settings of ``--keep-freed-memory``."""


def run_here(spec: dict[str, Any]) -> dict[str, Any]:
    """:func:`worker` in this process (``--in-process``); a failure is a row, as from a child, and
    what the method held is freed before the next one."""
    import gc

    import torch

    from hpcfl.bench.entk.worker import worker  # here, not at the top: -m runs that module fresh

    try:
        return worker(spec)
    except Exception as err:  # noqa: BLE001 - a method failing is a result, not a crash
        note = f"{type(err).__module__}.{type(err).__name__}: {err}".splitlines()[0][:200]
        return {"method": spec["method"], "status": "failed", "note": note}
    finally:
        gc.collect()
        if spec["device"] == "cuda":
            torch.cuda.empty_cache()


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ)
    if spec["omp_wait_policy"] != "default":
        env["OMP_WAIT_POLICY"] = spec["omp_wait_policy"].upper()
    if spec["threads"]:
        env["OMP_NUM_THREADS"] = str(spec["threads"])
    if spec["keep_freed_memory"]:
        env.update(KEEP_FREED_MEMORY)
    proc = subprocess.run(
        [sys.executable, "-m", "hpcfl.bench.entk.worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"method": spec["method"], "status": "failed", "note": tail[:200]}


def time_method(spec: dict[str, Any], *, in_process: bool = False) -> dict[str, Any]:
    """One method timed as ``hpcfl bench entk`` times it → its result row (a failure is a row too):
    a warm-up, then ``spec["repeats"]`` timed runs (best and median), in a fresh process (its
    ``threads``, ``omp_wait_policy`` and ``keep_freed_memory`` environment) or, ``in_process``, here.
    ``spec`` holds :func:`hpcfl.bench.entk.run_benchmark`'s config keys (model, input_shape, p, batch,
    device, seed, repeats, loop_samples, threads, ...; optionally ``model_options``) and the ``method``."""
    return (run_here if in_process else run_child)(spec)
