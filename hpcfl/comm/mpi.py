"""MPI communicator over mpi4py (MPICH wheel, Open MPI, or a vendor MPI under srun).

Tensors go through the buffer protocol without copies when they live on the CPU; CUDA tensors
are staged through host memory unless the MPI library reports CUDA awareness.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from hpcfl.errors import CommError


def _import_mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as err:  # pragma: no cover - depends on the install
        raise CommError(
            "this run needs MPI but mpi4py is not installed; install it with: pip install 'hpcfl[mpi]'"
        ) from err
    return MPI


def initialized_mpi() -> Any | None:
    """mpi4py's ``MPI`` module if this process initialised MPI and has not finalised it, else None.

    Never imports or initialises MPI itself, so it is safe to call from any error path.
    """
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi
    return None


def abort_world(code: int) -> None:
    """End every rank of ``MPI.COMM_WORLD`` with ``code`` if MPI runs with several ranks, else return.

    Called when one rank fails alone: the others would otherwise wait forever in a collective.
    """
    mpi = initialized_mpi()
    if mpi is not None and mpi.COMM_WORLD.Get_size() > 1:
        _abort(mpi.COMM_WORLD, code)


def finalize_mpi() -> None:
    """Wait for every rank, then finalise MPI if this process initialised it (else do nothing)."""
    mpi = initialized_mpi()
    if mpi is not None:
        mpi.COMM_WORLD.Barrier()
        mpi.Finalize()


def mpi_library_version() -> str:
    """First line of the MPI library's version string (e.g. ``MPICH Version: 4.2.0``)."""
    return str(_import_mpi().Get_library_version()).splitlines()[0].strip()


def _abort(comm: Any, code: int) -> None:
    """``MPI_Abort`` with the library's own report silenced: the caller has already said, in one
    line, which rank failed and why; MPICH would add a second line that names no cause."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    comm.Abort(code)


def _cuda_aware(mpi: Any) -> bool:
    try:
        return bool(mpi.Query_cuda_support())
    except (AttributeError, NotImplementedError):  # mpi4py < 4 or an MPI without the query
        return False


class MPIComm:
    """``MPI.COMM_WORLD`` (or a given communicator) behind the :class:`Communicator` interface."""

    def __init__(self, comm: Any | None = None) -> None:
        self._mpi = _import_mpi()
        self._comm = comm if comm is not None else self._mpi.COMM_WORLD
        self.rank: int = self._comm.Get_rank()
        self.size: int = self._comm.Get_size()
        node = self._comm.Split_type(self._mpi.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank: int = node.Get_rank()
        self.local_size: int = node.Get_size()
        node.Free()
        self._cuda_aware = _cuda_aware(self._mpi)

    def allreduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_contiguous():
            raise ValueError("allreduce needs a contiguous tensor")
        if self.size == 1:
            return tensor
        if tensor.is_cuda and not self._cuda_aware:
            host = tensor.cpu()
            self._comm.Allreduce(self._mpi.IN_PLACE, host.numpy())
            tensor.copy_(host)
            return tensor
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
            self._comm.Allreduce(self._mpi.IN_PLACE, tensor)
            return tensor
        self._comm.Allreduce(self._mpi.IN_PLACE, tensor.numpy())
        return tensor

    def allgather(self, obj: Any) -> list[Any]:
        return self._comm.allgather(obj)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self._comm.bcast(obj, root=root)

    def barrier(self) -> None:
        self._comm.Barrier()

    def abort(self, code: int = 1) -> None:
        self._comm.Abort(code)

    def __repr__(self) -> str:
        return f"MPIComm(rank={self.rank}, size={self.size}, local_rank={self.local_rank})"
