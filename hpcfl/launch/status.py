"""``hpcfl status RUN_DIR``: where a submitted run stands, from the run directory alone.

Sources, each optional: the newest record of ``RUN_DIR/slurm/jobs.jsonl`` (written by ``hpcfl
submit``), SLURM's view of that job (``squeue``/``scontrol`` while slurmctld remembers it, then
``sacct`` where the cluster keeps accounting), the run's own files (``metrics.jsonl``,
``config.yaml``, ``DONE``) and, for a failed job, the error rank 0 recorded as JSON. A pending job
gets SLURM's reason with what it means; a failed one its one-line cause and the log to read.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hpcfl.errors import RunDirError

#: SLURM states after which the job will not run again.
FINAL_BAD = frozenset(
    {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
)

#: What a pending reason means for the user (SLURM's names; the rest are shown as they are).
PENDING_HINTS = {
    "Resources": "waiting for free nodes",
    "Priority": "other jobs go first",
    "BeginTime": "its start time has not come (a requeued job waits a few seconds)",
    "Dependency": "waiting for another job",
    "JobArrayTaskLimit": "waiting for a free slot of the array (its --array-parallelism)",
    "PartitionConfig": "the partition can never run this request: change --partition, --nodes or --time",
    "PartitionNodeLimit": "more nodes than the partition allows: lower --nodes or change --partition",
    "PartitionTimeLimit": "longer than the partition allows: lower --time or change --partition",
    "ReqNodeNotAvail": "the requested nodes are down or reserved",
    "QOSMaxJobsPerUserLimit": "you have as many jobs running as your QOS allows",
    "JobHeldUser": "held: release it with scontrol release JOBID",
    "JobHeldAdmin": "held by an administrator",
}


@dataclass
class RunStatus:
    """Everything ``hpcfl status`` prints about one run (also its ``--json`` form)."""

    run_dir: str
    job_id: str | None = None
    executor: str | None = None
    ranks: int | None = None
    nodes: int | None = None
    partition: str | None = None
    submissions: int = 0
    state: str = "NOT SUBMITTED"
    reason: str | None = None
    node_list: str | None = None
    elapsed: str | None = None
    restarts: int | None = None
    rounds_done: int = 0
    rounds_total: int | None = None
    test_accuracy: float | None = None
    personal_accuracy: float | None = None  # a personalised run's personal_acc_mean (client_eval)
    finished: bool = False
    budget_stop: bool = False  # finished because the next round would exceed the privacy budget
    error: str | None = None
    log: str | None = None

    @property
    def failed(self) -> bool:
        """True when the job ended without finishing the run."""
        return self.state in FINAL_BAD or (self.error is not None and not self.finished)


def _run(argv: list[str], timeout: float = 20.0) -> str | None:
    """stdout of a SLURM command, or None when it is missing or fails."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


@dataclass(frozen=True)
class SlurmView:
    """SLURM's view of one job: its state and, while queued or running, reason, nodes and elapsed
    time; ``restarts`` from accounting (None where only the queue was asked)."""

    state: str
    reason: str | None = None
    node_list: str | None = None
    elapsed: str | None = None
    restarts: int | None = None


def slurm_views(job_ids: list[str]) -> dict[str, SlurmView]:
    """SLURM's view of many jobs (array tasks as ``ARRAY_TASK``) from ONE ``squeue`` call and, for
    the jobs it no longer lists, ONE ``sacct`` call: a sweep of hundreds of points asks slurmctld
    twice, not hundreds of times. Jobs neither knows are absent from the result."""
    wanted = list(dict.fromkeys(job_ids))
    if not wanted:
        return {}
    views: dict[str, SlurmView] = {}
    # -r: one line per array task (a pending array is otherwise one line "ID_[0-9]"). One job: -j
    # (squeue fails when slurmctld no longer knows it; sacct answers then). Several: every job,
    # filtered here, as one id that is no longer known must not hide the others.
    only = ["-j", wanted[0]] if len(wanted) == 1 else []
    out = _run(["squeue", "-h", "-r", *only, "-o", "%i|%T|%r|%N|%M"]) or ""
    for line in out.splitlines():
        job_id, state, reason, nodes, elapsed = (line.strip().split("|") + [""] * 5)[:5]
        if only and line.strip():  # what squeue -j answers is that job, however it prints its id
            job_id = wanted[0]
        if job_id in wanted and job_id not in views:
            views[job_id] = SlurmView(
                state, reason if reason and reason != "None" else None, nodes or None, elapsed or None
            )
    gone = [j for j in wanted if j not in views]
    if gone:
        argv = ["sacct", "-n", "-X", "-P", "-D", "-j", ",".join(gone), "-o", "JobID,State,NodeList,Elapsed"]
        rows: dict[str, list[list[str]]] = {}
        for line in (_run(argv) or "").splitlines():
            if line.strip():
                fields = (line.split("|") + ["", "", "", ""])[:4]
                rows.setdefault(gone[0] if len(gone) == 1 else fields[0], []).append(fields)
        for job_id in gone:
            if job_id in rows:
                _, state, nodes, elapsed = rows[job_id][-1]
                views[job_id] = SlurmView(
                    state.split(" ")[0],  # "CANCELLED by 0" -> "CANCELLED"
                    node_list=nodes or None,
                    elapsed=elapsed or None,
                    restarts=len(rows[job_id]) - 1,
                )
    return views


def _slurm_state(job_id: str, status: RunStatus, views: dict[str, SlurmView] | None = None) -> None:
    """Fill state, reason, nodes, elapsed and restarts from ``views`` (see :func:`slurm_views`;
    asked here when not given). For one run, a queued or running job's restarts come from
    ``scontrol``, which the queue does not show."""
    asked = views is None
    view = (slurm_views([job_id]) if views is None else views).get(job_id)
    if view is None:
        status.state = "UNKNOWN"
        status.reason = "the queue no longer lists the job and the cluster keeps no accounting"
        return
    status.state, status.reason = view.state, view.reason
    status.node_list, status.elapsed, status.restarts = view.node_list, view.elapsed, view.restarts
    if asked and view.restarts is None:
        show = _run(["scontrol", "show", "job", "-o", job_id]) or ""
        for token in show.split():
            if token.startswith("Restarts="):
                status.restarts = int(token.split("=", 1)[1])


#: SLURM states of a job that is queued or may still run.
ACTIVE = frozenset(
    {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"}
    | {"SUSPENDED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}
)


def active_job(run_dir: Path) -> tuple[str, str] | None:
    """``(job id, state)`` of the newest recorded job of ``run_dir`` while it is queued or running."""
    from hpcfl.launch.records import read_job_records

    records = read_job_records(run_dir)
    if not records:
        return None
    record = records[-1]
    probe = RunStatus(run_dir=str(run_dir))
    if record.executor == "local":
        _local_state(record.job_id, probe)
    else:
        _slurm_state(record.job_id, probe)
    return (record.job_id, probe.state) if probe.state in ACTIVE else None


def _local_state(job_id: str, status: RunStatus) -> None:
    """A local-executor job is a process of this machine: alive or not."""
    try:
        os.kill(int(job_id), 0)
    except (ValueError, ProcessLookupError):
        status.state = "ENDED"
    except PermissionError:
        status.state = "RUNNING"
    else:
        status.state = "RUNNING"


def _job_error(folder: Path, job_id: str) -> str | None:
    """The one-line error rank 0 of the job recorded as JSON, if it failed with one.

    Never unpickles: submitit's ``*_result.pkl`` in a run directory could have been crafted to run
    code when loaded, and ``hpcfl status`` is run on directories others may write.
    """
    from hpcfl.launch.records import error_path

    path = error_path(folder, job_id)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, str):
        return None
    lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
    return lines[0] if lines else "failed without a message"


def _run_progress(run_dir: Path, status: RunStatus) -> None:
    """Rounds done, total and the last accuracy from the run's own files: the server model's, and a
    personalised run's mean over its clients' own models (what it deploys; the server model of
    FedPer is the shared body with the initial head)."""
    from hpcfl.rows import read_metrics_rows

    for row in read_metrics_rows(run_dir / "metrics.jsonl"):
        status.rounds_done = max(status.rounds_done, row["round"])
        status.test_accuracy = float(row["test_accuracy"])
        if isinstance(row.get("personal_acc_mean"), int | float):
            status.personal_accuracy = float(row["personal_acc_mean"])
    config = run_dir / "config.yaml"
    if config.exists():
        from hpcfl.files import read_yaml

        status.rounds_total = read_yaml(config).get("rounds")
    status.finished = (run_dir / "DONE").exists()
    if status.finished:
        from hpcfl.runner.rundir import BUDGET_STOP

        try:
            status.budget_stop = f"stopped={BUDGET_STOP}" in (run_dir / "DONE").read_text().split()
        except (OSError, UnicodeDecodeError):
            pass


def _unsubmitted_state(run_dir: Path, status: RunStatus) -> None:
    """The state of a run no job was submitted for, from what its markers say: FINISHED (DONE),
    RUNNING (an ``hpcfl run`` holds its lock), FAILED (a sweep's ``FAILED`` line), UNFINISHED (rounds
    logged, no DONE: ``--resume`` continues it) or NOT SUBMITTED."""
    from hpcfl.runner.lock import lock_holder
    from hpcfl.runner.rundir import failure

    if status.finished:
        status.state = "FINISHED"
    elif (holder := lock_holder(run_dir)) is not None:
        status.state, status.node_list = "RUNNING", f"{holder[0]} (PID {holder[1]})"
    elif (error := failure(run_dir)) is not None:
        status.state, status.error = "FAILED", error
    elif status.rounds_done:
        status.state, status.reason = "UNFINISHED", "resume it with hpcfl run ... --resume"
    else:
        status.state = "NOT SUBMITTED"


def run_status(run_dir: Path, views: dict[str, SlurmView] | None = None) -> RunStatus:
    """Where the run in ``run_dir`` stands (raises :class:`RunDirError` when it is no run dir).
    ``views``: SLURM's answers already fetched for many runs at once (:func:`slurm_views`)."""
    from hpcfl.launch.records import read_job_records

    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir} does not exist; give the --run-dir the run was submitted with")
    status = RunStatus(run_dir=str(run_dir))
    _run_progress(run_dir, status)
    records = read_job_records(run_dir)
    if not records:
        if not (run_dir / "config.yaml").exists():
            raise RunDirError(
                f"{run_dir} holds no run and no submitted job; submit one with: hpcfl submit CONFIG --run-dir {run_dir}"
            )
        _unsubmitted_state(run_dir, status)
        return status
    record = records[-1]
    status.job_id, status.executor = record.job_id, record.executor
    status.ranks, status.nodes, status.partition = record.ranks, record.nodes, record.partition
    status.submissions = len(records)
    folder = Path(record.folder)
    if record.executor == "local":
        _local_state(record.job_id, status)
    else:
        _slurm_state(record.job_id, status, views)
    status.error = _job_error(folder, record.job_id)
    from hpcfl.launch.records import missing_slurm_extra

    try:  # a submitted job: its log path is submitit's
        from hpcfl.launch.submitit_internals import job_stderr
    except ImportError as err:
        raise missing_slurm_extra(f"hpcfl status of the submitted job {record.job_id}") from err

    status.log = str(job_stderr(folder, record.job_id))
    return status


def format_status(status: RunStatus) -> str:
    """The human-readable lines ``hpcfl status`` prints."""
    lines = []
    if status.job_id is None:
        lines.append(f"run      {status.run_dir}  (no job submitted)")
    else:
        where = f"{status.ranks} rank{'s' if status.ranks != 1 else ''} on {status.nodes} node"
        where += "s" if status.nodes != 1 else ""
        if status.partition:
            where += f", partition {status.partition}"
        lines.append(f"run      {status.run_dir}  (job {status.job_id}, {status.executor}, {where})")
    state = status.state
    if status.reason:
        hint = PENDING_HINTS.get(status.reason)
        state += f" ({status.reason}: {hint})" if hint else f" ({status.reason})"
    if status.node_list and status.state in ("RUNNING", "COMPLETING"):
        state += f" on {status.node_list}"
    if status.elapsed and status.state not in ("PENDING",):
        state += f", elapsed {status.elapsed}"
    if status.restarts:
        state += f", requeued {status.restarts}x"
    lines.append(f"state    {state}")
    total = f"/{status.rounds_total}" if status.rounds_total is not None else ""
    progress = f"rounds   {status.rounds_done}{total}"
    if status.test_accuracy is not None:
        progress += f"  test accuracy {status.test_accuracy:.4f}"
    if status.personal_accuracy is not None:
        progress += f"  personal accuracy {status.personal_accuracy:.4f} (client mean)"
    if status.budget_stop:
        progress += "  (finished: stopped by its privacy budget, privacy.epsilon_budget or privacy.epsilon)"
    elif status.finished:
        progress += "  (finished)"
    lines.append(progress)
    if status.error and not status.finished:
        lines.append(f"error    {status.error}")
    if status.log and (status.failed or status.state in ("RUNNING", "COMPLETING")):
        lines.append(f"log      {status.log}")
    return "\n".join(lines)


def status_json(status: RunStatus) -> str:
    """The ``--json`` form: every field, plus ``failed``."""
    data: dict[str, Any] = asdict(status)
    data["failed"] = status.failed
    return json.dumps(data)
