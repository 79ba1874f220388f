"""A sweep's unfinished points as ONE SLURM job array (submitit's batch submission).

Each array task is one point run as :class:`~hpcfl.launch.HpcflJob`, an MPI job of the size the
options ask for (``--nodes`` × ``--ntasks-per-node`` ranks), resuming from its last round
checkpoint, so a task that is preempted or reaches its time limit requeues itself exactly as a
single ``hpcfl submit`` job does. ``--array-parallelism`` caps how many tasks run at once.

Every task's submission is recorded in its point's ``slurm/jobs.jsonl`` (job id ``ARRAY_TASK``,
submitit's files in the sweep's ``slurm/``), so ``hpcfl status`` works on a point directory as on
a submitted run, and the sweep's ``slurm/arrays.jsonl`` lists the arrays with their points.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import io
import os
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hpcfl.errors import ConfigError
from hpcfl.files import append_jsonl
from hpcfl.launch.job import HpcflJob
from hpcfl.launch.submit import (  # FailedJobError is submitit's; without submitit: one ConfigError line
    JOBS_FILE,
    SLURM_DIR,
    FailedJobError,
    JobRecord,
    SubmitOptions,
    _sbatch_reason,
    check_options,
    make_executor,
)
from hpcfl.sweep.plan import Sweep, SweepPoint

ARRAYS_FILE = "arrays.jsonl"


def queued_elsewhere(point: SweepPoint) -> tuple[str, str] | None:
    """``(job id, state)`` when a job of an earlier submission still holds the point's run."""
    from hpcfl.launch.status import active_job

    return active_job(point.run_dir)


def check_array(points: list[SweepPoint], options: SubmitOptions) -> None:
    """The request against every point (ranks vs clients, GPUs vs device), before queueing."""
    for point in points:
        assert point.cfg is not None
        try:
            check_options(options, point.cfg)
        except ConfigError as err:
            raise ConfigError(f"grid point {point.name}: {err}") from None


def submit_array(
    sweep: Sweep, points: list[SweepPoint], options: SubmitOptions, *, array_parallelism: int | None = None
) -> tuple[str, list[JobRecord]]:
    """Queue ``points`` as one job array; returns the array's id and each task's record.

    A single point is queued as a plain job (SLURM has no one-task arrays in submitit).
    """
    if options.executor != "slurm":
        raise ConfigError("a sweep is queued as a SLURM job array; use --executor slurm")
    check_array(points, options)
    folder = sweep.sweep_dir / SLURM_DIR
    folder.mkdir(parents=True, exist_ok=True)
    name = options.job_name or f"hpcfl-{sweep.name}"
    executor = make_executor(options, folder, name)
    if array_parallelism is not None:
        executor.update_parameters(array_parallelism=array_parallelism)
    calls = []
    for point in points:
        assert point.cfg is not None
        config = point.cfg.to_dict()
        if config.get("data_root"):
            config["data_root"] = str(Path(config["data_root"]).expanduser().resolve())
        calls.append(HpcflJob(config=config, run_dir=str(point.run_dir.resolve())))
    try:
        with contextlib.redirect_stderr(io.StringIO()), executor.batch():
            jobs = [executor.submit(call) for call in calls]
    except FailedJobError as err:
        raise ConfigError(f"sbatch rejected the job array: {_sbatch_reason(str(err))}") from err
    submitted = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    command = shlex.join([os.path.basename(sys.argv[0]) or "hpcfl", *sys.argv[1:]])
    records = []
    for point, job in zip(points, jobs, strict=True):
        record = JobRecord(
            job_id=str(job.job_id),
            executor="slurm",
            folder=str(folder),
            submitted=submitted,
            ranks=options.ranks,
            nodes=options.nodes,
            partition=options.partition,
            command=command,
        )
        point_slurm = point.run_dir / SLURM_DIR
        point_slurm.mkdir(parents=True, exist_ok=True)
        append_jsonl(point_slurm / JOBS_FILE, asdict(record))
        records.append(record)
    array_id = str(jobs[0].job_id).split("_")[0]
    row: dict[str, Any] = {
        "array_id": array_id,
        "submitted": submitted,
        "points": [p.name for p in points],
        "array_parallelism": array_parallelism,
    }
    append_jsonl(folder / ARRAYS_FILE, row)
    return array_id, records
