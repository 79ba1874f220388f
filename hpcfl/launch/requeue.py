"""Requeue a SLURM job after a lost peer, also from a batch host that was cut off (issue 61).

The rank that names a lost peer asks SLURM to requeue the job. When its own host lost its link,
the controller does not answer; exiting then would be reported once the link is back, and SLURM,
which has requeued the job on the node's failure meanwhile (same job id), could take that exit for
the end of the rerun. So the request is repeated until the controller answers (at most
``wait_s``); a job whose restart count has grown past this run's (``SLURM_RESTART_COUNT``) was
requeued already, and this process, a stale copy, waits for slurmd to end it. ``slurm/cpu.sbatch``
and ``gpu.sbatch`` follow the same rule in shell.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable

WAIT_S = 900.0  # keep asking an unreachable controller this long
STALE_WAIT_S = 600.0  # a stale copy waits this long for slurmd to end it
POLL_S = 5.0


def restarts(job_id: str) -> int | None:
    """The job's restart count as the controller reports it, or None when it does not answer."""
    proc = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, check=False
    )
    found = re.search(r"\bRestarts=(\d+)", proc.stdout) if proc.returncode == 0 else None
    return int(found.group(1)) if found else None


def requeue_lost_peer(
    job_id: str,
    *,
    wait_s: float = WAIT_S,
    stale_wait_s: float = STALE_WAIT_S,
    poll_s: float = POLL_S,
    say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> None:
    """Ask SLURM to requeue ``job_id`` (see the module); lines for the log go through ``say``."""
    ours = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    until = time.monotonic() + wait_s
    while time.monotonic() < until:
        count = restarts(job_id)
        if count is None:  # the controller does not answer (this host cut off): ask again
            time.sleep(poll_s)
            continue
        if count > ours:
            say(f"hpcfl: job {job_id} was requeued by SLURM meanwhile; this run waits to be ended")
            time.sleep(stale_wait_s)
            return
        proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            say(f"hpcfl: requeue of job {job_id} refused: {proc.stderr.strip()}")
        return
    say(f"hpcfl: the controller did not answer for {wait_s:.0f} s; resume with: scontrol requeue {job_id}")
