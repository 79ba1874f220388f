"""The run directory: what is in it, and whether this invocation may use it.

``runs/<name>/config.yaml metrics.jsonl partition.json partition.png checkpoints/ DONE``.
A finished run (DONE) or an unfinished one is never silently reused: ``--resume`` continues it,
``--overwrite`` starts over.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from hpcfl.config import Config, config_differences, read_yaml
from hpcfl.errors import RunDirError

DONE = "DONE"


def prepare_run_dir(run_dir: Path, cfg: Config, *, resume: bool, overwrite: bool) -> bool:
    """Check and prepare ``run_dir`` (rank 0 only); returns True when a resume should load state."""
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite contradict each other; pass only one")
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run directory {run_dir} is a file; choose another --run-dir")
    holds_run = run_dir.is_dir() and any((run_dir / n).exists() for n in ("config.yaml", "checkpoints", DONE))
    if overwrite and holds_run:
        shutil.rmtree(run_dir)
        holds_run = False
    if holds_run and not resume:
        state = "a finished run" if (run_dir / DONE).exists() else "an unfinished run"
        raise RunDirError(
            f"run directory {run_dir} already holds {state}; pass --resume to continue it, "
            "--overwrite to start over, or choose another --run-dir"
        )
    if holds_run and (run_dir / "config.yaml").exists():
        diffs = config_differences(read_yaml(run_dir / "config.yaml"), cfg.to_dict())
        if diffs:
            raise RunDirError(
                f"cannot resume {run_dir}: its checkpoint was made with a different config "
                f"(differs in: {', '.join(diffs)}); use the same config or --overwrite"
            )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / DONE).unlink(missing_ok=True)
    return holds_run
