"""Where datasets live on disk: ``--data-root``, else ``$HPCFL_DATA``, else ``~/.cache/hpcfl``.

Every data root is made absolute where it enters (the command-line flag, a config's ``data_root``,
the environment variable), so that a relative path such as ``../shared/datasets`` keeps naming the
same directory after a test, a launcher or a SLURM job changes the working directory.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "HPCFL_DATA"


def absolute_path(path: str | os.PathLike[str]) -> Path:
    """``path`` with ``~`` expanded, made absolute against the current directory (symlinks kept)."""
    return Path(os.path.abspath(Path(path).expanduser()))


def absolute_data_root(data_root: str | os.PathLike[str] | None) -> str | None:
    """A data root as an absolute path string, or None when unset (for flags and config values)."""
    if data_root is None or str(data_root) == "":
        return None
    return str(absolute_path(data_root))


def absolutize_env() -> None:
    """Rewrite a relative ``$HPCFL_DATA`` as an absolute path, for this process and its children."""
    env = os.environ.get(ENV_VAR, "")
    if env:
        os.environ[ENV_VAR] = str(absolute_path(env))


def resolve_data_root(data_root: str | os.PathLike[str] | None = None) -> Path:
    """The absolute dataset root: the explicit argument, else ``$HPCFL_DATA``, else ``~/.cache/hpcfl``.

    Each dataset then sits in its own sub-directory (``mnist/``, ``fashion-mnist/``, ``cifar10/``,
    ``cifar100/``, ``femnist/``). The directory need not exist yet (downloads create it).
    """
    if data_root is not None and str(data_root) != "":
        return absolute_path(data_root)
    env = os.environ.get(ENV_VAR, "")
    if env:
        return absolute_path(env)
    return Path.home() / ".cache" / "hpcfl"
