"""What a submission leaves in a run directory: ``RUN_DIR/slurm/jobs.jsonl`` and the error files.

``hpcfl submit`` and sweep arrays write these records, ``hpcfl status`` reads them; this module
imports neither submitit nor the runner, so that reading them stays light (no torch, no zarr).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hpcfl.errors import ConfigError

#: Sub-directory of the run directory that holds submitit's files and the job records.
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


def missing_slurm_extra(what: str) -> ConfigError:
    """The one-line error of a command that needs submitit (the ``slurm`` extra) where it is absent.

    Only submitting and reading a submitted job need it: ``hpcfl status`` of a local run or sweep
    never imports submitit."""
    return ConfigError(f"{what} needs submitit, the slurm extra: pip install 'hpcfl[slurm]'")


def error_path(folder: Path, job_id: str, rank: int = 0) -> Path:
    """Where the job's rank ``rank`` records its error: ``<folder>/<job>_<rank>_error.json``."""
    return Path(folder) / f"{job_id}_{rank}_error.json"
