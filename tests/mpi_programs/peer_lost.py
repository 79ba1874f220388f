"""Run under ``mpiexec -n N``: the last rank stops answering mid-run while the others wait in a collective.

``MODE`` is ``stop`` (the rank SIGSTOPs itself: a host that vanished without its processes exiting)
or ``kill`` (SIGKILL; run with the rank guard off and ``-disable-auto-cleanup``, so nothing but the
communicator notices), or ``slow SECONDS``: the last rank computes (matrix products, its main thread
busy) for SECONDS, many deadlines long, before the collective the others wait in; every rank then
prints ``OK <rank> waited <seconds>`` when the sums are right. ``TIMEOUT`` is the collective deadline
in seconds. It goes through the same rank guard and error path as ``hpcfl``.
"""

import os
import signal
import sys
import time

import torch

from hpcfl.cli.main import run_command
from hpcfl.comm import get_comm, launched_world_size, launcher_rank, supervise_rank

supervise_rank([__file__, *sys.argv[1:]], rank=launcher_rank(), world_size=launched_world_size())

MODE, TIMEOUT = sys.argv[1], sys.argv[2]


def body() -> int:
    comm = get_comm("auto", TIMEOUT)
    total = torch.ones(1000, dtype=torch.float64)
    for step in range(3):
        comm.allreduce(total)
        comm.allgather(step)
        comm.bcast(step)
    if MODE == "slow" and comm.rank == comm.size - 1:
        torch.set_num_threads(1)
        a, until = torch.randn(256, 256, dtype=torch.float64), time.monotonic() + float(sys.argv[3])
        while time.monotonic() < until:  # compute, not sleep: the main thread stays busy
            a = torch.tanh(a @ a)
    elif comm.rank == comm.size - 1:
        os.kill(os.getpid(), signal.SIGSTOP if MODE == "stop" else signal.SIGKILL)
    started = time.monotonic()
    comm.allreduce(total)  # the other ranks would wait here forever
    waited = time.monotonic() - started
    comm.barrier()
    assert torch.equal(total, torch.full_like(total, float(comm.size) ** 4)), total[:3]
    print(f"OK {comm.rank} waited {waited:.1f}", flush=True)
    return 0


sys.exit(run_command(body))
