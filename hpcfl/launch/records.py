"""The job records of a run directory: ``RUN_DIR/slurm/jobs.jsonl``, one row per submission.

``hpcfl submit`` and sweep job arrays append them; ``hpcfl status`` (of a run or of a sweep) reads
them. A module of its own so that the readers import neither submitit nor the submission code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SLURM_DIR = "slurm"
JOBS_FILE = "jobs.jsonl"


@dataclass(frozen=True)
class JobRecord:
    """One submission of a run, as ``RUN_DIR/slurm/jobs.jsonl`` stores it."""

    job_id: str
    executor: str
    folder: str
    submitted: str
    ranks: int
    nodes: int
    partition: str | None
    command: str


def read_job_records(run_dir: Path) -> list[JobRecord]:
    """Every recorded submission of ``run_dir``, oldest first."""
    from hpcfl.files import read_jsonl

    path = run_dir / SLURM_DIR / JOBS_FILE
    records = []
    for row in read_jsonl(path) if path.exists() else []:
        try:
            records.append(JobRecord(**row))
        except TypeError:  # a row of another version, or edited by hand: not a record
            continue
    return records
