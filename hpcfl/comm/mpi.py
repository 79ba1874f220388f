"""MPI communicator over mpi4py (MPICH wheel, Open MPI, or a vendor MPI under srun).

Tensors go through the buffer protocol without copies when they live on the CPU; CUDA tensors
are staged through host memory unless the MPI library reports CUDA awareness.

No collective can hang: each is a nonblocking call polled against the deadline of
:mod:`hpcfl.comm.deadline` (objects are pickled and travel as bytes: sizes first, then the bytes);
so is the start-up exchange (the hosts, the side channel's secret and addresses, the node's
shared-memory split). The communicators use ``MPI.ERRORS_RETURN``, so a peer's failure that MPI notices
(a connection reset) comes back as an exception and counts like a passed deadline. Then the ranks
that still run find out which peers they can reach over the side channel of
:mod:`hpcfl.comm.liveness` (:meth:`MPIComm._side`): every rank knocks on the coordinators
(:func:`coordinators`), a coordinator on every rank, and a rank that hears no coordinator on every
rank too. Each side of a loss then speaks once, through rank 0 if it is on that side, else the
other coordinator, else its lowest rank, which raises :class:`~hpcfl.errors.PeerLostError` (one
line naming the ranks and hosts that did not answer, then ``MPI_Abort`` with
:data:`~hpcfl.errors.EXIT_PEER_LOST` by the command's error path, and the line appended to the run's
``PEER_LOST``). A side that holds a majority of the ranks (a tie: the side of rank 0) asks for the
requeue; any other side cannot tell a dead majority from a cut link, so it says what it saw and that
it ends without requeueing (:func:`lost_message`). Every other rank waits for its speaker's abort.
Before the side channel is up, the start-up exchange is a roll call (:meth:`MPIComm._roll_call`):
rank 0 gathers every rank's part point to point, so a rank lost there is named all the same.
"""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np
import torch

from hpcfl.comm.deadline import KNOCK_TRIES, CommDeadline, poll
from hpcfl.comm.liveness import Address, Beacon, bind_address, host_addresses, knock, new_secret
from hpcfl.errors import EXIT_PEER_LOST, CommError, PeerLostError

SPEAKER_WAIT_S = 30.0  # a rank that is not its side's speaker waits this long for the speaker's abort
_ROLL_TAG, _VERDICT_TAG = 0x6870, 0x686F  # the start-up roll calls' messages (the n-th: _ROLL_TAG + n)
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


def lost_message(lost: list[int], hosts: list[str], cause: str, side: list[int] | None = None) -> str:
    """The one line that names the lost ranks, grouped by host, and ``cause`` (e.g. "did not answer
    within 300 s"). ``side``: the ranks that answered, when they are not a majority (a tie without
    rank 0 included): the line then says that this side ends the job without requeueing it."""
    groups: dict[str, list[int]] = {}
    for r in lost:
        groups.setdefault(hosts[r] if r < len(hosts) else "unknown", []).append(r)
    parts = [
        f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))} (host {host})"
        for host, ranks in groups.items()
    ]
    who = parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"
    why = (
        "its node was lost or its link cut" if len(lost) == 1 else "their nodes were lost or their links cut"
    )
    if side is None:
        return f"{who} {cause} ({why}); ending the job — resume with --resume"
    size = len(lost) + len(side)
    answered = f"{'rank' if len(side) == 1 else 'ranks'} {', '.join(map(str, side))}"
    share = (
        f"half of the {size} ranks, without rank 0"
        if 2 * len(side) == size
        else f"a minority of the {size} ranks"
    )
    return (
        f"{who} {cause} ({why}); only {answered} answered, {share}, "
        "so this side ends the job without requeueing it (the other side may still run) — resume with "
        "--resume once the job has ended"
    )


class _ThreadRequest:
    """A blocking call on a helper thread, seen as a request: ``Test`` is True once it returned."""

    def __init__(self, thread: threading.Thread) -> None:
        self._thread = thread

    def Test(self) -> bool:  # noqa: N802 - mpi4py's request interface
        return not self._thread.is_alive()


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
        self._cuda_aware = _cuda_aware(self._mpi)
        self.deadline = CommDeadline.given(timeout)  # read by the collectives and the run record
        self._lost: PeerLostError | None = None
        self._beacon: Beacon | None = None  # the liveness side channel (hpcfl.comm.liveness)
        self._beacons: dict[int, Address] = {}
        self.hosts: list[str] = []
        self._coordinators: tuple[int, int | None] = (0, None)
        self._roll_calls = 0
        # the start-up exchange, every step under the deadline: a rank lost here ends the job too
        secret = new_secret() if self.rank == 0 else b""  # shared while every rank is alive
        every = self._roll_call((socket.gethostname(), host_addresses(), secret))
        self.hosts = [str(h) for h, _, _ in every]
        self._coordinators = coordinators(self.hosts)
        beacon = Beacon(self.rank, every[0][2], bind_address(self.rank, self.hosts, [a for _, a, _ in every]))
        try:
            self._beacons = dict(enumerate(self._roll_call(beacon.address)))
        except BaseException:
            beacon.close()
            raise
        beacon.set_peers(self._beacons)
        self._beacon = beacon
        self.local_rank, self.local_size = self._node_rank()  # the side channel answers from here on
        if not _ACTIVE:  # runs before mpi4py's own finalize at exit (registered after it)
            atexit.register(_close_all)
        _ACTIVE.append(self)

    def _roll_call(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (rank order), gathered by rank 0 and sent back to each rank, point
        to point under the deadline: the start-up exchange, before the side channel is up.

        Unlike a collective that misses its deadline, a roll call knows who is missing: rank 0 names
        the ranks whose value did not come (their hosts when known) and tells the ranks that did
        that it speaks; a rank that hears neither the values nor that from rank 0 names rank 0 (the
        lowest such rank first: each waits its rank's turn, so the first one's abort ends the rest)."""
        limit = self.deadline.seconds  # no side channel yet: slow and gone look alike here
        until = time.monotonic() + limit
        cause = f"did not answer within {_seconds(limit)} s"
        comm = self._comm
        if self.size == 1:
            return [value]
        self._roll_calls += 1
        tag = _ROLL_TAG + self._roll_calls
        try:
            if self.rank == 0:
                got: dict[int, Any] = {0: value}
                status = self._mpi.Status()

                def gathered() -> bool:
                    while len(got) < self.size:
                        msg = comm.improbe(source=self._mpi.ANY_SOURCE, tag=tag, status=status)
                        if msg is None:
                            return False
                        got[status.Get_source()] = msg.recv()
                    return True

                if not poll(gathered, until):
                    # they wait for the values: tell them rank 0 speaks
                    told = [comm.isend(None, dest=r, tag=_VERDICT_TAG) for r in got if r]  # noqa: F841
                    missing = [r for r in range(self.size) if r not in got]
                    self._lost = PeerLostError(lost_message(missing, self._known_hosts(), cause))
                    raise self._lost
                every = [got[r] for r in range(self.size)]
                sends = [comm.isend(every, dest=r, tag=tag) for r in range(1, self.size)]
                if not poll(lambda: self._mpi.Request.Testall(sends), until + limit):
                    missing = [r for r, q in enumerate(sends, start=1) if not q.Test()]
                    self._lost = PeerLostError(lost_message(missing, self._known_hosts(), cause))
                    raise self._lost
                return every
            sent = comm.isend(value, dest=0, tag=tag)
            box: list[Any] = []

            def answered() -> bool:
                if (msg := comm.improbe(source=0, tag=tag)) is not None:
                    box.append(msg.recv())
                return bool(box)

            if poll(answered, until):
                sent.Wait()  # rank 0 has it
                return box[0]
        except self._mpi.Exception:  # a peer's failure reported by MPI: who is unknown
            if self.rank == 0:
                self._lost = PeerLostError(
                    "a rank stopped answering during the start-up exchange (MPI reported a failure); "
                    "ending the job — resume with --resume"
                )
                raise self._lost from None
        if self.rank != 0:
            grace = max(1.0, self.deadline.probe_s)
            if poll(lambda: comm.iprobe(source=0, tag=_VERDICT_TAG), time.monotonic() + grace):
                sys.stderr.flush()
                time.sleep(SPEAKER_WAIT_S)  # rank 0 speaks; its abort ends this process
                os._exit(EXIT_PEER_LOST)
            time.sleep(min(self.rank - 1, 8) * 1.0)  # the lowest rank left speaks first
        self._lost = PeerLostError(lost_message([0], self._known_hosts(), cause))
        raise self._lost

    def _known_hosts(self) -> list[str]:
        """Each rank's host as far as the start-up exchange got (``unknown`` before it)."""
        return self.hosts if len(self.hosts) == self.size else ["unknown"] * self.size

    def _node_rank(self) -> tuple[int, int]:
        """(This rank's number, the rank count) on its node's shared-memory communicator.

        ``Split_type`` has no nonblocking form: it runs on a helper thread (mpi4py initialises MPI
        with ``MPI_THREAD_MULTIPLE``) while this thread waits under the deadline; where the library
        gives less, a bounded barrier first makes sure every rank reached it."""
        if self.size == 1:
            return 0, 1
        if self._mpi.Query_thread() < self._mpi.THREAD_MULTIPLE:
            self.barrier()
            node = self._comm.Split_type(self._mpi.COMM_TYPE_SHARED, key=self.rank)
            result = (node.Get_rank(), node.Get_size())
            node.Free()
            return result
        out: list[Any] = []

        def split() -> None:
            try:
                node = self._comm.Split_type(self._mpi.COMM_TYPE_SHARED, key=self.rank)
                out.append((node.Get_rank(), node.Get_size()))
                node.Free()
            except self._mpi.Exception as err:
                out.append(err)

        worker = threading.Thread(target=split, name="hpcfl-split-type", daemon=True)
        self._collective(lambda: (worker.start(), _ThreadRequest(worker))[1])
        if isinstance(out[0], BaseException):
            self._end(self.deadline.seconds, cause="stopped answering (MPI reported a failure)")
        return out[0]

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
        if self._beacon is not None:
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
        missing = {r for r in range(self.size) if r != self.rank}
        if self._beacon is None:  # before the side channel is up nobody can be asked
            return missing
        for _ in range(KNOCK_TRIES):
            missing = self._beacon.ping({r: self._beacons[r] for r in missing}, self.deadline.probe_s)
            if not missing:
                break
            self._heard_ping(self.deadline.seconds)  # another rank may already be ending the job
        return missing

    def _heard_ping(self, limit: float) -> None:
        """While waiting: a knock on this rank's beacon (not a ping) means another rank found a
        rank lost, or MPI failed it; join the count."""
        if self._beacon is not None and self._beacon.waiting():
            self._end(limit, cause=f"did not answer within {_seconds(limit)} s")

    def _end(self, limit: float, cause: str) -> NoReturn:
        """Find this rank's side (the ranks it reaches), then speak for it and end the job, or wait
        for the side's speaker to do so.

        The knocks go outside MPI (:mod:`hpcfl.comm.liveness`): a send to a rank on a vanished host
        can block inside MPI itself."""
        window = self.deadline.probe_s
        side, speaker = self._side(window)
        if self.rank == speaker:
            lost = [r for r in range(self.size) if r not in side]
            if not lost:
                message = (
                    f"a collective failed although every rank answered the count ({cause}); ending "
                    "the job — resume with --resume"
                )
                self._lost = PeerLostError(message)
            elif 2 * len(side) > self.size or (2 * len(side) == self.size and 0 in side):
                self._lost = PeerLostError(lost_message(lost, self.hosts, cause))
            else:
                message = lost_message(lost, self.hosts, cause, side=sorted(side))
                self._lost = PeerLostError(message, requeue=False)
            raise self._lost
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(max(SPEAKER_WAIT_S, 2 * window))  # the speaker's abort ends this process
        os._exit(EXIT_PEER_LOST)

    def _side(self, window: float) -> tuple[set[int], int]:
        """(The ranks this rank reaches within about ``window`` seconds, itself included; the rank
        that speaks for them.)

        A coordinator knocks on every rank, every other rank on the coordinators; each knocked
        rank's beacon thread replies at once, whatever its main thread is doing. A rank that hears
        no coordinator knocks on every rank as well, so a side without coordinators still learns
        its members (and its lowest rank speaks)."""
        coords = {c for c in self._coordinators if c is not None}
        others = {r: a for r, a in self._beacons.items() if r != self.rank}
        targets = others if self.rank in coords else {c: others[c] for c in coords if c in others}
        heard = self._listen(targets, window)
        if not (heard & coords) and self.rank not in coords:
            heard |= self._listen(others, window)
        side = {self.rank} | {r for r in heard if 0 <= r < self.size}
        first, second = self._coordinators
        if first in side:
            return side, first
        if second is not None and second in side:
            return side, second
        return side, min(side)

    def _listen(self, targets: dict[int, Address], window: float) -> set[int]:
        """Knock on ``targets``; the ranks heard from (knocks and replies) within ``window``."""
        assert self._beacon is not None
        until = time.monotonic() + window
        knock(targets, self.rank, window / 2, self._beacon.secret)
        return self._beacon.heard(max(0.0, until - time.monotonic()), enough=len(targets))

    def __repr__(self) -> str:
        return f"MPIComm(rank={self.rank}, size={self.size}, local_rank={self.local_rank})"
