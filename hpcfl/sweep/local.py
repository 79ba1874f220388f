"""Running grid points on this machine: one after another, or N at a time in worker processes.

:func:`run_point` is the one way hpcfl runs a point of a grid (``hpcfl sweep``, ``hpcfl compare``
and the benchmark scripts use it): a point whose run directory holds a finished run of the same
config is skipped, an unfinished one resumed (bit-identical to an uninterrupted run), and one that
fails with an hpcfl error (a diverging learning rate, say) is recorded in ``FAILED`` — one line —
instead of ending the grid. A point whose run directory another process holds (its run lock) is
``busy``: neither run nor marked, so ``DONE`` and ``FAILED`` never coexist — a point's markers are
written only by the process holding its lock, and writing one removes the other.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from hpcfl.config import Config, config_differences, config_from_dict, read_yaml
from hpcfl.errors import HpcflError, StoppedError
from hpcfl.files import atomic_write_text
from hpcfl.runner.rundir import DONE, FAILED, failure

WALL_SECONDS = "WALL_SECONDS"  # wall-clock seconds of the point's last (re)run


@dataclass(frozen=True)
class PointOutcome:
    """What :func:`run_point` did: ``status`` is cached, ran, resumed, stopped, busy (<holder>),
    failed: <error> or failed (cached): <error>; ``seconds`` the wall time of the run (NaN when
    unknown)."""

    status: str
    seconds: float

    @property
    def failed(self) -> bool:
        return self.status.startswith("failed")

    @property
    def stopped(self) -> bool:
        return self.status == "stopped"

    @property
    def busy(self) -> bool:
        """Another process holds the point (its run lock): it was left alone."""
        return self.status.startswith("busy")


def _busy(holder: tuple[str, int] | None) -> PointOutcome:
    who = f"host {holder[0]}, PID {holder[1]}" if holder else "another process"
    return PointOutcome(f"busy (run by {who})", float("nan"))


def same_config(run_dir: Path, cfg: Config) -> bool:
    """True when ``run_dir`` holds a run (finished or not) of ``cfg`` (resumable keys aside)."""
    saved = Path(run_dir) / "config.yaml"
    return saved.exists() and not config_differences(read_yaml(saved), cfg.to_dict())


def wall_seconds(run_dir: Path) -> float:
    """Wall seconds of the point: WALL_SECONDS, else the ``seconds=`` of DONE, else NaN."""
    path = Path(run_dir)
    try:
        return float((path / WALL_SECONDS).read_text())
    except (OSError, ValueError):
        pass
    try:
        for word in (path / DONE).read_text().split():
            if word.startswith("seconds="):
                return float(word.removeprefix("seconds="))
    except (OSError, ValueError):
        pass
    return float("nan")


def run_point(
    cfg: Config,
    run_dir: Path,
    *,
    retry_failed: bool = True,
    replace_other: bool = False,
    record_failures: bool = True,
    stop: Any = None,
) -> PointOutcome:
    """Run (or skip, or continue) one point in this process.

    ``retry_failed=False`` keeps a recorded failure of the same config (the benchmarks: a diverging
    baseline is a result); ``replace_other=True`` starts over a run directory holding another
    config (the benchmarks' cache), where a sweep refuses it while planning;
    ``record_failures=False`` lets an hpcfl error propagate (``hpcfl compare`` ends on it; a point
    another process holds too, where a sweep reports it ``busy``). ``stop``
    is the process's :class:`~hpcfl.runner.StopRequest`.
    """
    from hpcfl.runner import run_experiment
    from hpcfl.runner.lock import LockedError, lock_holder

    path = Path(run_dir)
    if record_failures and (holder := lock_holder(path)) is not None:  # before any marker is touched
        return _busy(holder)
    same = same_config(path, cfg)
    if same and (path / DONE).exists():
        return PointOutcome("cached", wall_seconds(path))
    if same and not retry_failed and (error := failure(path)) is not None:
        return PointOutcome(f"failed (cached): {error}", wall_seconds(path))
    status = "resumed" if same else "ran"
    t0 = time.perf_counter()
    (path / FAILED).unlink(missing_ok=True)
    try:
        result = run_experiment(
            cfg, path, resume=same or not replace_other, overwrite=replace_other and not same, stop=stop
        )
        if not result.finished:
            status = "stopped"
    except StoppedError:
        status = "stopped"
    except LockedError as err:  # taken by another process since the check above
        if not record_failures:
            raise
        return _busy(err.holder)
    except HpcflError as err:
        if not record_failures:
            raise
        status = f"failed: {err}"
        path.mkdir(parents=True, exist_ok=True)
        (path / DONE).unlink(missing_ok=True)
        atomic_write_text(path / FAILED, f"{err}\n")
    if path.is_dir():
        atomic_write_text(path / WALL_SECONDS, f"{time.perf_counter() - t0:.1f}\n")
    return PointOutcome(status, wall_seconds(path))


def _worker(cfg_dict: dict[str, Any], run_dir: str, retry_failed: bool, threads: int) -> PointOutcome:
    """A point in a worker process (spawned: a fresh interpreter, so imports happen here)."""
    import torch

    from hpcfl.runner import StopRequest

    cfg = config_from_dict(cfg_dict)
    if cfg.threads is None:  # N points share the cores
        torch.set_num_threads(threads)
    stop = StopRequest()
    stop.install()
    return run_point(cfg, Path(run_dir), retry_failed=retry_failed, stop=stop)


def run_points(
    points: list[tuple[str, Config, Path]],
    *,
    parallel: int = 1,
    retry_failed: bool = True,
    stop: Any = None,
    report: Callable[[str, PointOutcome], None] | None = None,
) -> dict[str, PointOutcome]:
    """Run ``(name, config, run dir)`` points in order, ``parallel`` at a time; returns each outcome.

    With ``parallel`` 1 they run in this process (progress bars as in ``hpcfl run``); otherwise in
    that many spawned worker processes, without progress bars, each with its share of the cores
    when the config leaves ``threads`` unset. After a stop request no further point starts.
    ``report(name, outcome)`` is called as each point ends.
    """
    outcomes: dict[str, PointOutcome] = {}

    def done(name: str, outcome: PointOutcome) -> None:
        outcomes[name] = outcome
        if report is not None:
            report(name, outcome)

    if parallel <= 1:
        for name, cfg, run_dir in points:
            if stop is not None and stop.requested:
                break
            done(name, run_point(cfg, run_dir, retry_failed=retry_failed, stop=stop))
            if outcomes[name].stopped:
                break
        return outcomes
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // parallel)
    pending = list(points)
    running: dict[Future[PointOutcome], str] = {}
    with ProcessPoolExecutor(max_workers=parallel, mp_context=get_context("spawn")) as pool:
        while pending or running:
            while pending and len(running) < parallel and not (stop is not None and stop.requested):
                name, cfg, run_dir = pending.pop(0)
                cfg_dict = {**cfg.to_dict(), "progress": False}
                running[pool.submit(_worker, cfg_dict, str(run_dir), retry_failed, threads)] = name
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                done(running.pop(future), future.result())
    return outcomes
