"""Who still answers, learned outside MPI: one small TCP listener per rank (the rank's beacon).

Why not MPI itself: once a host has vanished, a send to one of its ranks may block inside the MPI
library for as long as the transport keeps trying to (re)connect — measured on the emulated nodes
with MPICH's OFI/TCP netmod: still blocked 6 s after a node was killed (the connection had been
reset), and minutes behind a cut link (TCP's SYN retries). A plain socket with a non-blocking
connect gives a bounded answer: accepted, refused, or silent until the time is up.

Each rank listens on an ephemeral port on every interface; the ranks exchange their addresses once
at start-up (through the communicator, while everyone is alive). When a collective's deadline
passes, a rank connects to the ranks it must tell and sends its rank number (4 bytes); a listener
collects the numbers it receives. Nothing else ever travels on these sockets. Standard library only.
"""

from __future__ import annotations

import errno
import fcntl
import selectors
import socket
import struct
import time

Address = tuple[tuple[str, ...], int]  # (the host's IPv4 addresses, the port)

_SIOCGIFADDR = 0x8915
_BATCH = 256  # connections in flight at once (file descriptors are finite)


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
    """This rank's listener: ranks whose deadline passed connect to it and send their number."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("0.0.0.0", 0))
        self._sock.listen(1024)
        self._sock.setblocking(False)
        self.address: Address = (host_addresses(), int(self._sock.getsockname()[1]))

    def waiting(self) -> bool:
        """Whether some rank has knocked (without taking its number): cheap enough to poll."""
        sel = selectors.DefaultSelector()
        try:
            sel.register(self._sock, selectors.EVENT_READ)
            return bool(sel.select(timeout=0))
        finally:
            sel.close()

    def heard(self, seconds: float, *, enough: int | None = None) -> set[int]:
        """The rank numbers received within ``seconds`` (stops early once ``enough`` are in)."""
        ranks: set[int] = set()
        until = time.monotonic() + seconds
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ, None)
        try:
            while (enough is None or len(ranks) < enough) and (left := until - time.monotonic()) > 0:
                for key, _ in sel.select(timeout=min(left, 0.05)):
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
                        chunk = conn.recv(4 - len(buf))  # type: ignore[union-attr]
                    except OSError:
                        chunk = b""
                    buf += chunk
                    if len(buf) == 4 or not chunk:
                        if len(buf) == 4:
                            ranks.add(struct.unpack("!i", bytes(buf))[0])
                        sel.unregister(conn)
                        conn.close()  # type: ignore[union-attr]
        finally:
            for key in list(sel.get_map().values()):
                if key.fileobj is not self._sock:
                    key.fileobj.close()  # type: ignore[union-attr]
            sel.close()
        return ranks

    def close(self) -> None:
        self._sock.close()


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


def knock(targets: dict[int, Address], me: int, seconds: float) -> set[int]:
    """Tell each target rank ``me``'s number; return the ranks that took it within ``seconds``.

    Non-blocking connects, in batches; a target's addresses are tried in order (a refused or
    unreachable one moves on to the next)."""
    told: set[int] = set()
    until = time.monotonic() + seconds
    payload = struct.pack("!i", me)
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
