"""Where datasets live on disk: ``--data-root``, else ``$HPCFL_DATA``, else ``~/.cache/hpcfl``."""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "HPCFL_DATA"


def resolve_data_root(data_root: str | os.PathLike[str] | None = None) -> Path:
    """The dataset root directory: the explicit argument, else ``$HPCFL_DATA``, else ``~/.cache/hpcfl``.

    Each dataset then sits in its own sub-directory (``mnist/``, ``fashion-mnist/``, ``cifar10/``,
    ``cifar100/``, ``femnist/``). The directory need not exist yet (downloads create it).
    """
    if data_root is not None and str(data_root) != "":
        return Path(data_root).expanduser()
    env = os.environ.get(ENV_VAR, "")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "hpcfl"
