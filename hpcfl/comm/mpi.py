"""MPI communicator over mpi4py (MPICH wheel, Open MPI, or a vendor MPI under srun).

Tensors go through the buffer protocol without copies when they live on the CPU; CUDA tensors
are staged through host memory unless the MPI library reports CUDA awareness.

No collective can hang: each is a nonblocking call polled against the deadline of
:mod:`hpcfl.comm.deadline` (objects are pickled and travel as bytes: sizes first, then the bytes).
When the deadline passes, the waiting rank pings every other rank's side channel
(:meth:`~hpcfl.comm.liveness.Beacon.ping`): while all answer, it keeps waiting (a slow rank is not a
lost one); a rank silent to :data:`~hpcfl.comm.deadline.KNOCK_TRIES` pings in a row is lost.
The communicators use ``MPI.ERRORS_RETURN``, so a peer's failure that MPI notices (a connection
reset) comes back as an exception and counts like a lost rank. Then the ranks that still run
find out which peers they can reach (:meth:`MPIComm._reachable`, a token to and from every rank on
a communicator of its own, answered by every rank that waits in a collective); the side that holds
a majority of the ranks (a tie: the side of rank 0) speaks through its lowest rank, which raises
:class:`~hpcfl.errors.PeerLostError` (one line naming the lost ranks and hosts, then ``MPI_Abort``
with :data:`~hpcfl.errors.EXIT_PEER_LOST` by the command's error path); every other rank waits for
that abort or, on the minority side, exits at once with the same code and says nothing.
"""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np
import torch

from hpcfl.comm.deadline import KNOCK_TRIES, CommDeadline, poll
from hpcfl.comm.liveness import Address, Beacon, knock
from hpcfl.errors import EXIT_PEER_LOST, CommError, PeerLostError

SPEAKER_WAIT_S = 30.0  # a rank of the speaking side that is not the speaker waits this long for its abort
MINORITY_WAIT_S = 5.0  # a rank of the silent side waits this long before it exits: the speaker goes first
_ACTIVE: list[MPIComm] = []  # communicators whose probe receive must be cancelled before MPI_Finalize


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
        if _ACTIVE:
            _ACTIVE[0].barrier()  # under the deadline, unlike COMM_WORLD.Barrier()
        else:
            mpi.COMM_WORLD.Barrier()
        _close_all()
        mpi.Finalize()


def _close_all() -> None:
    """Cancel the probe receives of every communicator (MPI warns of pending ones at finalize)."""
    for comm in _ACTIVE:
        comm.close()
    _ACTIVE.clear()


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


def _seconds(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.3g}"


def coordinators(hosts: list[str]) -> tuple[int, int | None]:
    """The ranks that count who answers when a collective's deadline passes: rank 0, and the
    lowest rank on another host than rank 0's (rank 1 when all share one host; None for one rank),
    so that losing rank 0's node still leaves one to speak."""
    other = next((r for r, h in enumerate(hosts) if h != hosts[0]), 1 if len(hosts) > 1 else None)
    return 0, other


def lost_message(lost: list[int], hosts: list[str], cause: str) -> str:
    """The one line that names the lost ranks, grouped by host, and ``cause`` (e.g. "did not answer
    within 300 s")."""
    groups: dict[str, list[int]] = {}
    for r in lost:
        groups.setdefault(hosts[r], []).append(r)
    parts = [
        f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))} (host {host})"
        for host, ranks in groups.items()
    ]
    who = parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"
    return (
        f"{who} {cause} (its node was lost or its link cut); ending the job — resume with --resume"
        if len(lost) == 1
        else f"{who} {cause} (their nodes were lost or their links cut); ending the job — resume with --resume"
    )


class MPIComm:
    """``MPI.COMM_WORLD`` (or a given communicator) behind the :class:`Communicator` interface, each
    collective bounded by a deadline: a resolved :class:`~hpcfl.comm.deadline.CommDeadline`,
    ``timeout`` seconds, or ``auto`` (None; see :mod:`hpcfl.comm.deadline`)."""

    def __init__(self, comm: Any | None = None, timeout: CommDeadline | float | None = None) -> None:
        self._mpi = _import_mpi()
        self._comm = comm if comm is not None else self._mpi.COMM_WORLD
        self._comm.Set_errhandler(self._mpi.ERRORS_RETURN)
        # errors MPI cannot pin on a communicator (a transport failure met while progressing a
        # request) go to MPI_COMM_SELF's handler (MPI-4's default one): fatal unless set so
        self._mpi.COMM_SELF.Set_errhandler(self._mpi.ERRORS_RETURN)
        self.rank: int = self._comm.Get_rank()
        self.size: int = self._comm.Get_size()
        node = self._comm.Split_type(self._mpi.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank: int = node.Get_rank()
        self.local_size: int = node.Get_size()
        node.Free()
        self._cuda_aware = _cuda_aware(self._mpi)
        self.deadline = CommDeadline.given(timeout)  # read by the collectives and the run record
        self._beacon = Beacon(self.rank)  # the liveness side channel (hpcfl.comm.liveness)
        every = self._comm.allgather((socket.gethostname(), self._beacon.address))
        self.hosts: list[str] = [str(h) for h, _ in every]
        self._beacons: dict[int, Address] = {r: a for r, (_, a) in enumerate(every)}
        self._beacon.set_peers(self._beacons)
        self._lost: PeerLostError | None = None
        self._coordinators = coordinators(self.hosts)
        if not _ACTIVE:  # runs before mpi4py's own finalize at exit (registered after it)
            atexit.register(_close_all)
        _ACTIVE.append(self)

    def allreduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_contiguous():
            raise ValueError("allreduce needs a contiguous tensor")
        if self.size == 1:
            return tensor
        if tensor.is_cuda and not self._cuda_aware:
            host = tensor.cpu()
            self._collective(lambda: self._comm.Iallreduce(self._mpi.IN_PLACE, host.numpy()))
            tensor.copy_(host)
            return tensor
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
            self._collective(lambda: self._comm.Iallreduce(self._mpi.IN_PLACE, tensor))
            return tensor
        self._collective(lambda: self._comm.Iallreduce(self._mpi.IN_PLACE, tensor.numpy()))
        return tensor

    def allgather(self, obj: Any) -> list[Any]:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        sizes = np.zeros(self.size, dtype=np.int64)
        mine = np.array([len(data)], dtype=np.int64)
        self._collective(lambda: self._comm.Iallgather(mine, sizes))
        counts = [int(n) for n in sizes]
        displs = [0, *np.cumsum(counts)[:-1].tolist()]
        out = bytearray(sum(counts))
        self._collective(
            lambda: self._comm.Iallgatherv([data, self._mpi.BYTE], [out, counts, displs, self._mpi.BYTE])
        )
        view = memoryview(out)
        return [pickle.loads(view[d : d + n]) for d, n in zip(displs, counts, strict=True)]

    def bcast(self, obj: Any, root: int = 0) -> Any:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == root else b""
        size = np.array([len(data)], dtype=np.int64)
        self._collective(lambda: self._comm.Ibcast(size, root=root))
        buf = bytearray(data) if self.rank == root else bytearray(int(size[0]))
        self._collective(lambda: self._comm.Ibcast([buf, self._mpi.BYTE], root=root))
        return pickle.loads(buf)

    def barrier(self) -> None:
        self._collective(self._comm.Ibarrier)

    def abort(self, code: int = 1) -> None:
        self._comm.Abort(code)

    def close(self) -> None:
        """Close the liveness listener (before ``MPI_Finalize``)."""
        self._beacon.close()

    def _collective(self, start: Callable[[], Any]) -> None:
        """Start a nonblocking collective and wait for it within the deadline, or end the job."""
        if self._lost is not None:  # a peer is already known lost: waiting again would only stall
            raise self._lost
        limit = self.deadline.seconds
        try:
            request = start()
            while True:
                if poll(request.Test, time.monotonic() + limit, idle=lambda: self._heard_ping(limit)):
                    return
                # past the deadline: keep waiting while every rank answers (slow is not lost); a
                # collective that completed during the pings is tested at once by the next poll
                if self._silent() and not request.Test():
                    break
        except self._mpi.Exception:  # a peer's failure reported by MPI (connection reset, ...)
            self._end(limit, cause="stopped answering (MPI reported a failure)")
        self._end(limit, cause=f"did not answer within {_seconds(limit)} s")

    def _silent(self) -> set[int]:
        """The ranks that answered none of :data:`KNOCK_TRIES` pings in a row (each awaited
        ``probe_s``), the collective having waited its deadline: empty while every rank answers,
        however long its main thread computes."""
        missing = {r for r in self._beacons if r != self.rank}
        for _ in range(KNOCK_TRIES):
            missing = self._beacon.ping({r: self._beacons[r] for r in missing}, self.deadline.probe_s)
            if not missing:
                break
            self._heard_ping(self.deadline.seconds)  # another rank may already be ending the job
        return missing

    def _heard_ping(self, limit: float) -> None:
        """While waiting: a knock on this rank's beacon (not a ping) means another rank found a
        rank lost, or MPI failed it; join the count."""
        if self._beacon.waiting():
            self._end(limit, cause=f"did not answer within {_seconds(limit)} s")

    def _end(self, limit: float, cause: str) -> NoReturn:
        """Find the reachable ranks, then speak and end the job, wait for the speaker, or exit.

        Only the coordinators (:func:`coordinators`) count who answers: every rank knocks on their
        beacons, and a coordinator also knocks on every rank's so that ranks still waiting in their
        collective join at once. The knocks go outside MPI (:mod:`hpcfl.comm.liveness`): a send to
        a rank on a vanished host can block inside MPI itself."""
        window = self.deadline.probe_s
        reachable, heard_coordinator = self._reachable(window)
        lost = [r for r in range(self.size) if r not in reachable]
        first, second = self._coordinators
        if self.rank == first:  # rank 0's side speaks when it holds a majority or half
            speaks = 2 * len(reachable) >= self.size
        elif self.rank == second:  # the other coordinator only when rank 0 is gone from its side
            speaks = first not in reachable and 2 * len(reachable) > self.size
        else:
            speaks = False
        if speaks:
            if lost:
                message = lost_message(lost, self.hosts, cause)
            else:
                message = (
                    f"a collective failed although every rank answered the count ({cause}); ending "
                    "the job — resume with --resume"
                )
            self._lost = PeerLostError(message)
            raise self._lost
        sys.stdout.flush()
        sys.stderr.flush()
        # the speaker's abort ends this process; should it not come, end anyway. A rank that heard
        # no coordinator is on the silent side and waits less; its exit must still not reach the
        # launcher (srun --kill-on-bad-exit) before the speaker's line.
        time.sleep(max(SPEAKER_WAIT_S, window) if heard_coordinator else MINORITY_WAIT_S)
        os._exit(EXIT_PEER_LOST)

    def _reachable(self, window: float) -> tuple[set[int], bool]:
        """(The ranks heard within ``window`` seconds, with this one; whether a coordinator was
        among them.) A coordinator knocks on every rank, every other rank on the coordinators;
        each knocked rank's beacon thread replies at once, whatever its main thread is doing."""
        until = time.monotonic() + window
        if self.rank in self._coordinators:
            targets = {r: a for r, a in self._beacons.items() if r != self.rank}
        else:
            targets = {c: self._beacons[c] for c in self._coordinators if c is not None and c != self.rank}
        knock(targets, self.rank, window / 2)
        heard = self._beacon.heard(max(0.0, until - time.monotonic()), enough=len(targets))
        reachable = {self.rank} | {r for r in heard if 0 <= r < self.size}
        others = {c for c in self._coordinators if c is not None and c != self.rank}
        return reachable, bool(reachable & others)

    def __repr__(self) -> str:
        return f"MPIComm(rank={self.rank}, size={self.size}, local_rank={self.local_rank})"
