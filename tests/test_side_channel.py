"""The side channel answers only the job (issue 61): a stranger on the host who knows where a rank's
beacon listens but not the job's secret can neither end a healthy job, nor change its results, nor
make a frozen rank look alive, nor exhaust a rank's file descriptors.

The stranger is a separate process (:mod:`tests.stranger`) on loopback, bounded in time and
count; the jobs are real ``mpiexec`` jobs (the mpich wheel's), as in tests/test_peer_lost.py.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcfl.comm.liveness import (
    KNOCK,
    MAX_CONNECTIONS,
    MESSAGE_BYTES,
    REPLY,
    Beacon,
    bind_address,
    knock,
    new_secret,
    open_sealed,
    seal,
)
from hpcfl.errors import EXIT_PEER_LOST
from tests.helpers import MPIEXEC, REPO, repo_env
from tests.stranger import forged
from tests.test_peer_lost import HOST, TIMEOUT_S, _rank_process

PROGRAM = REPO / "tests" / "mpi_programs" / "peer_lost.py"


def _stranger(*args: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.stranger", *map(str, args)],
        env=repo_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _done(proc: subprocess.Popen, timeout: float = 60) -> int:
    """The count the stranger reports (it ends on its own, bounded in time)."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return int(out.split()[-1])


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def pair():
    """Two beacons of one job (ranks 0 and 1) on loopback, each knowing where the other listens."""
    secret = new_secret()
    beacons = [Beacon(0, secret), Beacon(1, secret)]
    peers = {b.rank: b.address for b in beacons}
    for b in beacons:
        b.set_peers(peers)
    yield beacons
    for b in beacons:
        b.close()


def _send(port: int, payload: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(payload)


def test_only_a_message_with_the_jobs_proof_counts(pair) -> None:
    zero, one = pair
    port = one.address[1]
    other_job = new_secret()
    strangers = [
        b"\x00\x00\x00\x00\x00",  # the old unsigned knock from rank 0
        forged(0, KNOCK),
        forged(0, REPLY),
        seal(other_job, 0, 1, KNOCK),  # another job's proof
        seal(one.secret, 0, 2, KNOCK),  # a proof meant for another rank
        os.urandom(MESSAGE_BYTES),
        os.urandom(4096),
    ]
    flipped = bytearray(seal(one.secret, 0, 1, REPLY))
    flipped[4] = KNOCK  # a reply made into a knock
    strangers.append(bytes(flipped))
    for payload in strangers:
        _send(port, payload)
    assert one.heard(0.5) == set() and zero.heard(0.1) == set()
    assert knock({1: one.address}, 0, 2.0, zero.secret) == {1}
    assert one.heard(2.0, enough=1) == {0}
    assert zero.heard(2.0, enough=1) == {1}  # rank 1's serving thread replied with its proof


def test_a_replayed_message_counts_once() -> None:
    secret = new_secret()
    beacon = Beacon(1, secret)
    try:
        beacon.set_peers({0: (("127.0.0.1",), 9), 1: beacon.address})
        message = seal(secret, 0, 1, REPLY)
        assert open_sealed(secret, 1, message) is not None
        assert beacon._received(message) is True
        assert beacon._received(message) is False
        assert open_sealed(secret, 0, message) is None  # not to another rank either
    finally:
        beacon.close()


def test_the_listener_binds_the_exchanged_address_not_every_interface() -> None:
    secret = new_secret()
    beacon = Beacon(0, secret, bind_address(0, ["a", "a"], [("10.0.0.1", "127.0.0.1")] * 2))
    try:
        assert beacon.address[0] == ("127.0.0.1",)  # every rank on this host: loopback only
        assert beacon._sock.getsockname()[0] == "127.0.0.1"
    finally:
        beacon.close()
    # ranks on two hosts: the address this host routes from toward the other host
    assert bind_address(0, ["a", "b"], [("127.0.0.1",), ("127.0.0.1",)]) == "127.0.0.1"
    assert bind_address(0, ["a", "b"], [("127.0.0.1",), ("127.0.0.2",)]) == "127.0.0.1"


def test_a_flood_neither_exhausts_descriptors_nor_shuts_out_a_knock(pair) -> None:
    zero, one = pair
    before = _open_fds()
    flood = _stranger("flood", "127.0.0.1", one.address[1], 10_000, 3)
    try:
        time.sleep(1.5)  # the connections are open or opening
        during = _open_fds()
        assert knock({1: one.address}, 0, 2.0, zero.secret) == {1}
        assert one.heard(2.0, enough=1) == {0}
        assert zero.heard(2.0, enough=1) == {1}
    finally:
        held = _done(flood)
    assert held > 5 * MAX_CONNECTIONS, held  # the flood got through to the listener
    assert during - before <= MAX_CONNECTIONS + 4, (before, during)
    time.sleep(0.5)
    assert _open_fds() <= before + 2  # closed with the flood


def _job(*args: object) -> subprocess.Popen:
    env = repo_env()
    env.pop("HPCFL_RANK_GUARD", None)
    env.pop("HPCFL_COMM_TIMEOUT", None)
    return subprocess.Popen(
        [MPIEXEC, "-n", "2", sys.executable, str(PROGRAM), *map(str, args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _beacon_port(launcher: int, rank: int, timeout: float = 30) -> int:
    """The port of ``rank``'s beacon, found as a stranger would: the newest listening socket on
    loopback that the rank's process holds (the beacon is made after MPI_Init's own)."""
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        pid = _rank_process(launcher, rank)
        if pid is not None:
            try:
                inodes = {
                    int(link[8:-1])
                    for fd in os.listdir(f"/proc/{pid}/fd")
                    if (link := os.readlink(f"/proc/{pid}/fd/{fd}")).startswith("socket:[")
                }
                rows = [line.split() for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]]
            except OSError:
                rows, inodes = [], set()
            mine = [
                (int(r[9]), int(r[1].split(":")[1], 16))
                for r in rows
                if r[3] == "0A" and r[1].startswith("0100007F:") and int(r[9]) in inodes
            ]
            if len(mine) >= 2:  # MPI's and the beacon
                return max(mine)[1]
        time.sleep(0.05)
    raise AssertionError(f"rank {rank}'s beacon did not appear")


def _expected_total(steps: int, size: int = 2) -> float:
    return float(sum(1000 * (s + 1) * size + s * size + s for s in range(steps)))


@pytest.mark.mpi
def test_strangers_neither_end_nor_change_a_healthy_job() -> None:
    steps = 600  # ~10 ms each: the strangers finish well before the job does (asserted below)
    job = _job("run", 30, "-1", steps)
    try:
        ports = [_beacon_port(job.pid, r) for r in (0, 1)]
        strangers = [
            _stranger("flood", "127.0.0.1", ports[0], 10_000, 1),
            *[_stranger("knock", "127.0.0.1", ports[r], 1 - r) for r in (0, 1)],
            *[_stranger("reply", "127.0.0.1", ports[r], 1 - r, 0.5) for r in (0, 1)],
            *[_stranger("garbage", "127.0.0.1", ports[r]) for r in (0, 1)],
        ]
        counts = [_done(s) for s in strangers]
        assert job.poll() is None, "the job ended before the strangers were done: raise its steps"
        out, err = job.communicate(timeout=90)
    finally:
        job.kill()
    assert counts[0] > 5 * MAX_CONNECTIONS and all(n > 0 for n in counts), counts
    assert job.returncode == 0, err
    assert err.strip() == ""
    # the two ranks' lines may interleave on the launcher's stdout
    assert re.findall(r"OK ([0-9]+\.[0-9])", out) == [f"{_expected_total(steps):.1f}"] * 2, out


@pytest.mark.mpi
def test_a_frozen_rank_is_found_while_a_stranger_forges_its_replies() -> None:
    job = _job("stop", TIMEOUT_S, "1", 200)
    try:
        port = _beacon_port(job.pid, 0)
        # forged replies from rank 1 to rank 0 for longer than the job can take to end
        liar = _stranger("reply", "127.0.0.1", port, 1, TIMEOUT_S + 8)
        _, err = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == EXIT_PEER_LOST, err
    assert err.strip().splitlines() == [
        f"hpcfl: error: rank 1 (host {HOST}) did not answer within {TIMEOUT_S} s (its node was lost "
        "or its link cut); ending the job — resume with --resume"
    ]
    assert _done(liar) > 50  # it was lying all along
