"""Emulated hosts on one Linux machine: a network + UTS namespace per node, joined by a bridge.

Why: hpcfl runs across cluster nodes, and CI has one machine. Linux namespaces give each emulated
node its own network stack and hostname at almost no cost; the bytes between two nodes cross real
TCP sockets over a veth pair and a bridge, so MPI between "nodes" takes the path it takes between
hosts (MPICH sees two nodes and uses its network module, not shared memory). This is how
containerised SLURM test clusters are built.

The layout, all of it inside namespaces this module makes (the machine's own network is never
touched, and no traffic leaves these namespaces)::

    head namespace (hostname "head", 10.231.N.1 on bridge br0)  <- controller, client commands
        br0 ── v1 ═══ eth0 of node1 (10.231.N.11, hostname node1)
            ── v2 ═══ eth0 of node2 (10.231.N.12, hostname node2) ...

Each namespace is held by a small ``sleep`` process started with ``PR_SET_PDEATHSIG``: when the
process that made the network dies (pytest killed), the holders die, and the kernel removes each
namespace with its links once nothing else runs in it. :meth:`EmulatedNetwork.stop` removes them
at once. Links are shaped with ``tc`` (``tbf``: a bandwidth per direction) and made lossy with the
iptables ``statistic`` match; this kernel has no ``netem``, so a profile's latency is not injected:
what is measured carries the veth's own latency and the projection adds the profile's (see
:mod:`tests.cluster.links`).

Needs root (``unshare``, ``nsenter``, ``ip``, ``tc``; ``iptables`` for loss). Standard library only.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpcfl.comm.guard import die_with_parent
from tests.cluster.links import LinkProfile

#: The emulated hosts' subnet, 10.231.0.0/24: it exists only inside each network's own namespaces,
#: so two networks on one machine never meet.
SUBNET_PREFIX = "10.231"
MAX_NODES = 64


class NamespaceError(RuntimeError):
    """A namespace, link or shaping step was refused; the message names the step and the reason."""


def namespaces_available() -> str | None:
    """None when this process may make network + UTS namespaces, else the reason it may not."""
    if os.geteuid() != 0:
        return "emulated nodes need root (network namespaces)"
    for tool in ("unshare", "nsenter", "ip", "tc"):
        if shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None:
            return f"emulated nodes need '{tool}' (iproute2 / util-linux)"
    probe = subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"network namespaces refused here: {probe.stderr.strip() or probe.returncode}"
    return None


@dataclass
class Node:
    """One emulated host: its name, address, the holder of its namespaces and the switch-side link."""

    index: int  # 1-based
    name: str
    address: str
    holder: subprocess.Popen[bytes]
    switch_port: str  # the veth end on the bridge (in the head namespace)
    device: str = "eth0"  # the node's own end

    @property
    def pid(self) -> int:
        return self.holder.pid


@dataclass
class EmulatedNetwork:
    """A head namespace with a bridge and ``nodes`` node namespaces, each on one veth link."""

    workdir: Path  # the nodes' boot ids
    net: int
    head: subprocess.Popen[bytes]
    head_address: str
    nodes: list[Node] = field(default_factory=list)
    link: LinkProfile | None = None
    loss: dict[int, float] = field(default_factory=dict)

    # ---- entering ------------------------------------------------------------------------------

    @staticmethod
    def _enter(pid: int, uts: bool = True) -> list[str]:
        spaces = [f"--net=/proc/{pid}/ns/net"]
        if uts:
            spaces += [f"--uts=/proc/{pid}/ns/uts", f"--mount=/proc/{pid}/ns/mnt"]
        return ["nsenter", *spaces, "--"]

    def head_prefix(self) -> list[str]:
        """argv prefix that runs a command in the head namespace (the controller's "login node")."""
        return self._enter(self.head.pid)

    def node_prefix(self, index: int) -> list[str]:
        """argv prefix that runs a command on node ``index`` (1-based): its network and hostname."""
        return self._enter(self.node(index).pid)

    def node(self, index: int) -> Node:
        if not 1 <= index <= len(self.nodes):
            raise NamespaceError(f"no node {index}: this network has nodes 1..{len(self.nodes)}")
        return self.nodes[index - 1]

    def _in(self, pid: int, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [*self._enter(pid, uts=False), *argv], capture_output=True, text=True, timeout=30, check=False
        )
        if check and proc.returncode != 0:
            raise NamespaceError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")
        return proc

    # ---- links ---------------------------------------------------------------------------------

    def shape(self, index: int, link: LinkProfile | None) -> None:
        """Shape node ``index``'s link in both directions to ``link``'s bandwidth (None: unshaped)."""
        node = self.node(index)
        for pid, dev in ((node.pid, node.device), (self.head.pid, node.switch_port)):
            self._in(pid, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if link is not None and link.shaped:
                self._in(pid, "tc", "qdisc", "replace", "dev", dev, "root", *link.tbf_args())

    def set_loss(self, index: int, probability: float) -> None:
        """Drop packets leaving node ``index`` at random with ``probability`` (0 removes the rule).

        Only the node's own direction: TCP's retransmissions then carry the data, slower."""
        if not 0.0 <= probability < 1.0:
            raise NamespaceError(f"a loss probability is in [0, 1); got {probability}")
        node = self.node(index)
        if shutil.which("iptables", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None:
            raise NamespaceError("packet loss needs iptables (apt-get install iptables)")
        self._in(node.pid, "iptables", "-F", "OUTPUT", check=False)
        if probability > 0:
            self._in(
                node.pid,
                "iptables", "-A", "OUTPUT", "-o", node.device, "-m", "statistic",
                "--mode", "random", "--probability", f"{probability:.6f}", "-j", "DROP",
            )  # fmt: skip
        self.loss[index] = probability

    def cut(self, index: int) -> None:
        """Pull node ``index``'s cable: its switch port goes down, no process notices at once."""
        node = self.node(index)
        self._in(self.head.pid, "ip", "link", "set", node.switch_port, "down")

    def mend(self, index: int) -> None:
        """Plug node ``index``'s cable back in."""
        node = self.node(index)
        self._in(self.head.pid, "ip", "link", "set", node.switch_port, "up")

    def tx_bytes(self, index: int) -> int:
        """Bytes node ``index`` has sent over its link since it was made (the kernel's counter).

        Read from ``/proc/<holder>/net/dev``: /proc/net follows the reader's network namespace,
        while /sys/class/net would show the machine's own interfaces."""
        node = self.node(index)
        for line in Path(f"/proc/{node.pid}/net/dev").read_text().splitlines():
            name, _, counters = line.partition(":")
            if name.strip() == node.device:
                return int(counters.split()[8])  # receive: 8 fields, then transmit bytes
        raise NamespaceError(f"{node.name} has no {node.device}")

    # ---- processes -----------------------------------------------------------------------------

    def pids_on(self, index: int) -> list[int]:
        """PIDs of every process running on node ``index`` except the namespace's holder."""
        node = self.node(index)
        target = os.stat(f"/proc/{node.pid}/ns/net").st_ino
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == node.pid:
                continue
            try:
                if os.stat(entry / "ns" / "net").st_ino == target:
                    pids.append(int(entry.name))
            except OSError:  # gone meanwhile
                continue
        return pids

    def kill_node(self, index: int) -> list[int]:
        """SIGKILL every process on node ``index`` (its daemons and jobs): a host that died.

        The namespace and its link stay, so the node can be started again."""
        pids = self.pids_on(index)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def stop(self) -> None:
        """Kill every process in the namespaces, then their holders; the kernel frees the rest."""
        for node in self.nodes:
            if node.holder.poll() is None:
                self.kill_node(node.index)
        for proc in [n.holder for n in self.nodes] + [self.head]:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _holder(hostname: str, workdir: Path) -> subprocess.Popen[bytes]:
    """A process in new network + UTS + mount namespaces named ``hostname``, with loopback up, its
    own ``/dev/shm`` and its own boot id.

    Why the last two: MPI transports decide that two processes share a host by the boot id (UCX's
    system id, read from ``/proc/sys/kernel/random/boot_id``) and then talk through shared memory
    in ``/dev/shm``; without them two emulated nodes would be one host to MPICH's UCX and no byte
    would cross the link."""
    boot_id = workdir / f"boot_id-{hostname}"
    boot_id.write_text(str(uuid.uuid4()) + "\n")
    script = (
        f"hostname {hostname} && ip link set lo up"
        f" && mount --bind {boot_id} /proc/sys/kernel/random/boot_id"
        " && mount -t tmpfs -o mode=1777,size=50% tmpfs /dev/shm"
        " && exec sleep infinity"
    )
    proc = subprocess.Popen(
        ["unshare", "--net", "--uts", "--mount", "--propagation", "private", "sh", "-c", script],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # ready once the holder runs `sleep` in its namespace
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
            raise NamespaceError(f"could not make the namespaces of {hostname}: {err or proc.returncode}")
        try:
            if Path(f"/proc/{proc.pid}/comm").read_text().strip() == "sleep":
                return proc
        except OSError:
            pass
        time.sleep(0.01)
    proc.kill()
    raise NamespaceError(f"the namespaces of {hostname} were not ready within 10 s")


def start_network(
    nodes: int, link: LinkProfile | None = None, names: Sequence[str] | None = None
) -> EmulatedNetwork:
    """Make the head namespace and ``nodes`` node namespaces (hostnames ``node1``..), linked and shaped.

    Raises :class:`NamespaceError` naming the step that failed (everything made so far is removed).
    """
    if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
        raise NamespaceError(f"an emulated cluster has 1 to {MAX_NODES} nodes; got {nodes!r}")
    names = list(names) if names is not None else [f"node{i}" for i in range(1, nodes + 1)]
    if len(names) != nodes:
        raise NamespaceError(f"{len(names)} names for {nodes} nodes")
    reason = namespaces_available()
    if reason:
        raise NamespaceError(reason)
    net_id = 0  # every network has its own bridge in its own namespace: subnets never meet
    workdir = Path(tempfile.mkdtemp(prefix="hpcfl-netns-"))
    head = _holder("head", workdir)
    network = EmulatedNetwork(
        workdir=workdir, net=net_id, head=head, head_address=f"{SUBNET_PREFIX}.{net_id}.1", link=link
    )
    try:
        network._in(head.pid, "ip", "link", "add", "br0", "type", "bridge")
        network._in(head.pid, "ip", "addr", "add", f"{network.head_address}/24", "dev", "br0")
        network._in(head.pid, "ip", "link", "set", "br0", "up")
        for i, name in enumerate(names, start=1):
            holder = _holder(name, workdir)
            node = Node(i, name, f"{SUBNET_PREFIX}.{net_id}.{10 + i}", holder, switch_port=f"v{i}")
            network.nodes.append(node)
            network._in(
                head.pid, "ip", "link", "add", node.switch_port, "type", "veth",
                "peer", "name", node.device, "netns", str(holder.pid),
            )  # fmt: skip
            network._in(head.pid, "ip", "link", "set", node.switch_port, "master", "br0", "up")
            network._in(holder.pid, "ip", "addr", "add", f"{node.address}/24", "dev", node.device)
            network._in(holder.pid, "ip", "link", "set", node.device, "up")
            network.shape(i, link)
    except BaseException:
        network.stop()
        raise
    return network
