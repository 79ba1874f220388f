"""The one module that reaches past submitit's public API (``submitit``'s top-level names and
``submitit.helpers``), each use wrapped in one small function here, so that a submitit release that
changes them breaks one file and ``tests/test_submitit_internals.py`` (which checks every name and
signature used here against the installed submitit) rather than a job on a cluster.

pyproject.toml pins submitit to the range these were tested with (``>=1.5.4,<1.6``).

Imports submitit: importing this module without it raises ImportError (callers turn that into
their one :func:`hpcfl.launch.records.missing_slurm_extra` line).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import submitit
from submitit.core.job_environment import SignalHandler
from submitit.core.utils import FailedJobError, JobPaths

__all__ = [
    "FailedJobError",
    "RenderOnlySlurmExecutor",
    "checkpoint_and_requeue",
    "job_stderr",
    "preemption_signal",
    "sbatch_text",
]

# FailedJobError (sbatch refused the submission) is what submitit raises from its public
# Executor.submit; it is only importable from submitit.core.utils.


def preemption_signal() -> int:
    """The signal SLURM sends a submitit job before its time limit or on preemption
    (``SUBMITIT_PREEMPT_SIGNAL``, USR2 by default)."""
    return int(submitit.JobEnvironment._usr_sig())


def checkpoint_and_requeue(env: submitit.JobEnvironment, started: float | None = None) -> None:
    """submitit's own checkpoint-and-requeue, as its signal handler would run it: load the job's
    submitted pickle, ask the callable for its :meth:`checkpoint` resubmission, ``scontrol requeue``.
    ``started`` (``time.time()`` when the job began) lets submitit tell a time limit (counted
    against ``max_num_timeout``) from a preemption; it returns only on ranks other than 0."""
    delayed = submitit.helpers.DelayedSubmission.load(env.paths.submitted_pickle)
    handler = SignalHandler(env, env.paths, delayed)
    handler._start_time = time.time() if started is None else started
    handler.checkpoint_and_try_requeue(preemption_signal())


def job_stderr(folder: Path | str, job_id: str) -> Path:
    """Where submitit writes task 0's stderr of job ``job_id`` under ``folder``."""
    return Path(JobPaths(folder, job_id=job_id, task_id=0).stderr)


class RenderOnlySlurmExecutor(submitit.SlurmExecutor):
    """A SlurmExecutor usable where ``srun`` is missing: only to print the sbatch script
    (submitit refuses to build one when its ``affinity`` says SLURM is absent)."""

    @classmethod
    def affinity(cls) -> int:
        return 2


def sbatch_text(executor: submitit.SlurmExecutor, uid: str = "dry-run") -> str:
    """The sbatch script ``executor`` would queue, with submitit's own job command line."""
    return str(executor._make_submission_file_text(executor._submitit_command_str, uid))


def _uses() -> dict[str, Any]:
    """Every submitit internal this module reads (for tests/test_submitit_internals.py)."""
    return {
        "JobEnvironment._usr_sig": submitit.JobEnvironment._usr_sig,
        "SignalHandler.__init__": SignalHandler.__init__,
        "SignalHandler.checkpoint_and_try_requeue": SignalHandler.checkpoint_and_try_requeue,
        "JobPaths.__init__": JobPaths.__init__,
        "SlurmExecutor.affinity": submitit.SlurmExecutor.affinity,
        "SlurmExecutor._make_submission_file_text": submitit.SlurmExecutor._make_submission_file_text,
        "SlurmExecutor._submitit_command_str": submitit.SlurmExecutor._submitit_command_str,
    }
