"""Cached grid runs for the benchmark scripts: a thin layer over :func:`hpcfl.sweep.run_point`.

A run whose directory holds DONE with the same config is not re-run, an unfinished one is resumed,
one of another config is started over, and one that failed with an hpcfl error (a diverging
baseline, say) is recorded in FAILED and reported rather than ending the whole grid (and not
retried). Runs in spawned worker processes (imports inside).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def run_cached(cfg_dict: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """One run (in a worker process): skipped when DONE with this config, resumed when unfinished."""
    from hpcfl.config import config_from_dict
    from hpcfl.files import read_jsonl
    from hpcfl.sweep import run_point

    path = Path(run_dir)
    outcome = run_point(config_from_dict(cfg_dict), path, retry_failed=False, replace_other=True)
    print(f"{cfg_dict['name']:20s} {outcome.status} ({outcome.seconds:.0f} s)", flush=True)
    rows = read_jsonl(path / "metrics.jsonl") if (path / "metrics.jsonl").exists() else []
    return {"rows": rows, "seconds": outcome.seconds, "status": outcome.status}
