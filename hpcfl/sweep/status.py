"""``hpcfl status SWEEP_DIR``: every point's state (queued, running round r/R, done, failed with its
error line) from the run directories and, for a queued array, SLURM (one ``squeue`` call for the
whole sweep, and one ``sacct`` call for the jobs the queue no longer lists); and an ETA.

The ETA is the rounds still to run times the mean seconds per round measured so far, divided by
the number of points running now (at least one): rough while few rounds are done, and blind to a
queue that holds tasks back.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcfl.launch.status import SlurmView, slurm_views
from hpcfl.rows import read_metrics_rows
from hpcfl.runner.rundir import DONE, failure
from hpcfl.sweep.plan import Sweep, SweepPoint


@dataclass
class PointStatus:
    """One point's line of ``hpcfl status SWEEP_DIR`` (and its ``--json`` form)."""

    name: str
    state: str  # done | running | queued | stopped | not started | failed
    rounds_done: int
    rounds_total: int | None
    error: str | None = None
    job_id: str | None = None
    seconds_per_round: float | None = None

    def describe(self) -> str:
        total = self.rounds_total if self.rounds_total is not None else "?"
        if self.state in ("running", "stopped"):
            text = f"{self.state} round {self.rounds_done}/{total}"
        else:
            text = self.state
        if (
            self.error
        ):  # failed: the error; queued: SLURM's reason; ended early: the job's state; done: a stale FAILED
            text += f": {self.error}" if self.state == "failed" else f" ({self.error})"
        return text


def _progress(run_dir: Path) -> tuple[int, float | None]:
    """(rounds logged, mean seconds per logged round) of a point's metrics."""
    rows = read_metrics_rows(run_dir / "metrics.jsonl")
    if not rows:
        return 0, None
    seconds = [float(r["seconds"]) for r in rows if isinstance(r.get("seconds"), (int, float))]
    rounds = int(rows[-1].get("round", 0))
    per_round = sum(seconds) / rounds if seconds and rounds else None
    return rounds, per_round


def point_status(
    point: SweepPoint, rounds_total: int | None, views: dict[str, SlurmView] | None = None
) -> PointStatus:
    """Where one point stands: its files first, then the job that was submitted for it (``views``:
    SLURM's answers for the whole sweep, fetched once by :func:`sweep_status`)."""
    from hpcfl.runner.lock import lock_holder

    rounds, per_round = _progress(point.run_dir)
    status = PointStatus(point.name, "not started", rounds, rounds_total, seconds_per_round=per_round)
    if (point.run_dir / DONE).exists():
        status.state = "done"
        if (error := failure(point.run_dir)) is not None:  # both markers: say so, never count it twice
            status.error = f"a stale FAILED marker also says: {error}"
        return status
    if (point.run_dir / "slurm" / "jobs.jsonl").exists():
        from hpcfl.launch import run_status
        from hpcfl.launch.status import ACTIVE, PENDING_HINTS

        job = run_status(point.run_dir, views)
        status.job_id = job.job_id
        if job.failed:
            status.state, status.error = "failed", job.error or f"job {job.job_id} {job.state}"
        elif job.state in ("RUNNING", "COMPLETING"):
            status.state = "running"
        elif job.state in ACTIVE:
            status.state = "queued"
            if job.reason:
                hint = PENDING_HINTS.get(job.reason)
                status.error = f"{job.reason}: {hint}" if hint else job.reason
        else:  # the job is gone without finishing the run: a re-run of the sweep queues it again
            status.state = "stopped" if rounds else "not started"
            status.error = f"job {job.job_id} {job.state}; hpcfl sweep again to queue it"
        return status
    if lock_holder(point.run_dir) is not None:
        status.state = "running"
    elif (error := failure(point.run_dir)) is not None:
        status.state, status.error = "failed", error
    elif rounds:
        status.state = "stopped"
    return status


def sweep_status(sweep: Sweep) -> list[PointStatus]:
    """Every point's status, in the manifest's order. SLURM is asked once for all points' jobs."""
    from hpcfl.launch.records import read_job_records

    jobs = []
    for p in sweep.points:
        if not (p.run_dir / DONE).exists():
            records = read_job_records(p.run_dir)
            if records and records[-1].executor != "local":
                jobs.append(records[-1].job_id)
    views = slurm_views(jobs) if jobs else {}
    return [point_status(p, sweep.rounds.get(p.name), views) for p in sweep.points]


def eta_seconds(statuses: list[PointStatus]) -> float | None:
    """Seconds until every unfinished point is done (None before any round was timed)."""
    speeds = [s.seconds_per_round for s in statuses if s.seconds_per_round]
    left = sum(
        max((s.rounds_total or s.rounds_done) - s.rounds_done, 0)
        for s in statuses
        if s.state not in ("done", "failed")
    )
    if left == 0:
        return 0.0
    if not speeds:
        return None
    running = sum(s.state == "running" for s in statuses)
    return left * (sum(speeds) / len(speeds)) / max(1, running)


def _duration(seconds: float) -> str:
    seconds = int(math.ceil(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


def format_sweep_status(sweep: Sweep, statuses: list[PointStatus]) -> str:
    """The table ``hpcfl status SWEEP_DIR`` prints, with a count per state and the ETA."""
    width = max([len(s.name) for s in statuses] + [5])
    lines = [f"sweep    {sweep.sweep_dir}  ({sweep.name}, {len(statuses)} points)", ""]
    lines.append(f"{'point':<{width}}  {'job':>10}  state")
    for s in statuses:
        lines.append(f"{s.name:<{width}}  {s.job_id or '-':>10}  {s.describe()}")
    counts: dict[str, int] = {}
    for s in statuses:
        counts[s.state] = counts.get(s.state, 0) + 1
    summary = ", ".join(f"{n} {state}" for state, n in counts.items())
    eta = eta_seconds(statuses)
    when = "unknown (no round timed yet)" if eta is None else _duration(eta)
    lines += ["", f"{summary}; ETA {when}" if eta != 0.0 else f"{summary}; nothing left to run"]
    return "\n".join(lines)


def status_json(statuses: list[PointStatus]) -> str:
    """One JSON object per point, one a line."""
    return "\n".join(json.dumps(asdict(s)) for s in statuses)
