"""Who still answers, learned outside MPI: one small TCP listener per rank (the rank's beacon).

Why not MPI itself: once a host has vanished, a send to one of its ranks may block inside the MPI
library for as long as the transport keeps trying to (re)connect — measured on the emulated nodes
with MPICH's OFI/TCP netmod: still blocked 6 s after a node was killed (the connection had been
reset), and minutes behind a cut link (TCP's SYN retries). A plain socket with a non-blocking
connect gives a bounded answer: accepted, refused, or silent until the time is up.

Each rank listens on an ephemeral port on every interface, served by a daemon thread; the ranks
exchange their addresses once at start-up (through the communicator, while everyone is alive).
Two conversations use them. While a collective waits past its deadline, the waiting rank pings
every other rank (:meth:`Beacon.ping`): the serving thread of a pinged rank answers with a pong and
records nothing, so a rank that is only slow keeps the collective waiting. When the job must end,
a rank knocks on the beacons of the ranks it must tell (its rank number, 4 bytes, and a kind byte);
the serving thread of a knocked rank records the knock (its rank joins the count) and knocks back
at once with a reply. So a rank answers whatever its main thread is doing — computing a long local
update included — as long as its process runs and its host is reachable; a stopped process or a
vanished host stays silent. Nothing else ever travels on these sockets. Standard library only.
"""

from __future__ import annotations

import errno
import fcntl
import selectors
import socket
import struct
import threading
import time

Address = tuple[tuple[str, ...], int]  # (the host's IPv4 addresses, the port)

KNOCK, REPLY = 0, 1  # the job ends: join the count / counted
PING, PONG = 2, 3  # are you there (a collective waits past its deadline) / here, keep waiting
_MESSAGE = struct.Struct("!iB")  # the sender's rank, the kind
_SIOCGIFADDR = 0x8915
_BATCH = 256  # connections in flight at once (file descriptors are finite)
REPLY_S = 1.0  # how long a serving thread tries to reach a knocker with its reply


def host_addresses() -> tuple[str, ...]:
    """This host's IPv4 addresses, loopback last (a peer on another host tries them in order)."""
    found: list[str] = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on this interface
                continue
            found.append(socket.inet_ntoa(reply[20:24]))
    finally:
        probe.close()
    return tuple(sorted(set(found), key=lambda a: (a.startswith("127."), a))) or ("127.0.0.1",)


class Beacon:
    """This rank's listener and the daemon thread that serves it: records who knocked and
    answers every knock with a reply (once :meth:`set_peers` has told it where the ranks are)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("0.0.0.0", 0))
        self._sock.listen(1024)
        self._sock.setblocking(False)
        self.address: Address = (host_addresses(), int(self._sock.getsockname()[1]))
        self._peers: dict[int, Address] = {}
        self._knocked: set[int] = set()  # ranks whose knock or reply arrived
        self._ponged: set[int] = set()  # ranks whose pong arrived since the last ping
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hpcfl-beacon", daemon=True)
        self._thread.start()

    def set_peers(self, peers: dict[int, Address]) -> None:
        """Where every rank's beacon listens (from the start-up exchange): replies go there."""
        self._peers = dict(peers)

    def waiting(self) -> bool:
        """Whether some rank has knocked: cheap enough to poll between MPI tests."""
        with self._lock:
            return bool(self._knocked)

    def heard(self, seconds: float, *, enough: int | None = None) -> set[int]:
        """The ranks heard from (knocks and replies) after waiting up to ``seconds``, or as soon
        as ``enough`` of them are in."""
        until = time.monotonic() + seconds
        while True:
            with self._lock:
                got = set(self._knocked)
            if (enough is not None and len(got) >= enough) or time.monotonic() >= until:
                return got
            time.sleep(0.002)

    def ping(self, targets: dict[int, Address], seconds: float) -> set[int]:
        """The target ranks that did not answer a ping within ``seconds`` (each serving thread
        answers whatever its rank's main thread does; only a stopped process or an unreachable host
        stays silent). Called by the main thread only."""
        until = time.monotonic() + seconds
        with self._lock:
            self._ponged.clear()
        knock(targets, self.rank, seconds / 2, kind=PING)
        while True:
            with self._lock:
                missing = set(targets) - self._ponged
            if not missing or time.monotonic() >= until:
                return missing
            time.sleep(0.002)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2)
        self._sock.close()

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ, None)
        try:
            while not self._closed.is_set():
                for key, _ in sel.select(timeout=0.2):
                    if key.data is None:
                        try:
                            conn, _ = self._sock.accept()
                        except OSError:
                            continue
                        conn.setblocking(False)
                        sel.register(conn, selectors.EVENT_READ, bytearray())
                        continue
                    conn, buf = key.fileobj, key.data
                    try:
                        chunk = conn.recv(_MESSAGE.size - len(buf))  # type: ignore[union-attr]
                    except OSError:
                        chunk = b""
                    buf += chunk
                    if len(buf) == _MESSAGE.size or not chunk:
                        sel.unregister(conn)
                        conn.close()  # type: ignore[union-attr]
                        if len(buf) == _MESSAGE.size:
                            self._received(*_MESSAGE.unpack(bytes(buf)))
        except (OSError, ValueError):  # closed under us at shutdown
            return
        finally:
            sel.close()

    def _received(self, sender: int, kind: int) -> None:
        if sender not in self._peers:
            return  # not a rank of this job
        if kind == PING:
            knock({sender: self._peers[sender]}, self.rank, REPLY_S, kind=PONG)
            return
        if kind == PONG:
            with self._lock:
                self._ponged.add(sender)
            return
        with self._lock:
            self._knocked.add(sender)
        if kind == KNOCK:
            knock({sender: self._peers[sender]}, self.rank, REPLY_S, kind=REPLY)


def _connect(sel: selectors.BaseSelector, rank: int, addresses: list[str], port: int) -> socket.socket | None:
    """Start a non-blocking connect to the first address that does not fail at once (consumed from
    ``addresses``), registered with ``sel``; None when none is left."""
    while addresses:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        if s.connect_ex((addresses.pop(0), port)) in (0, errno.EINPROGRESS):
            sel.register(s, selectors.EVENT_WRITE, rank)
            return s
        s.close()
    return None


def knock(targets: dict[int, Address], me: int, seconds: float, *, kind: int = KNOCK) -> set[int]:
    """Send ``me``'s number to each target rank's beacon; return the ranks that took it within
    ``seconds`` (a beacon that takes a knock answers with a reply of its own).

    Non-blocking connects, in batches; a target's addresses are tried in order (a refused or
    unreachable one moves on to the next)."""
    told: set[int] = set()
    until = time.monotonic() + seconds
    payload = _MESSAGE.pack(me, kind)
    items = list(targets.items())
    for start in range(0, len(items), _BATCH):
        batch = dict(items[start : start + _BATCH])
        left_to_try = {rank: list(addrs) for rank, (addrs, _) in batch.items()}
        sel = selectors.DefaultSelector()
        live: dict[int, socket.socket] = {}
        try:
            for rank, (_, port) in batch.items():
                if (s := _connect(sel, rank, left_to_try[rank], port)) is not None:
                    live[rank] = s
            while live and (left := until - time.monotonic()) > 0:
                for key, _ in sel.select(timeout=min(left, 0.05)):
                    rank = key.data
                    s = live.pop(rank)
                    sel.unregister(s)
                    if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                        try:
                            s.send(payload)
                            told.add(rank)
                        except OSError:
                            pass
                        s.close()
                        continue
                    s.close()
                    if (again := _connect(sel, rank, left_to_try[rank], batch[rank][1])) is not None:
                        live[rank] = again
        finally:
            for s in live.values():
                s.close()
            sel.close()
        if time.monotonic() >= until:
            break
    return told
