"""A stranger on the host who knows where a rank's beacon listens but not the job's secret.

The tests of :mod:`hpcfl.comm.liveness` run it as a separate process (``python -m
tests.stranger ACTION HOST PORT ...``) against a healthy job: the job must neither end nor
change its results, and a frozen rank must still be found. Every action is bounded in time and
count, talks to one loopback (or test-namespace) address, and closes what it opened. Standard
library and the beacon's message layout only.

Actions (each prints one summary line ``ACTION N`` with the number of messages sent or connections
held):

- ``knock HOST PORT SENDER``: forged knocks (kind 0) claiming to come from rank ``SENDER``, in the
  current 53-byte layout with a random proof and in the 5-byte layout the beacon once trusted;
- ``reply HOST PORT SENDER SECONDS``: forged replies (kind 1) from ``SENDER``, again and again for
  ``SECONDS`` (a frozen rank made to look alive);
- ``garbage HOST PORT``: random and oversized payloads, and connections closed half-way;
- ``flood HOST PORT COUNT SECONDS``: ``COUNT`` idle connections opened (non-blocking, within
  ``SECONDS``) and held for ``SECONDS``, then closed.
"""

from __future__ import annotations

import errno
import os
import resource
import socket
import struct
import sys
import time

from hpcfl.comm.liveness import KNOCK, MESSAGE_BYTES, NONCE_BYTES, REPLY

_OLD = struct.Struct("!iB")  # the unsigned layout of before: sender, kind


def forged(sender: int, kind: int) -> bytes:
    """A message in the beacon's layout with a random nonce and a random (so wrong) proof."""
    head = struct.pack(f"!iB{NONCE_BYTES}s", sender, kind, os.urandom(NONCE_BYTES))
    return head + os.urandom(MESSAGE_BYTES - len(head))


def send(host: str, port: int, payload: bytes, timeout: float = 1.0) -> bool:
    """Connect, send ``payload``, close; whether it was sent."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(payload)
        return True
    except OSError:
        return False


def knocks(host: str, port: int, sender: int) -> int:
    payloads = [forged(sender, KNOCK) for _ in range(20)] + [_OLD.pack(sender, KNOCK)] * 5
    return sum(send(host, port, p) for p in payloads)


def replies(host: str, port: int, sender: int, seconds: float) -> int:
    sent, until = 0, time.monotonic() + seconds
    while time.monotonic() < until:
        sent += send(host, port, forged(sender, REPLY)) + send(host, port, _OLD.pack(sender, REPLY))
        time.sleep(0.01)
    return sent


def garbage(host: str, port: int) -> int:
    payloads = [os.urandom(n) for n in (1, 4, 5, 52, 53, 54, 4096, 1 << 20)] + [b"\0" * MESSAGE_BYTES]
    sent = sum(send(host, port, p) for p in payloads)
    for n in (1, 20, 52):  # half a message, then silence until the beacon gives up
        try:
            s = socket.create_connection((host, port), timeout=1.0)
            s.sendall(os.urandom(n))
            sent += 1
            s.close()
        except OSError:
            pass
    return sent


def flood(host: str, port: int, count: int, seconds: float) -> int:
    """Open ``count`` idle connections within ``seconds``, hold them ``seconds``, close them;
    the number that connected."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, count + 64)), hard))
    held: list[socket.socket] = []
    until = time.monotonic() + seconds
    try:
        while len(held) < count and time.monotonic() < until:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            code = s.connect_ex((host, port))
            if code not in (0, errno.EINPROGRESS):
                s.close()
                time.sleep(0.001)  # the backlog is full: let the beacon take some
                continue
            held.append(s)
        connected = sum(s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0 for s in held)
        time.sleep(max(0.0, until - time.monotonic()) + seconds)
        return connected
    finally:
        for s in held:
            s.close()


def main(argv: list[str]) -> int:
    action, host, port = argv[0], argv[1], int(argv[2])
    if action == "knock":
        n = knocks(host, port, int(argv[3]))
    elif action == "reply":
        n = replies(host, port, int(argv[3]), float(argv[4]))
    elif action == "garbage":
        n = garbage(host, port)
    elif action == "flood":
        n = flood(host, port, int(argv[3]), float(argv[4]))
    else:
        print(f"unknown action {action!r}", file=sys.stderr)
        return 2
    print(f"{action} {n}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
