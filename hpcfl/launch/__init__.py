"""SLURM through submitit: ``hpcfl submit`` queues a run, ``hpcfl status`` reports on it.

Submitting, and reading a submitted job, need the ``slurm`` extra (``pip install 'hpcfl[slurm]'``):
the modules that do (:mod:`~hpcfl.launch.job`, :mod:`~hpcfl.launch.submit`, a job record read by
:mod:`~hpcfl.launch.status`) raise a :class:`~hpcfl.errors.ConfigError` that says so without it.
``hpcfl status`` of a local run or sweep never imports submitit.
"""

from __future__ import annotations

from hpcfl._lazy import lazy_exports

# loaded on first use: `hpcfl status` reads job records and must not import the runner (torch, zarr)
lazy_exports(
    __name__,
    {
        "hpcfl.launch.job": ["HpcflJob"],
        "hpcfl.launch.status": ["RunStatus", "format_status", "run_status"],
        "hpcfl.launch.submit": ["JobRecord", "SubmitOptions", "render_sbatch", "submit_run"],
    },
)

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
