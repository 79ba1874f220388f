"""Running federations: set-up, the round loop, checkpoints and the run directory.

The names load on first use (:mod:`hpcfl._lazy`): reading a run directory's markers
(:mod:`hpcfl.runner.rundir`) must not import the runner itself (torch, zarr).
"""

from hpcfl._lazy import lazy_exports

lazy_exports(
    __name__,
    {"hpcfl.runner.experiment": ["RunResult", "StopRequest", "default_run_dir", "run_experiment"]},
)

__all__ = ["RunResult", "StopRequest", "default_run_dir", "run_experiment"]
