"""A rank guard: names the rank when a launched rank is killed by a signal.

When a rank dies by a signal (SIGKILL from the out-of-memory killer, a segfault), MPICH's
``mpiexec`` kills the other ranks at once but reports only a multi-line banner with the dead
process's PID; the surviving ranks are killed by SIGKILL too, so none of them can say anything.
So under a launcher with more than one rank, ``hpcfl`` turns its process into a small guard and
runs the real rank as the guard's child: the guard forwards signals to the child and, when the
child dies by a signal, prints one line naming the rank and the signal and exits with 128 + the
signal number (an ordinary non-zero exit, which ``mpiexec`` answers by ending every rank without
a banner). The child is killed when its guard is, so no rank outlives the job.

The guard replaces the starting process with ``exec`` of this file as a plain script, so it keeps
the PID and the launcher's file descriptors (the PMI socket) but holds no torch or hpcfl in memory
(~10 MB). Set ``HPCFL_RANK_GUARD=0`` to run without the guard. This module imports only the
standard library: it runs as a script.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

GUARD_ENV = "HPCFL_RANK_GUARD"  # "0": no guard; "child": this process is the guarded rank
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_PR_SET_PDEATHSIG = 1


def supervise_rank(args: Sequence[str], *, rank: int, world_size: int) -> None:
    """Become the guard of ``python ARGS`` (never returns), or return when no guard is wanted.

    Returns at once when the world has one rank, the guard is switched off, or this process
    already is the guarded child; otherwise this process is replaced by the guard, which exits
    with the child's exit code (128 + N for a child killed by signal N).
    """
    if world_size <= 1 or os.environ.get(GUARD_ENV, "") in ("0", "child"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # -I: the guard needs only the standard library, not this package's directory on sys.path.
    os.execv(
        sys.executable, [sys.executable, "-I", os.path.abspath(__file__), str(rank), sys.executable, *args]
    )


def die_with_parent(sig: int = signal.SIGKILL) -> None:  # pragma: no cover - runs in the child
    """Ask Linux to send ``sig`` to this process when the thread that started it dies (call it as a
    ``preexec_fn`` or a pool's initializer), so a killed parent leaves no orphan behind; a no-op
    where ``prctl`` is missing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        return


def guard(command: Sequence[str], rank: int) -> int:
    """Run ``command`` as the guarded rank ``rank``; return its exit code (128 + N if killed by N)."""
    env = {**os.environ, GUARD_ENV: "child"}
    # close_fds=False: the launcher's PMI socket (PMI_FD) must reach the child.
    child = subprocess.Popen(list(command), env=env, close_fds=False, preexec_fn=die_with_parent)
    for sig in _FORWARDED:
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    code = child.wait()
    if code >= 0:
        return code
    name = signal.Signals(-code).name
    print(f"hpcfl: error: rank {rank}: killed by {name}", file=sys.stderr, flush=True)
    return 128 - code


if __name__ == "__main__":  # the guard process: guard.py RANK COMMAND...
    sys.exit(guard(sys.argv[2:], int(sys.argv[1])))
