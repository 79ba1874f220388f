"""The emulated hosts themselves (:mod:`tests.cluster.netns`): what they are made of, and that
nothing is left behind when they are stopped or when the process that made them is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.links import parse_link
from tests.cluster.netns import NamespaceError, namespaces_available, start_network
from tests.helpers import repo_env

pytestmark = pytest.mark.multinode


@pytest.fixture(autouse=True)
def _root_and_namespaces() -> None:
    reason = namespaces_available()
    if reason:
        pytest.skip(reason)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_each_node_has_its_own_name_address_boot_id_and_shm() -> None:
    net = start_network(2, parse_link("1gbe"))
    try:
        seen = []
        for i in (1, 2):
            out = subprocess.run(
                [*net.node_prefix(i), "sh", "-c",
                 "hostname; cat /proc/sys/kernel/random/boot_id; ip -4 -o addr show eth0; touch /dev/shm/hpcfl-probe; ls /dev/shm"],
                capture_output=True, text=True, timeout=30, check=True,
            ).stdout.split("\n")  # fmt: skip
            seen.append(out)
        assert [s[0] for s in seen] == ["node1", "node2"]
        assert seen[0][1] != seen[1][1]  # boot ids differ: MPI sees two hosts
        assert "10.231.0.11/24" in seen[0][2] and "10.231.0.12/24" in seen[1][2]
        assert not Path("/dev/shm/hpcfl-probe").exists()  # each node's /dev/shm is its own
        qdisc = subprocess.run(
            [*net.node_prefix(1), "tc", "qdisc", "show", "dev", "eth0"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "tbf" in qdisc and "rate 1Gbit" in qdisc
        # node 1 reaches node 2 over the link, and the link's counter shows it
        before = net.tx_bytes(1)
        server = subprocess.Popen(
            [*net.node_prefix(2), sys.executable, "-c",
             "import socket; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
             "s.bind(('0.0.0.0', 5001)); s.listen(); c, _ = s.accept(); n = 0\n"
             "while (b := c.recv(65536)): n += len(b)\nprint(n)"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        time.sleep(0.5)
        subprocess.run(
            [*net.node_prefix(1), sys.executable, "-c",
             "import socket; c = socket.create_connection(('10.231.0.12', 5001), timeout=10); c.sendall(b'x' * 1000000)"],
            check=True, timeout=30,
        )  # fmt: skip
        assert server.communicate(timeout=30)[0].strip() == "1000000"
        assert net.tx_bytes(1) - before >= 1_000_000
    finally:
        net.stop()
    assert not any(_alive(p) for p in [net.head.pid, *(n.pid for n in net.nodes)])


def test_a_killed_maker_leaves_no_namespace_behind(tmp_path: Path) -> None:
    """The process that made the nodes is SIGKILLed (pytest killed): the holders die with it, and
    with them the namespaces and links."""
    script = (
        "from tests.cluster.netns import start_network\n"
        "net = start_network(2)\n"
        "print(net.head.pid, *(n.pid for n in net.nodes), flush=True)\n"
        "import time; time.sleep(60)\n"
    )
    maker = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=repo_env()
    )
    pids = [int(p) for p in maker.stdout.readline().split()]  # type: ignore[union-attr]
    assert len(pids) == 3 and all(_alive(p) for p in pids)
    inodes = {os.stat(f"/proc/{p}/ns/net").st_ino for p in pids}
    os.kill(maker.pid, signal.SIGKILL)
    maker.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)
    left = set()
    for entry in Path("/proc").iterdir():  # no process of this machine is still in those namespaces
        if entry.name.isdigit():
            try:
                left.add(os.stat(entry / "ns" / "net").st_ino)
            except OSError:
                continue
    assert not inodes & left


def test_bad_requests_are_one_line() -> None:
    for nodes in (0, 65, "2", True):
        with pytest.raises(NamespaceError) as err:
            start_network(nodes)  # type: ignore[arg-type]
        assert str(err.value).startswith("an emulated cluster has 1 to 64 nodes")
    net = start_network(1)
    try:
        with pytest.raises(NamespaceError, match="no node 2: this network has nodes 1..1"):
            net.cut(2)
        with pytest.raises(NamespaceError, match=r"a loss probability is in \[0, 1\); got 1.5"):
            net.set_loss(1, 1.5)
    finally:
        net.stop()
