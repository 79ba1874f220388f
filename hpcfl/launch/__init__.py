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
