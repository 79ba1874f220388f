"""SLURM through submitit: ``hpcfl submit`` queues a run, ``hpcfl status`` reports on it.

Needs the ``slurm`` extra (``pip install 'hpcfl[slurm]'``); importing this package without submitit
raises a :class:`~hpcfl.errors.ConfigError` that says so.
"""

from __future__ import annotations

try:
    import submitit as _submitit  # noqa: F401
except ImportError as err:  # pragma: no cover - the dev environment has it
    from hpcfl.errors import ConfigError

    raise ConfigError("hpcfl submit/status need submitit: pip install 'hpcfl[slurm]'") from err

from hpcfl.launch.job import HpcflJob as HpcflJob
from hpcfl.launch.status import RunStatus as RunStatus
from hpcfl.launch.status import format_status as format_status
from hpcfl.launch.status import run_status as run_status
from hpcfl.launch.submit import JobRecord as JobRecord
from hpcfl.launch.submit import SubmitOptions as SubmitOptions
from hpcfl.launch.submit import render_sbatch as render_sbatch
from hpcfl.launch.submit import submit_run as submit_run

__all__ = [
    "HpcflJob",
    "JobRecord",
    "RunStatus",
    "SubmitOptions",
    "format_status",
    "render_sbatch",
    "run_status",
    "submit_run",
]
