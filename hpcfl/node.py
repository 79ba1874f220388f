"""What this node offers the ranks on it: the memory still available, how many ranks share it, and
how many of its cores other work keeps busy.

Used to turn ``auto`` memory budgets into bytes (the client-state store's, NTK-FL's round guard),
to refuse a synthetic dataset that cannot be held, and to say when torch threads oversubscribe a
shared node.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path


def available_memory_bytes() -> int:
    """Memory this process may still use: MemAvailable, capped by a cgroup limit (SLURM, containers).

    Read from /proc/meminfo and /sys/fs/cgroup (v2 ``memory.max - memory.current`` or v1
    ``memory.limit_in_bytes - memory.usage_in_bytes``); without /proc, ``sysconf`` available pages;
    0 when nothing can be read (so ``auto`` then chooses the disk).
    """
    avail: int | None = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return 0
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit_text = Path(limit_file).read_text().strip()
            if limit_text == "max":
                continue
            avail = min(avail, max(0, int(limit_text) - int(Path(usage_file).read_text().strip())))
        except (OSError, ValueError):
            continue
    return max(0, avail)


def local_ranks() -> int:
    """Ranks sharing this node, from the launcher's environment (Open MPI, MPICH/Hydra, SLURM); 1 if unknown."""
    for var in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"):
        try:
            return max(1, int(os.environ[var]))
        except (KeyError, ValueError):
            continue
    return 1


def memory_share(fraction: float) -> int:
    """Bytes one rank may use: ``fraction`` of :func:`available_memory_bytes`, shared by the ranks on
    this node (as the launcher reports them)."""
    return int(fraction * available_memory_bytes()) // local_ranks()


def allowed_cores() -> list[int]:
    """The CPUs this process may run on (its affinity; every CPU where that cannot be read)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _cpu_ticks(cores: list[int], stat: Path = Path("/proc/stat")) -> tuple[int, int] | None:
    """(busy, total) clock ticks of ``cores`` so far, from /proc/stat's per-CPU lines (None:
    unreadable, or a wanted line without the four numbers user, nice, system and idle: a sandbox's
    or an emulator's /proc/stat is no measurement, and this runs before any command)."""
    wanted = {f"cpu{c}" for c in cores}
    busy = total = 0
    try:
        lines = stat.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    for line in lines:
        name, _, rest = line.partition(" ")
        if name in wanted:
            try:
                ticks = [int(v) for v in rest.split()[:8]]
            except ValueError:
                return None
            if len(ticks) < 4:
                return None
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
            busy, total = busy + sum(ticks) - idle, total + sum(ticks)
    return (busy, total) if total else None


_SAMPLE: dict[str, float] = {}  # the last sample of busy_cores: {"at": monotonic seconds, "busy": cores}
_SAMPLE_KEPT_S = 60.0  # a sample this recent is reused (the CLI's, by the run it starts)


def busy_cores(interval: float = 0.3) -> float | None:
    """How many of this process's allowed cores other work kept busy during ``interval`` seconds
    (this process sleeps meanwhile), from /proc/stat; None where it cannot be read. A sample of
    the last minute is reused.

    Sampled rather than read from the load average, whose minute of smoothing still counts a run
    that just ended (a sweep's previous point) as load.
    """
    if _SAMPLE and time.monotonic() - _SAMPLE["at"] < _SAMPLE_KEPT_S:
        return _SAMPLE["busy"]
    cores = allowed_cores()
    before = _cpu_ticks(cores)
    if before is None:
        return None
    time.sleep(interval)
    after = _cpu_ticks(cores)
    if after is None or after[1] <= before[1]:
        return None
    busy = len(cores) * (after[0] - before[0]) / (after[1] - before[1])
    _SAMPLE.update(at=time.monotonic(), busy=busy)
    return busy


#: set by :func:`choose_wait_policy` when hpcfl, not the user, asked OpenMP to wait passively
PASSIVE_CHOSEN: list[bool] = []


def choose_wait_policy(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Ask OpenMP threads to sleep rather than spin (``OMP_WAIT_POLICY=PASSIVE``) when other work
    keeps more than half a core of this node busy, unless the user set a policy; True when set.

    Only before torch is imported (its OpenMP runtime reads the variable once, when it loads), so
    the ``hpcfl`` command calls it first thing. An idle node keeps OpenMP's default (spin, then
    sleep), the faster one when every thread has its core. Measured on the 2-core host at load 7-10
    from other jobs, 2 threads: 2.3-12 s a synthetic simplecnn FedAvg round by default, 9-23 s
    with ACTIVE, 0.9-2.1 s passive (1 thread: 0.45-0.66 s, hence the note of
    :func:`oversubscription_note` as well).
    """
    if "OMP_WAIT_POLICY" in environ or "torch" in sys.modules or len(allowed_cores()) < 2:
        return False
    busy = busy_cores()
    if busy is None or busy <= 0.5:
        return False
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    PASSIVE_CHOSEN.append(True)
    return True


def oversubscription_note(threads: int, ranks: int, cores: int, busy: float | None) -> str | None:
    """The one note for ``ranks`` processes of ``threads`` torch threads each on ``cores`` cores of
    which other work keeps ``busy`` busy, when they are more threads than free cores; else None.

    An OpenMP thread spinning while its partner is descheduled costs far more than the load
    explains, and one thread was fastest under load (measured: :func:`choose_wait_policy`).
    """
    if busy is None or threads <= 1:
        return None
    free = max(0.0, cores - busy)
    if threads * ranks <= free + 0.5:  # half a core of slack: a sample of 0.3 s is noisy
        return None
    per_rank = "" if ranks == 1 else f" per rank x {ranks} ranks"
    passive = " (hpcfl set OMP_WAIT_POLICY=PASSIVE, which helps)" if PASSIVE_CHOSEN else ""
    return (
        f"hpcfl: note: other work keeps {busy:.1f} of this node's {cores} cores busy, so {threads} torch "
        f"threads{per_rank} oversubscribe it and rounds can take many times longer{passive}; set "
        "threads: 1 (--set threads=1) while the node is shared"
    )
