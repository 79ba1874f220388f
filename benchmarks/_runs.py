"""Cached grid runs for the benchmark scripts: one hpcfl run per directory, reused when finished.

A run whose directory holds DONE with the same config is not re-run, an unfinished one is resumed,
and one that failed with an hpcfl error (a diverging baseline, say) is recorded in FAILED and
reported rather than ending the whole grid. Runs in spawned worker processes (imports inside).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def _same_config(run_dir: Path, cfg_dict: dict[str, Any]) -> bool:
    from hpcfl.config import config_differences, config_from_dict, read_yaml

    if not (run_dir / "config.yaml").exists():
        return False
    return not config_differences(read_yaml(run_dir / "config.yaml"), config_from_dict(cfg_dict).to_dict())


def _wall_seconds(path: Path) -> float:
    """Wall seconds of the run: WALL_SECONDS, else the ``seconds=`` of DONE, else NaN."""
    if (path / "WALL_SECONDS").exists():
        return float((path / "WALL_SECONDS").read_text())
    if (path / "DONE").exists():
        for field in (path / "DONE").read_text().split():
            if field.startswith("seconds="):
                return float(field.removeprefix("seconds="))
    return float("nan")


def run_cached(cfg_dict: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """One run (in a worker process): skipped when DONE with this config, resumed when unfinished."""
    from hpcfl.config import config_from_dict
    from hpcfl.errors import HpcflError
    from hpcfl.files import read_jsonl
    from hpcfl.runner import run_experiment

    path = Path(run_dir)
    same = _same_config(path, cfg_dict)
    status = "cached"
    t0 = time.perf_counter()
    if (path / "FAILED").exists() and same:
        status = "failed (cached): " + (path / "FAILED").read_text().strip()
    elif not (same and (path / "DONE").exists()):
        status = "resumed" if same else "ran"
        (path / "FAILED").unlink(missing_ok=True)
        try:
            run_experiment(config_from_dict(cfg_dict), path, resume=same, overwrite=not same)
        except HpcflError as err:  # e.g. a diverging baseline: report it, keep the grid going
            status = f"failed: {err}"
            (path / "FAILED").write_text(f"{err}\n")
        (path / "WALL_SECONDS").write_text(f"{time.perf_counter() - t0:.1f}\n")
    seconds = _wall_seconds(path)
    print(f"{cfg_dict['name']:20s} {status} ({seconds:.0f} s)", flush=True)
    return {"rows": read_jsonl(path / "metrics.jsonl"), "seconds": seconds, "status": status}
