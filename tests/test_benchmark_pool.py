"""The benchmark scripts' worker pool (benchmarks/_runs.py) ends with the script that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.helpers import REPO, repo_env

_PARENT = """
import os, sys, time
sys.path.insert(0, "benchmarks")
from _runs import worker_pool
pool = worker_pool(1)
print(pool.submit(os.getpid).result(), flush=True)
pool.submit(time.sleep, 120)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_killed_benchmark_leaves_no_worker_behind() -> None:
    """SIGKILL the script (no handler of its can run): the kernel sends its worker SIGTERM."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT], cwd=REPO, env=repo_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        worker = int(parent.stdout.readline())
        assert _alive(worker)
        time.sleep(0.5)  # the worker is in its 120 s sleep
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker)
    finally:
        parent.kill()
        parent.wait()
