"""Communicators: :class:`LocalComm` (one process, the default) and :class:`MPIComm`.

:func:`get_comm` picks MPI when the process was started by a launcher with more than one rank
(``mpiexec``, ``srun``), so ``mpiexec -n R hpcfl run ...`` and ``srun hpcfl run ...`` just work.
"""

from __future__ import annotations

import os

from hpcfl.comm.base import Communicator
from hpcfl.comm.local import LocalComm
from hpcfl.comm.placement import place_clients, place_round

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


def get_comm(kind: str = "auto") -> Communicator:
    """Return the communicator for this process: ``local``, ``mpi`` or ``auto`` (MPI if launched so)."""
    if kind == "local" or (kind == "auto" and launched_world_size() <= 1):
        return LocalComm()
    from hpcfl.comm.mpi import MPIComm

    return MPIComm()


__all__ = [
    "Communicator",
    "LocalComm",
    "get_comm",
    "launched_world_size",
    "launcher_rank",
    "place_clients",
    "place_round",
]
