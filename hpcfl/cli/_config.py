"""Loading a run's config from the command line, shared by ``run``, ``compare`` and ``submit``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpcfl.config import Config, load_config
from hpcfl.data.root import absolute_data_root


def load_cli_config(
    path: str | Path | None, sets: list[str], data_root: str | None, values: dict[str, Any] | None = None
) -> Config:
    """The validated config of ``path`` with ``--set`` and ``--data-root`` applied.

    The data root (from the flag or the file) is made absolute here, where it enters, so a relative
    one keeps naming the same directory after a launcher or a job changes the working directory.
    ``values`` are typed ``{dotted key: value}`` overrides applied after ``sets`` (a sweep point's).
    """
    overrides = list(sets) + ([f"data_root={data_root}"] if data_root else [])
    cfg = load_config(path, overrides, values)
    cfg.data_root = absolute_data_root(cfg.data_root)
    return cfg
