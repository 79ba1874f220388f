"""A real single-node SLURM on localhost for the tests (not a test module itself).

Why a real one: the product is run as SLURM batch jobs (sbatch templates, ``srun --mpi=pmi2``,
submitit, requeue on preemption), and a mock of ``sbatch``/``sacct`` would only test our idea of
SLURM. Starting one costs a few seconds once per test session.

What :func:`start_cluster` starts, every daemon a child of this process, in the foreground, with
state, spool, logs, sockets and free TCP ports inside one private temp dir, so it never touches
``/etc/slurm``, ``/run/munge`` or a system daemon and two sessions can run side by side:

1. a private ``munged`` (own key and socket; slurm.conf points at it with ``AuthInfo=socket=``
   and ``AccountingStoragePass=`` — the latter is the socket used towards slurmdbd),
2. with accounting (the default): a throw-away MariaDB (``mariadbd`` on 127.0.0.1) and
   ``slurmdbd``, so ``sacct`` works and submitit reads real job states instead of warning on every
   poll and reporting UNKNOWN (``HPCFL_SLURM_ACCOUNTING=0`` turns it off: start 0.4 s). The first
   start creates the database (``mariadb-install-db``, slurmdbd's and the cluster's tables: 5-9 s
   on a loaded 2-core machine) and caches a copy in ``/var/tmp/hpcfl-slurm-db-<versions>``
   (``HPCFL_SLURM_DB_CACHE``: another directory, or ``off``); later starts copy it: ~2 s in all,
3. ``slurmctld`` and ``slurmd``; the node is declared with at least 4 CPUs
   (``SlurmdParameters=config_overrides``) so 4-rank jobs fit on a 2-core machine.

Stopping (:meth:`SlurmCluster.stop`) cancels this cluster's jobs, then terminates exactly the
processes started here, by PID, newest first (SIGTERM, bounded wait, SIGKILL). Every daemon also
gets ``PR_SET_PDEATHSIG`` so a killed pytest does not leave them behind.

Packages come from ``.ci/setup_slurm.sh`` (Debian 12: Slurm 22.05); the fixture runs it when a
binary is missing. It skips only when not root or when the packages cannot be installed.

Use: ``tests/conftest.py`` imports the fixtures (``from tests.cluster.slurm import slurm_cluster,
slurm_env  # noqa: F401``), or a test module binds them (``slurm_cluster = module.slurm_cluster``;
importing them by name there trips ruff's F811 on every test argument). Either way the cluster is
started once per session::

    @pytest.mark.slurm
    def test_x(slurm_cluster):
        job = slurm_cluster.sbatch(wrap="hostname")
        assert slurm_cluster.wait_state(job) == "COMPLETED"

``slurm_env`` additionally exports ``SLURM_CONF`` into ``os.environ`` for the test (needed by
code that calls the SLURM commands itself, e.g. submitit).
"""

from __future__ import annotations

import functools
import hashlib
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hpcfl.comm.guard import die_with_parent
from tests.cluster.links import LinkProfile, parse_link
from tests.cluster.netns import MAX_NODES, EmulatedNetwork, NamespaceError, start_network

REPO = Path(__file__).resolve().parents[2]
SETUP_SCRIPT = REPO / ".ci" / "setup_slurm.sh"
SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

#: States after which a job will not run again (without a requeue).
TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "PREEMPTED",
        "SPECIAL_EXIT",
    }
)

_CORE_BINARIES = (
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "squeue",
    "sinfo",
    "scontrol",
    "iptables",
)
_ACCOUNTING_BINARIES = ("slurmdbd", "sacct", "mariadbd", "mariadb-install-db", "my_print_defaults")


class SlurmClusterError(RuntimeError):
    """The local cluster could not be started or a SLURM command failed; the message says which."""


class SlurmCommandError(SlurmClusterError):
    """A SLURM client command exited non-zero; ``stderr`` holds SLURM's own one-line reason."""

    def __init__(self, argv: Sequence[str], returncode: int, stdout: str, stderr: str) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(f"{' '.join(self.argv)} exited {returncode}: {stderr.strip() or stdout.strip()}")


# --------------------------------------------------------------------------------------------
# small helpers


def _which(name: str) -> str | None:
    """``shutil.which`` that also looks in the sbin directories (daemons live there)."""
    return shutil.which(name, path=os.environ.get("PATH", "") + ":" + SBIN_PATH)


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the daemon binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_listening(port: int, netns_pid: int | None = None) -> bool:
    """True when a socket listens on TCP ``port`` (read from /proc/net/tcp: probing with a real
    connection would make slurmctld/slurmdbd log a "Zero Bytes" error for each probe), in the
    network namespace of ``netns_pid`` when given (an emulated cluster's head)."""
    want = f":{port:04X}"
    proc = f"/proc/{netns_pid}/net" if netns_pid else "/proc/net"
    for table in (f"{proc}/tcp", f"{proc}/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 3 and cols[1].endswith(want) and cols[3] == "0A":  # 0A = LISTEN
                return True
    return False


def _poll(check: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Call ``check`` until it returns True or ``timeout`` seconds pass; return the last result."""
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def _tail(path: Path, lines: int = 15) -> str:
    """The last lines of a log file, for error messages."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"  ({path.name}: no log)"
    return "\n".join(f"  {path.name}: {line}" for line in text[-lines:])


_Mark = Callable[[str], None]


def missing_binaries(accounting: bool = True) -> list[str]:
    """Names of the programs the cluster needs that are not installed."""
    names = _CORE_BINARIES + (_ACCOUNTING_BINARIES if accounting else ())
    return [n for n in names if _which(n) is None]


def ensure_packages(accounting: bool = True) -> float:
    """Install the SLURM packages through ``.ci/setup_slurm.sh`` when some binary is missing.

    Returns the seconds spent installing (0.0 when nothing was missing). Raises
    :class:`pytest.skip.Exception` when the packages cannot be had (not root, no apt, no
    network), which is the one case the SLURM tests are allowed to skip.
    """
    missing = missing_binaries(accounting)
    if not missing:
        return 0.0
    if os.geteuid() != 0:
        pytest.skip(f"SLURM not installed ({', '.join(missing)} missing) and not root to install it")
    if _which("apt-get") is None or not SETUP_SCRIPT.is_file():
        pytest.skip(f"SLURM not installed ({', '.join(missing)} missing) and no apt-get to install it")
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", str(SETUP_SCRIPT)], capture_output=True, text=True, timeout=900, check=False
    )
    if proc.returncode != 0:
        last = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        pytest.skip(f"could not install the SLURM packages: {' | '.join(last)}")
    still = missing_binaries(accounting)
    if still:
        pytest.skip(f"SLURM packages installed but {', '.join(still)} still missing")
    return time.monotonic() - t0


def _node_hardware() -> dict[str, int]:
    """CPUs and RealMemory as ``slurmd -C`` reports them for this host."""
    out = subprocess.run(
        [_which("slurmd") or "slurmd", "-C"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    fields: dict[str, int] = {}
    for token in out.split():
        key, _, value = token.partition("=")
        if key in ("CPUs", "RealMemory") and value.isdigit():
            fields[key] = int(value)
    return fields


# --------------------------------------------------------------------------------------------
# the cluster


@dataclass
class _Daemon:
    """One process started by the cluster; stopped by its PID only."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path


@dataclass
class SlurmCluster:
    """A running single-node SLURM: paths, environment and small helpers for the tests.

    ``env`` is what a subprocess (or ``os.environ``) needs to talk to this cluster
    (``SLURM_CONF``); :meth:`run` and the helpers already use it.
    """

    tmpdir: Path
    conf_path: Path
    node: str
    cpus: int
    accounting: bool
    partition: str = "debug"
    env: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    #: emulated nodes (:func:`start_cluster` with ``nodes=``): their namespaces and links; None for
    #: today's single node on this host
    network: EmulatedNetwork | None = None
    #: GPUs each emulated node declares (a count only: jobs get them scheduled, and play them with
    #: the fake accelerator)
    gpus_per_node: int = 0
    #: emulated nodes beyond the default partition (the last ones): drained at start, in the
    #: partition :attr:`SPARE_PARTITION` with every node, for a test that needs a node to move to
    spare_nodes: int = 0
    _daemons: list[_Daemon] = field(default_factory=list, repr=False)

    @property
    def nodes(self) -> list[str]:
        """The node names (one: this host's name; emulated: ``node1`` .. ``nodeN``)."""
        return [n.name for n in self.network.nodes] if self.network else [self.node]

    @property
    def partition_nodes(self) -> list[str]:
        """The default partition's nodes: every node but the spares."""
        return self.nodes[: len(self.nodes) - self.spare_nodes]

    @property
    def spares(self) -> list[str]:
        """The spare nodes' names (drained until a test resumes them)."""
        return self.nodes[len(self.nodes) - self.spare_nodes :]

    def set_node(self, name: str, state: str, reason: str = "") -> None:
        """``scontrol update`` a node's state (``resume``, ``drain`` with a reason)."""
        extra = [f"reason={reason}"] if reason else []
        self.run("scontrol", "update", f"nodename={name}", f"state={state}", *extra, timeout=10)

    @property
    def prefix(self) -> list[str]:
        """argv prefix of every client command and the controller's daemons: on an emulated
        cluster they run in its head namespace (the "login node"), which alone reaches the nodes."""
        return self.network.head_prefix() if self.network else []

    def _netns_pid(self) -> int | None:
        return self.network.head.pid if self.network else None

    # ---- commands --------------------------------------------------------------------------

    def subprocess_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """``os.environ`` + this cluster's ``env`` (+ ``extra``), for launching anything."""
        env = {**os.environ, **self.env}
        env["PATH"] = env.get("PATH", "") + ":" + SBIN_PATH
        env.update(extra or {})
        return env

    def run(
        self,
        *argv: str,
        timeout: float = 30.0,
        check: bool = True,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a SLURM client command against this cluster (bounded by ``timeout``)."""
        try:
            proc = subprocess.run(
                [*self.prefix, *argv],
                capture_output=True,
                text=True,
                env=self.subprocess_env(env),
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise SlurmClusterError(f"{' '.join(argv)} did not answer within {timeout:.0f} s") from exc
        if check and proc.returncode != 0:
            raise SlurmCommandError(argv, proc.returncode, proc.stdout, proc.stderr)
        return proc

    def sbatch(
        self,
        script: str | None = None,
        *,
        wrap: str | None = None,
        args: Sequence[str] = (),
        script_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        timeout: float = 30.0,
    ) -> str:
        """Submit a batch job and return its id.

        ``script`` is the text of a batch script (``#!`` line added when missing) or ``wrap`` a
        command line; ``args`` are extra sbatch options (they override the script's ``#SBATCH``
        lines), ``script_args`` the script's own arguments, ``env`` extra environment variables
        (sbatch exports the submitter's environment to the job). Output goes to
        ``tmpdir/jobs/<jobid>.out`` unless ``args`` say otherwise. A rejected submission raises
        :class:`SlurmCommandError` carrying sbatch's message.
        """
        if (script is None) == (wrap is None):
            raise ValueError("give exactly one of script= or wrap=")
        jobs = self.tmpdir / "jobs"
        jobs.mkdir(exist_ok=True)
        argv = ["sbatch", "--parsable", f"--chdir={jobs}"]
        if not any(a.startswith(("-o", "--output")) for a in args):
            argv.append(f"--output={jobs}/%j.out")
        argv += list(args)
        if wrap is not None:
            argv.append(f"--wrap={wrap}")
        else:
            assert script is not None
            text = script if script.startswith("#!") else "#!/bin/bash\n" + script
            path = Path(tempfile.mkstemp(dir=jobs, prefix="script-", suffix=".sh")[1])
            path.write_text(text)
            argv += [str(path), *script_args]
        out = self.run(*argv, timeout=timeout, env=env).stdout.strip()
        return out.split(";")[0]  # --parsable prints "jobid[;cluster]"

    def output_path(self, job_id: str) -> Path:
        """Where :meth:`sbatch` sends a job's stdout by default."""
        return self.tmpdir / "jobs" / f"{job_id}.out"

    def squeue_state(self, job_id: str) -> str | None:
        """The job's state (``RUNNING``, ``COMPLETED``, ...) or None when SLURM does not know it.

        slurmctld keeps finished jobs for ``MinJobAge`` (300 s here), so ``squeue -t all`` sees
        them; with accounting ``sacct`` is the fallback after that.
        """
        proc = self.run("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T", check=False)
        state = proc.stdout.strip().split("\n")[0].strip() if proc.returncode == 0 else ""
        if not state and self.accounting:
            proc = self.run("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State", check=False)
            state = proc.stdout.strip().split("\n")[0].split(" ")[0] if proc.returncode == 0 else ""
        return state or None

    def wait_state(
        self,
        job_id: str,
        states: Sequence[str] | None = None,
        timeout: float = 60.0,
    ) -> str:
        """Poll until the job reaches one of ``states`` (default: any terminal state).

        Returns the state reached. Also returns early on a terminal state that is not wanted (the
        caller's assertion then shows it). Raises :class:`TimeoutError` with the last state and
        the daemons' log tails after ``timeout`` seconds.
        """
        wanted = set(states) if states is not None else set(TERMINAL_STATES)
        last: list[str | None] = [None]

        def reached() -> bool:
            last[0] = self.squeue_state(job_id)
            return last[0] is not None and (last[0] in wanted or last[0] in TERMINAL_STATES)

        if _poll(reached, timeout, interval=0.2):
            assert last[0] is not None
            return last[0]
        raise TimeoutError(
            f"job {job_id} still {last[0]} after {timeout:.0f} s (wanted {sorted(wanted)})\n{self.log_tails()}"
        )

    def node_state(self) -> str:
        """The node's state as sinfo prints it (``idle``, ``mixed``, ``allocated``, ``drained``...);
        with several nodes the distinct states joined by ``,`` (``idle`` when all are idle)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%T", timeout=10).stdout.split()
        return ",".join(sorted(set(out)))

    def node_states(self) -> dict[str, str]:
        """Each node's state by name (``down*``: not responding)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", timeout=10).stdout.split("\n")
        return dict(line.split() for line in out if line.strip())

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until no job of this cluster is queued or running and the node is idle."""

        def idle() -> bool:
            queue = self.run("squeue", "-h", "-o", "%i", check=False, timeout=10).stdout.strip()
            return not queue and self.node_state() == "idle"

        if not _poll(idle, timeout, interval=0.2):
            raise SlurmClusterError(
                f"cluster not idle after {timeout:.0f} s (node {self.node_state()!r})\n{self.log_tails()}"
            )

    def log_tails(self, lines: int = 10) -> str:
        """The last lines of every daemon log, for failure messages."""
        return "\n".join(_tail(d.log, lines) for d in self._daemons)

    # ---- emulated nodes ------------------------------------------------------------------------

    def start_slurmd(self, index: int) -> _Daemon:
        """Start node ``index``'s ``slurmd`` in its namespaces (again, after :meth:`kill_node`)."""
        assert self.network is not None, "start_slurmd is for emulated nodes"
        name = self.network.node(index).name
        argv = [_which("slurmd") or "slurmd", "-D", "-N", name]
        return self._spawn(f"slurmd-{name}", argv, prefix=self.network.node_prefix(index))

    def kill_node(self, index: int) -> list[int]:
        """A host that dies: SIGKILL every process on emulated node ``index`` (slurmd, slurmstepd,
        job tasks); its namespace and link stay for :meth:`start_slurmd`."""
        assert self.network is not None, "kill_node is for emulated nodes"
        name = self.network.node(index).name
        pids = self.network.kill_node(index)
        for daemon in [d for d in self._daemons if d.name == f"slurmd-{name}"]:
            daemon.popen.wait(timeout=10)
            self._daemons.remove(daemon)
        return pids

    # ---- lifecycle ---------------------------------------------------------------------------

    def _spawn(
        self, name: str, argv: Sequence[str], *, user: str | None = None, prefix: Sequence[str] | None = None
    ) -> _Daemon:
        """Start one daemon in the foreground as our child, output to ``log/<name>.out``; in the
        namespaces of ``prefix`` (default: the controller's, :attr:`prefix`)."""
        log = self.tmpdir / "log" / f"{name}.out"
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                [*(self.prefix if prefix is None else prefix), *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.subprocess_env(),
                cwd=self.tmpdir,
                user=user,
                group=user,
                extra_groups=[] if user else None,
                start_new_session=True,  # Ctrl-C in the terminal goes to pytest, not the daemons
                preexec_fn=functools.partial(die_with_parent, signal.SIGTERM),  # ends with pytest
            )
        daemon = _Daemon(name, popen, log)
        self._daemons.append(daemon)
        return daemon

    def _wait_for(self, daemon: _Daemon, ready: Callable[[], bool], timeout: float, what: str) -> None:
        """Wait until ``ready()``; fail at once if the daemon exited, or after ``timeout``."""

        def check() -> bool:
            if daemon.popen.poll() is not None:
                raise SlurmClusterError(
                    f"{daemon.name} exited with {daemon.popen.returncode} before {what}\n{self.log_tails()}"
                )
            return ready()

        if not _poll(check, timeout):
            raise SlurmClusterError(f"{daemon.name}: no {what} after {timeout:.0f} s\n{self.log_tails()}")

    def _stop_daemon(self, daemon: _Daemon, timeout: float = 15.0) -> None:
        """SIGTERM one daemon we started, wait (bounded), SIGKILL if it lingers; forget it."""
        if daemon.popen.poll() is None:
            daemon.popen.terminate()
            try:
                daemon.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                daemon.popen.kill()
                daemon.popen.wait(timeout=timeout)
        if daemon in self._daemons:
            self._daemons.remove(daemon)

    def stop(self) -> None:
        """Cancel this cluster's jobs, then stop the daemons started here (by PID, newest first),
        and remove the emulated nodes' namespaces and links."""
        if not self._daemons:
            if self.network is not None:
                self.network.stop()
            return
        ctld_alive = any(d.name == "slurmctld" and d.popen.poll() is None for d in self._daemons)
        if ctld_alive:
            try:
                self.run("scancel", "--full", "--user=root", check=False, timeout=10)
                _poll(lambda: not self.run("squeue", "-h", check=False, timeout=10).stdout.strip(), 15, 0.2)
            except SlurmClusterError:
                pass
        for daemon in reversed(list(self._daemons)):
            self._stop_daemon(daemon)
        self._kill_leftovers()
        if self.network is not None:
            self.network.stop()

    def _kill_leftovers(self) -> None:
        """SIGKILL what this cluster started that outlived its daemons: slurmstepd and job processes
        (they survive slurmd by design). Found by PID through their environment, which holds this
        cluster's ``SLURM_CONF`` (slurmd passes it on; sbatch exports it to the job)."""
        marker = f"\0SLURM_CONF={self.conf_path}\0".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if marker in b"\0" + (entry / "environ").read_bytes():
                    os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ValueError):  # gone meanwhile, or not ours to read
                continue


CLUSTER_NAME = "hpcfl-test"
#: the partition of every emulated node, spares included (start_cluster(spare_nodes=...))
SPARE_PARTITION = "spare"
#: What jobs on emulated nodes get in their environment (see :func:`start_cluster`).
EMULATED_FABRIC = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
#: Bump when the template's contents change (e.g. other mariadbd options at creation).
_TEMPLATE_FORMAT = 1
_MARIADB_OPTIONS = (
    "--no-defaults",
    "--user=root",
    "--skip-log-bin",
    "--innodb-log-file-size=8M",  # keeps the datadir (and its cached copy) ~20 MB instead of ~110
    "--innodb-buffer-pool-size=64M",
    "--innodb-lock-wait-timeout=900",  # the value slurmdbd asks for
    # a throw-away database: no fsync
    "--innodb-flush-log-at-trx-commit=0",
    "--innodb-doublewrite=0",
    "--innodb-flush-method=nosync",
)


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    """Write a config file with the given permissions."""
    path.write_text(text)
    path.chmod(mode)


def _db_template_path() -> Path | None:
    """Where the ready-made accounting database for this mariadbd + slurmdbd version is cached.

    Why: on a fresh datadir, ``mariadb-install-db`` (0.5 s idle, 4-5 s on a loaded 2-core box) and
    the ~40 ``CREATE/ALTER TABLE`` that slurmdbd and the first cluster registration run (~3 s) are
    most of the start time; a copy of the datadir made right after them (no job in it yet) takes
    ~0.1 s. ``HPCFL_SLURM_DB_CACHE`` names the cache directory (default /var/tmp) or ``off``.
    """
    root = os.environ.get("HPCFL_SLURM_DB_CACHE", "/var/tmp")
    if root == "off":
        return None
    versions = []
    for argv in ([_which("mariadbd") or "mariadbd", "--version"], [_which("slurmdbd") or "slurmdbd", "-V"]):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        versions.append(proc.stdout.strip())
    key = hashlib.sha1(f"{_TEMPLATE_FORMAT}|{CLUSTER_NAME}|{'|'.join(versions)}".encode()).hexdigest()[:12]
    return Path(root) / f"hpcfl-slurm-db-{key}"


def _install_db(db: Path) -> None:
    """A fresh MariaDB datadir with passwordless root (``mariadb-install-db``)."""
    proc = subprocess.run(
        [
            _which("mariadb-install-db") or "mariadb-install-db",
            *_MARIADB_OPTIONS,
            f"--datadir={db}",
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
        raise SlurmClusterError(f"mariadb-install-db failed: {' | '.join(lines[:3])}")


def _save_template(db: Path, template: Path) -> None:
    """Copy a cleanly shut down datadir into the cache, atomically (a racing session's copy wins)."""
    partial = template.with_name(f"{template.name}.partial-{os.getpid()}")
    shutil.copytree(db, partial)
    try:
        partial.rename(template)
    except OSError:  # another session saved it first
        shutil.rmtree(partial, ignore_errors=True)


def _start_accounting(cluster: SlurmCluster, ports: dict[str, int], munge_sock: Path, mark: _Mark) -> None:
    """MariaDB on 127.0.0.1 (throw-away datadir, root without password) and slurmdbd.

    slurmdbd reads ``slurmdbd.conf`` from the directory of ``$SLURM_CONF``. With a cached template
    the database already holds slurmdbd's tables and this cluster's; without one they are created
    now, and a copy is cached for the next start.
    """
    tmpdir = cluster.tmpdir
    db = tmpdir / "db"
    template = _db_template_path()
    from_template = template is not None and template.is_dir()
    if from_template:
        assert template is not None
        shutil.copytree(template, db)
        mark("db-from-template")
    else:
        _install_db(db)
        mark("mariadb-install-db")
    _write(
        tmpdir / "slurmdbd.conf",
        f"""\
AuthType=auth/munge
AuthInfo=socket={munge_sock}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={ports["dbd"]}
SlurmUser=root
LogFile={tmpdir}/log/slurmdbd.log
PidFile={tmpdir}/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={ports["db"]}
StorageUser=root
StorageLoc=slurm_acct_db
DebugLevel=info
""",
        mode=0o600,  # slurmdbd refuses a config others can read
    )

    def start_db_daemons() -> tuple[_Daemon, _Daemon]:
        mariadbd = cluster._spawn(
            "mariadbd",
            [
                _which("mariadbd") or "mariadbd",
                *_MARIADB_OPTIONS,
                f"--datadir={db}",
                "--bind-address=127.0.0.1",
                f"--port={ports['db']}",
                f"--socket={tmpdir / 'mariadb.sock'}",
                f"--pid-file={tmpdir / 'mariadb.pid'}",
            ],
        )
        cluster._wait_for(
            mariadbd, lambda: _port_listening(ports["db"], cluster._netns_pid()), 30, "TCP port"
        )
        mark("mariadbd")
        dbd = cluster._spawn("slurmdbd", [_which("slurmdbd") or "slurmdbd", "-D"])
        cluster._wait_for(dbd, lambda: _port_listening(ports["dbd"], cluster._netns_pid()), 60, "TCP port")
        mark("slurmdbd")
        return mariadbd, dbd

    try:
        mariadbd, dbd = start_db_daemons()
    except SlurmClusterError as err:
        if from_template:
            raise SlurmClusterError(
                f"{err}\n(the database was copied from the cache {template}: delete it)"
            ) from err
        raise
    if template is not None and not from_template:
        # create this cluster's tables now (else slurmctld's first registration does), then keep a
        # copy of the database as it is: tables, no jobs
        cluster.run("sacctmgr", "-i", "add", "cluster", CLUSTER_NAME, timeout=60)
        cluster._stop_daemon(dbd)
        cluster._stop_daemon(mariadbd)
        _save_template(db, template)
        mark("db-template-saved")
        start_db_daemons()


def _slurm_conf(cluster: SlurmCluster, ports: dict[str, int], munge_sock: Path, memory: int) -> str:
    """slurm.conf: everything under the temp dir, free ports, one partition; one node on 127.0.0.1,
    or the emulated nodes at their bridge addresses (spool, pid and log per node: ``%n``)."""
    tmpdir, node = cluster.tmpdir, cluster.node
    net = cluster.network
    if net is None:
        controller = f"{node}(127.0.0.1)"
        per_node = ""
        node_lines = (
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cluster.cpus} RealMemory={memory} State=UNKNOWN"
        )
        timeout = 30
    else:
        controller = f"head({net.head_address})"
        per_node = "-%n"
        gres = f" Gres=gpu:{cluster.gpus_per_node}" if cluster.gpus_per_node else ""
        node_lines = "\n".join(
            f"NodeName={n.name} NodeAddr={n.address} CPUs={cluster.cpus} RealMemory={memory}{gres} State=UNKNOWN"
            for n in net.nodes
        )
        if cluster.gpus_per_node:  # stand-in device files (copies of /dev/null) that SLURM binds
            node_lines = "GresTypes=gpu\n" + node_lines
            for i in range(cluster.gpus_per_node):
                os.mknod(tmpdir / f"fakegpu{i}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            files = f"{tmpdir}/fakegpu[0-{cluster.gpus_per_node - 1}]"
            _write(tmpdir / "gres.conf", f"Name=gpu File={files}\n")
        timeout = 10  # a lost node is marked DOWN (and its jobs requeued) within ~10-15 s
    spare = ""
    if cluster.spare_nodes:
        spare = f"PartitionName={SPARE_PARTITION} Nodes={','.join(cluster.nodes)} MaxTime=INFINITE State=UP OverSubscribe=YES\n"
    # below MaxJobId (67043328), 100 ids apart
    first_job_id = 1000 + int.from_bytes(os.urandom(4), "little") % 600_000 * 100
    if cluster.accounting:
        acct = f"""\
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={ports["dbd"]}
# the munge socket used towards slurmdbd (AuthInfo's socket is not used for that connection)
AccountingStoragePass={munge_sock}
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
"""
    else:
        acct = "AccountingStorageType=accounting_storage/none\nJobAcctGatherType=jobacct_gather/none\n"
    return f"""\
# generated by tests/cluster/slurm.py
ClusterName={CLUSTER_NAME}
# job ids unique across test sessions: a killed MPICH step leaves /dev/shm segments named after its
# job/step, which break a later step with the same ids on this machine
FirstJobId={first_job_id}
SlurmctldHost={controller}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket={munge_sock},cred_expire=5
SlurmctldPort={ports["ctld"]}
SlurmdPort={ports["slurmd"]}
StateSaveLocation={tmpdir}/state
SlurmdSpoolDir={tmpdir}/spool{per_node}
SlurmctldPidFile={tmpdir}/slurmctld.pid
SlurmdPidFile={tmpdir}/slurmd{per_node}.pid
SlurmctldLogFile={tmpdir}/log/slurmctld.log
SlurmdLogFile={tmpdir}/log/slurmd{per_node}.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# trust the CPU count below (more than the host has, so 4-rank jobs fit on 2 cores)
SlurmdParameters=config_overrides
# reject at submit what the partition can never run (default NO queues it forever as PartitionConfig)
EnforcePartLimits=ALL
{acct}JobCompType=jobcomp/none
MinJobAge=300
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout={timeout}
{node_lines}
PartitionName={cluster.partition} Nodes={",".join(cluster.partition_nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
{spare}"""


def start_cluster(
    accounting: bool | None = None,
    partition: str = "debug",
    *,
    nodes: int | None = None,
    link: str | LinkProfile | None = None,
    gpus_per_node: int = 0,
    spare_nodes: int = 0,
) -> SlurmCluster:
    """Start munged (+ MariaDB + slurmdbd), slurmctld and slurmd; return once every node is idle.

    ``nodes=None``: one node, this host (today's fixture). ``nodes=N``: N emulated nodes
    (:mod:`tests.cluster.netns`: a network + UTS namespace each, hostnames ``node1``..``nodeN``, on
    one bridge), one ``slurmd`` per node, the controller and accounting in the head namespace,
    every link shaped to ``link`` (a profile name of :mod:`tests.cluster.links` or
    ``rate=100mbit``; None: unshaped veth), each node declaring ``gpus_per_node`` GPUs (a GRES count
    without device files, for the fake accelerator). ``spare_nodes=S`` adds S emulated nodes outside
    the default partition, drained once up: jobs submitted to the partition ``spare`` (every node)
    can move to them once a test resumes them (``set_node(name, "resume")``). An unknown profile or
    an impossible node count is a ValueError with one line.

    ``accounting`` defaults to ``$HPCFL_SLURM_ACCOUNTING`` (on unless ``0``). Raises
    :class:`SlurmClusterError` naming the daemon and showing its log when something does not
    come up within its bound (every wait here is bounded).
    """
    if accounting is None:
        accounting = os.environ.get("HPCFL_SLURM_ACCOUNTING", "1") != "0"
    if nodes is not None and (
        isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES
    ):
        raise ValueError(f"an emulated cluster has 1 to {MAX_NODES} nodes; got {nodes!r}")
    if spare_nodes and (nodes is None or not 0 < spare_nodes < nodes):
        raise ValueError(
            f"spare nodes are some of an emulated cluster's nodes; got {spare_nodes!r} of {nodes!r}"
        )
    profile = parse_link(link)  # ValueError naming the known profiles
    t_start = time.monotonic()
    tmpdir = Path(tempfile.mkdtemp(prefix="hpcfl-slurm-", dir="/tmp"))
    tmpdir.chmod(0o711)  # the munge user must reach its socket dir
    for sub in ("state", "spool", "log", "jobs"):
        (tmpdir / sub).mkdir()

    hw = _node_hardware()
    if nodes is None:
        ports = {name: _free_port() for name in ("ctld", "slurmd", "dbd", "db")}
    else:  # the head namespace is new: every port is free there
        ports = {"ctld": 6817, "slurmd": 6818, "dbd": 6819, "db": 3306}
    munge_dir = tmpdir / "munge"
    munge_sock = munge_dir / "munge.sock"
    conf = tmpdir / "slurm.conf"
    cluster = SlurmCluster(
        tmpdir=tmpdir,
        conf_path=conf,
        node=socket.gethostname().split(".")[0],
        cpus=max(hw.get("CPUs", 1), 4),
        accounting=accounting,
        partition=partition,
        env={"SLURM_CONF": str(conf)},
        gpus_per_node=gpus_per_node if nodes is not None else 0,
        spare_nodes=spare_nodes,
    )
    last = [t_start]

    def mark(phase: str) -> None:
        now = time.monotonic()
        cluster.timings[phase] = cluster.timings.get(phase, 0.0) + now - last[0]
        last[0] = now

    try:
        if nodes is not None:
            # the fabric environment a site's MPI module sets: MPICH's OFI netmod over TCP. The
            # wheel's default UCX netmod makes ~1 KB business cards that Slurm's PMI2 mangles
            # now and then across nodes (pmodels/mpich#6924): measured here, 3 of 6 four-rank
            # two-node starts of the multinode tests died in MPI_Init with UCX (0 of 18 in a loop of
            # plain `srun hpcfl run`), 0 of 30 with OFI/TCP
            cluster.env.update(EMULATED_FABRIC)
            try:
                cluster.network = start_network(nodes, profile)
            except NamespaceError as err:
                raise SlurmClusterError(f"emulated nodes: {err}") from err
            for name in cluster.nodes:
                (tmpdir / f"spool-{name}").mkdir()
            mark("namespaces")
        # 1. private munged with its own key: nothing shared with a system munge (its socket is a
        #    path, so the emulated nodes reach it through the file system)
        munge = pwd.getpwnam("munge")
        munge_dir.mkdir(mode=0o755)
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for path in (munge_dir, key):
            os.chown(path, munge.pw_uid, munge.pw_gid)
        munged = cluster._spawn(
            "munged",
            [
                _which("munged") or "munged",
                "--foreground",
                f"--socket={munge_sock}",
                f"--key-file={key}",
                f"--pid-file={munge_dir / 'munged.pid'}",
                f"--log-file={munge_dir / 'munged.log'}",
                f"--seed-file={munge_dir / 'munged.seed'}",
            ],
            user="munge",
            prefix=[],
        )
        cluster._wait_for(munged, munge_sock.exists, 10, "socket")
        mark("munged")
        _write(conf, _slurm_conf(cluster, ports, munge_sock, hw.get("RealMemory", 1000)))

        # 2. accounting: MariaDB + slurmdbd
        if accounting:
            _start_accounting(cluster, ports, munge_sock, mark)

        # 3. controller and node daemons; ready when every node reports idle
        ctld = cluster._spawn("slurmctld", [_which("slurmctld") or "slurmctld", "-D", "-i"])
        cluster._wait_for(ctld, lambda: _port_listening(ports["ctld"], cluster._netns_pid()), 60, "TCP port")
        mark("slurmctld")
        if cluster.network is None:
            slurmd = cluster._spawn("slurmd", [_which("slurmd") or "slurmd", "-D"])
        else:
            slurmd = [cluster.start_slurmd(i) for i in range(1, len(cluster.nodes) + 1)][-1]

        def node_idle() -> bool:
            if ctld.popen.poll() is not None:
                raise SlurmClusterError(
                    f"slurmctld exited with {ctld.popen.returncode}\n{cluster.log_tails()}"
                )
            out = cluster.run("sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout=10).stdout
            by_node = dict(line.split() for line in out.splitlines() if line.strip())  # once per partition
            states = list(by_node.values())
            for state in states:
                if state.rstrip("*") in ("drained", "inval", "draining", "drain"):
                    reason = cluster.run("sinfo", "-h", "-N", "-o", "%E", check=False, timeout=10).stdout
                    raise SlurmClusterError(
                        f"node {cluster.node} is {state}: {reason.strip()}\n{cluster.log_tails()}"
                    )
            return len(states) == len(cluster.nodes) and set(states) == {"idle"}

        cluster._wait_for(slurmd, node_idle, 30 + 5 * len(cluster.nodes), "idle node")
        for name in cluster.spares:
            cluster.set_node(name, "drain", "spare")
        mark("slurmd")
        cluster.timings["total"] = time.monotonic() - t_start
    except BaseException:
        cluster.stop()
        if os.environ.get("HPCFL_SLURM_KEEP") != "1":
            shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    return cluster


# --------------------------------------------------------------------------------------------
# pytest fixtures

_SESSION: dict[str, SlurmCluster] = {}


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A real single-node SLURM for the whole session (started once, even if several modules import
    this fixture); skips only when not root or the packages cannot be installed.

    Set ``HPCFL_SLURM_KEEP=1`` to keep its temp dir (configs, logs, job output) afterwards.
    """
    if sys.platform != "linux":
        pytest.skip("the local SLURM cluster needs Linux")
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster needs root (it starts slurmd/slurmctld/munged)")
    accounting = os.environ.get("HPCFL_SLURM_ACCOUNTING", "1") != "0"
    install_s = ensure_packages(accounting)
    if "cluster" not in _SESSION:
        cluster = start_cluster(accounting)
        cluster.timings["package_install"] = install_s
        _SESSION["cluster"] = cluster
        phases = ", ".join(f"{k} {v:.2f}s" for k, v in cluster.timings.items())
        print(f"\n[slurm_cluster] started in {cluster.timings['total']:.2f}s ({phases}) at {cluster.tmpdir}")
    yield _SESSION["cluster"]
    cluster = _SESSION.pop("cluster", None)
    if cluster is not None:  # the first teardown at session end stops it; later ones find nothing
        cluster.stop()
        if os.environ.get("HPCFL_SLURM_KEEP") != "1":
            shutil.rmtree(cluster.tmpdir, ignore_errors=True)


@pytest.fixture
def slurm_env(slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    """The session cluster, with its ``env`` (``SLURM_CONF``) exported into ``os.environ`` for one
    test, for code that runs the SLURM commands itself (submitit, ``hpcfl submit``)."""
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PATH", os.environ.get("PATH", "") + ":" + SBIN_PATH)
    return slurm_cluster
