"""What this node offers the ranks on it: the memory still available, and how many ranks share it.

Used to turn ``auto`` memory budgets into bytes (the client-state store's, NTK-FL's round guard).
"""

from __future__ import annotations

import os
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
