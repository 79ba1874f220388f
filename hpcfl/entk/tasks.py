"""Running the per-layer gathers of a batch on all CPU cores.

PyTorch's CPU gathers (``index_select`` along a non-leading dimension) run on one thread, and the
small per-tile matrix products of the materialise conv path scale poorly across threads. So after the
batched backward, each layer's work is cut into independent tasks writing disjoint parts of the
output, and the calling thread plus ``workers - 1`` helper threads run them, each with intra-op
threading set to one (ATen releases the GIL inside every op). Measured on the 2-core dev box
(simplecnn, p = 1e5, 256 samples, medians of 15 interleaved batches): the gathers of a batch take
57 ms on one thread, 45 ms as one sequence of ops on 2 intra-op threads and 42 ms (best 36) as
tasks on 2 threads. The gain is bounded by memory bandwidth: the batch writes 100 MB of features.

While the tasks run, ``torch.get_num_threads()`` is 1 process-wide (restored afterwards), so other
threads of the process running torch ops at the same moment run them single-threaded.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from hpcfl.entk.layers import Task

PIECES_PER_THREAD = 4
"""A layer's big parts are cut into this many pieces per worker, for load balance."""

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool(helpers: int) -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers != helpers:
            if _POOL is not None:
                _POOL.shutdown(wait=True)
            _POOL = ThreadPoolExecutor(max_workers=helpers, thread_name_prefix="hpcfl-entk")
        return _POOL


def run_tasks(tasks: list[Task], workers: int) -> None:
    """Run every task on ``workers`` threads (the caller's included), one intra-op thread each.

    Tasks are taken from one shared queue in order, so put the big ones first. Raises the first
    task's exception after all tasks have finished.
    """
    queue = iter(tasks)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def drain() -> None:
        while True:
            with lock:
                task = next(queue, None)
            if task is None:
                return
            try:
                task()
            except BaseException as err:  # reported to the caller below
                errors.append(err)

    if workers <= 1 or len(tasks) <= 1:
        drain()
    else:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            helpers: list[Future] = [_pool(workers - 1).submit(drain) for _ in range(workers - 1)]
            drain()
            for helper in helpers:
                helper.result()
        finally:
            torch.set_num_threads(threads)
    if errors:
        raise errors[0]
