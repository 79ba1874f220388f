"""Communicators: :class:`LocalComm` (one process, the default) and :class:`MPIComm`.

:func:`get_comm` picks MPI when the process was started by a launcher with more than one rank
(``mpiexec``, ``srun``), so ``mpiexec -n R hpcfl run ...`` and ``srun hpcfl run ...`` just work.

This package is the only place that touches MPI: the rest of hpcfl ends a failed job with
:func:`abort_world`, finalises with :func:`finalize_mpi`, and runs each launched rank under
:func:`supervise_rank` (the guard of :mod:`hpcfl.comm.guard`).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from hpcfl._lazy import lazy_exports
from hpcfl.comm.guard import supervise_rank
from hpcfl.comm.placement import place_clients, place_round

if TYPE_CHECKING:
    from hpcfl.comm.base import Communicator
    from hpcfl.comm.deadline import CommDeadline

# torch loads with the communicators, not with the launcher helpers every command uses
lazy_exports(__name__, {"hpcfl.comm.base": ["Communicator"], "hpcfl.comm.local": ["LocalComm"]})

# Environment variables set by common launchers, holding the world size.
_WORLD_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS")


def launched_world_size() -> int:
    """World size announced by the launcher's environment (1 when started directly)."""
    for var in _WORLD_SIZE_VARS:
        value = os.environ.get(var)
        if value and value.isdigit():
            return int(value)
    return 1


def launcher_rank() -> int:
    """This process's rank as the launcher announces it (0 when started directly)."""
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        value = os.environ.get(var)
        if value and value.isdigit():
            return int(value)
    return 0


def get_comm(kind: str = "auto", timeout: object | CommDeadline = "auto") -> Communicator:
    """Return the communicator for this process: ``local``, ``mpi`` or ``auto`` (MPI if launched so).

    ``timeout``: the ``comm_timeout`` setting (``auto`` or seconds; ``$HPCFL_COMM_TIMEOUT`` overrides
    it) or a resolved :class:`~hpcfl.comm.deadline.CommDeadline`. It is resolved here, once; the
    communicator carries it as ``deadline`` for its collectives and for the run record.
    """
    from hpcfl.comm.deadline import CommDeadline

    deadline = CommDeadline.resolve(timeout)  # a bad value fails here, before MPI starts
    if kind == "local" or (kind == "auto" and launched_world_size() <= 1):
        from hpcfl.comm.local import LocalComm

        return LocalComm(deadline)
    from hpcfl.comm.mpi import MPIComm

    return MPIComm(timeout=deadline)


def mpi_initialized() -> bool:
    """True when this process has initialised MPI and not finalised it (never imports mpi4py)."""
    if "mpi4py.MPI" not in sys.modules:
        return False
    from hpcfl.comm.mpi import initialized_mpi

    return initialized_mpi() is not None


def abort_world(code: int) -> None:
    """End every rank with ``code`` when MPI runs with several ranks; otherwise just return."""
    if "mpi4py.MPI" in sys.modules:
        from hpcfl.comm.mpi import abort_world as _abort_world

        _abort_world(code)


def finalize_mpi() -> None:
    """Barrier and ``MPI_Finalize`` if this process initialised MPI; otherwise nothing."""
    if "mpi4py.MPI" in sys.modules:
        from hpcfl.comm.mpi import finalize_mpi as _finalize_mpi

        _finalize_mpi()


def mpi_library_version() -> str:
    """First line of the MPI library's version string (imports mpi4py)."""
    from hpcfl.comm.mpi import mpi_library_version as _version

    return _version()


__all__ = [
    "Communicator",
    "LocalComm",
    "abort_world",
    "finalize_mpi",
    "get_comm",
    "launched_world_size",
    "launcher_rank",
    "mpi_initialized",
    "mpi_library_version",
    "place_clients",
    "place_round",
    "supervise_rank",
]
