"""Who still answers, learned outside MPI: one small TCP listener per rank (the rank's beacon).

Why not MPI itself: once a host has vanished, a send to one of its ranks may block inside the MPI
library for as long as the transport keeps trying to (re)connect — measured on the emulated nodes
with MPICH's OFI/TCP netmod: still blocked 6 s after a node was killed (the connection had been
reset), and minutes behind a cut link (TCP's SYN retries). A plain socket with a non-blocking
connect gives a bounded answer: accepted, refused, or silent until the time is up.

Two conversations use them. While a collective waits past its deadline, the waiting rank pings
every other rank (:meth:`Beacon.ping`): the serving thread (a daemon) of a pinged rank answers with
a pong and records nothing, so a rank that is only slow keeps the collective waiting. When the job
must end, a rank knocks on the beacons of the ranks it must tell; the serving thread of a knocked
rank records the knock (its rank joins the count) and knocks back at once with a reply. So a rank
answers whatever its main thread is doing — computing a long local update included — as long as its
process runs and its host is reachable; a stopped process or a vanished host stays silent. Nothing
else ever travels on these sockets. Standard library only.

**The side channel answers only the job** (a stranger on the host, or in another network
namespace, must not be able to end a healthy job, make a frozen rank look alive, or exhaust a
rank's file descriptors):

- *Secret.* Rank 0 draws ``secrets.token_bytes(32)`` at start-up and broadcasts it over MPI while
  every rank is alive (:class:`hpcfl.comm.mpi.MPIComm`); it never leaves the job's processes.
- *Message* (:data:`MESSAGE_BYTES` = 53 bytes, one per connection)::

      sender rank (int32, big-endian) | kind (1 byte: 0 knock, 1 reply, 2 ping, 3 pong)
      | nonce (16 random bytes)
      | HMAC-SHA256(secret, b"hpcfl-beacon-v1" | sender | receiver | kind | nonce)   (32 bytes)

  The proof covers the receiver's rank, so a message meant for one rank proves nothing to another;
  it covers the kind, so a knock cannot be turned into a reply (or a ping into a pong) or back; a fresh nonce per message
  and a receiver that remembers the nonces it accepted make a replayed message count for nothing.
- *Receiving.* The serving thread reads at most :data:`MESSAGE_BYTES` from a connection, gives it
  :data:`CONNECTION_S` to arrive, and drops whatever fails the check (``hmac.compare_digest``)
  unread: no record, no reply. At most :data:`MAX_CONNECTIONS` connections are open at once; a new
  one evicts the oldest (an idle stranger's, in a flood), and a knock is read as it is accepted, so
  a flood neither exhausts the rank's descriptors (its metrics file and checkpoints still open) nor
  shuts a real knock out.
- *Address.* The listener binds one address, the one the ranks exchange (:func:`bind_address`:
  loopback when every rank shares this host, else the address this host routes to the other hosts
  from), never every interface.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import secrets
import selectors
import socket
import struct
import threading
import time
from collections import Counter, OrderedDict

Address = tuple[tuple[str, ...], int]  # (the addresses to try, in order, the port)

KNOCK, REPLY = 0, 1  # the job ends: join the count / counted
PING, PONG = 2, 3  # are you there (a collective waits past its deadline) / here, keep waiting
SECRET_BYTES = 32
NONCE_BYTES = 16
_HEAD = struct.Struct(f"!iB{NONCE_BYTES}s")  # the sender's rank, the kind, the nonce
_PROVED = struct.Struct("!iiB")  # sender, receiver, kind: what the proof covers besides the nonce
_TAG = b"hpcfl-beacon-v1"
MESSAGE_BYTES = _HEAD.size + hashlib.sha256().digest_size
MAX_CONNECTIONS = 64  # open connections per listener (the oldest is evicted beyond it)
CONNECTION_S = 2.0  # a connection's message must arrive within this
_NONCES_KEPT = 1 << 16  # accepted nonces remembered against replays (only valid messages count)
_SIOCGIFADDR = 0x8915
_BATCH = 256  # connections in flight at once (file descriptors are finite)
REPLY_S = 1.0  # how long a serving thread tries to reach a knocker with its reply


def new_secret() -> bytes:
    """A fresh per-job secret (drawn by rank 0, shared over MPI)."""
    return secrets.token_bytes(SECRET_BYTES)


def _proof(secret: bytes, sender: int, receiver: int, kind: int, nonce: bytes) -> bytes:
    return hmac.new(secret, _TAG + _PROVED.pack(sender, receiver, kind) + nonce, hashlib.sha256).digest()


def seal(secret: bytes, sender: int, receiver: int, kind: int) -> bytes:
    """One message from ``sender`` to ``receiver``, with a fresh nonce and its proof."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return _HEAD.pack(sender, kind, nonce) + _proof(secret, sender, receiver, kind, nonce)


def open_sealed(secret: bytes, receiver: int, data: bytes) -> tuple[int, int, bytes] | None:
    """(sender, kind, nonce) of a message addressed to ``receiver`` whose proof holds, else None."""
    if len(data) != MESSAGE_BYTES:
        return None
    sender, kind, nonce = _HEAD.unpack(data[: _HEAD.size])
    if kind not in (KNOCK, REPLY, PING, PONG):
        return None
    if not hmac.compare_digest(data[_HEAD.size :], _proof(secret, sender, receiver, kind, nonce)):
        return None
    return sender, kind, nonce


def host_addresses() -> tuple[str, ...]:
    """This host's IPv4 addresses, loopback last."""
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


def _route_source(destination: str) -> str | None:
    """The local address this host would send from to ``destination`` (no packet is sent)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((destination, 9))
        return str(probe.getsockname()[0])
    except OSError:
        return None
    finally:
        probe.close()


def bind_address(me: int, hosts: list[str], addresses: list[tuple[str, ...]]) -> str:
    """The one address rank ``me``'s listener binds, from every rank's host name and addresses:
    loopback when all ranks share this host, else the local address the kernel routes from to most
    of the other hosts (ties: the first such host's), else this host's first address. An address
    another host shares with this one (a container bridge's, 172.17.0.1 on every Docker host) says
    nothing about the route between them and is skipped."""
    others = {host: addrs for host, addrs in zip(hosts, addresses, strict=True) if host != hosts[me]}
    if not others:
        return "127.0.0.1"
    mine = set(addresses[me])
    sources: list[str] = []
    for addrs in others.values():
        outside = [a for a in addrs if not a.startswith("127.") and a not in mine]
        if outside and (src := _route_source(outside[0])) is not None and not src.startswith("127."):
            sources.append(src)
    if sources:
        return Counter(sources).most_common(1)[0][0]
    return addresses[me][0]


class Beacon:
    """This rank's listener on ``host`` and the daemon thread that serves it: records who knocked
    (with a valid proof of ``secret``) and answers every such knock with a reply (once
    :meth:`set_peers` has told it where the ranks are)."""

    def __init__(self, rank: int, secret: bytes, host: str = "127.0.0.1") -> None:
        self.rank = rank
        self.secret = secret
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self._sock.listen(1024)
        self._sock.setblocking(False)
        self.address: Address = ((host,), int(self._sock.getsockname()[1]))
        self._peers: dict[int, Address] = {}
        self._knocked: set[int] = set()  # ranks whose knock or reply arrived
        self._ponged: set[int] = set()  # ranks whose pong arrived since the last ping
        self._nonces: OrderedDict[bytes, None] = OrderedDict()
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

    def ping(self, targets: dict[int, Address], seconds: float) -> set[int]:
        """The target ranks that did not answer a ping within ``seconds`` (each serving thread
        answers whatever its rank's main thread does; only a stopped process or an unreachable host
        stays silent). Called by the main thread only."""
        until = time.monotonic() + seconds
        with self._lock:
            self._ponged.clear()
        knock(targets, self.rank, seconds / 2, self.secret, kind=PING)
        while True:
            with self._lock:
                missing = set(targets) - self._ponged
            if not missing or time.monotonic() >= until:
                return missing
            time.sleep(0.002)

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

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2)
        self._sock.close()

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ, None)
        open_: OrderedDict[socket.socket, tuple[float, bytearray]] = OrderedDict()  # oldest first

        def drop(conn: socket.socket) -> None:
            open_.pop(conn, None)
            try:
                sel.unregister(conn)
            except (KeyError, ValueError):
                pass
            conn.close()

        def read(conn: socket.socket, buf: bytearray) -> bool:
            """Read what has arrived; True when the connection is done with (message or not)."""
            try:
                chunk = conn.recv(MESSAGE_BYTES - len(buf))
            except BlockingIOError:
                return False
            except OSError:
                return True
            buf += chunk
            if len(buf) == MESSAGE_BYTES:
                self._received(bytes(buf))
                return True
            return not chunk

        try:
            while not self._closed.is_set():
                for key, _ in sel.select(timeout=0.2):
                    if key.data is None:  # the listener: take every pending connection
                        while True:
                            try:
                                conn, _ = self._sock.accept()
                            except OSError:
                                break
                            conn.setblocking(False)
                            buf = bytearray()
                            if read(conn, buf):  # a knock is usually in already
                                conn.close()
                                continue
                            if len(open_) >= MAX_CONNECTIONS:
                                drop(next(iter(open_)))
                            open_[conn] = (time.monotonic() + CONNECTION_S, buf)
                            sel.register(conn, selectors.EVENT_READ, buf)
                        continue
                    conn = key.fileobj  # type: ignore[assignment]
                    if conn in open_ and read(conn, key.data):
                        drop(conn)
                now = time.monotonic()
                while open_ and next(iter(open_.values()))[0] <= now:
                    drop(next(iter(open_)))
        except (OSError, ValueError):  # closed under us at shutdown
            return
        finally:
            for conn in list(open_):
                conn.close()
            sel.close()

    def _received(self, data: bytes) -> bool:
        """Act on one message if it holds the job's proof and was not seen before (then True)."""
        opened = open_sealed(self.secret, self.rank, data)
        if opened is None:
            return False  # no proof of the job's secret: dropped unread
        sender, kind, nonce = opened
        if sender not in self._peers or sender == self.rank:
            return False
        with self._lock:
            if nonce in self._nonces:
                return False  # a replay
            self._nonces[nonce] = None
            if len(self._nonces) > _NONCES_KEPT:
                self._nonces.popitem(last=False)
            if kind == PONG:
                self._ponged.add(sender)
            elif kind != PING:
                self._knocked.add(sender)
        if kind == PING:
            knock({sender: self._peers[sender]}, self.rank, REPLY_S, self.secret, kind=PONG)
        elif kind == KNOCK:
            knock({sender: self._peers[sender]}, self.rank, REPLY_S, self.secret, kind=REPLY)
        return True


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


def knock(
    targets: dict[int, Address], me: int, seconds: float, secret: bytes, *, kind: int = KNOCK
) -> set[int]:
    """Send ``me``'s sealed message to each target rank's beacon; return the ranks that took it
    within ``seconds`` (a beacon that takes a knock answers with a reply of its own).

    Non-blocking connects, in batches; a target's addresses are tried in order (a refused or
    unreachable one moves on to the next)."""
    told: set[int] = set()
    until = time.monotonic() + seconds
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
                            if s.send(seal(secret, me, rank, kind)) == MESSAGE_BYTES:
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
