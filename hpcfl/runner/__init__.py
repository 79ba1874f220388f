"""Running federations: set-up, the round loop, checkpoints and the run directory."""

from hpcfl.runner.experiment import RunResult, StopRequest, default_run_dir, run_experiment

__all__ = ["RunResult", "StopRequest", "default_run_dir", "run_experiment"]
