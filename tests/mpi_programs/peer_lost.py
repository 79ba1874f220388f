"""Run under ``mpiexec -n N``: the last rank stops answering mid-run while the others wait in a collective.

``MODE`` is ``stop`` (the rank SIGSTOPs itself: a host that vanished without its processes exiting)
or ``kill`` (SIGKILL; run with the rank guard off and ``-disable-auto-cleanup``, so nothing but the
communicator notices). ``TIMEOUT`` is the collective deadline in seconds. It goes through the same
rank guard and error path as ``hpcfl``.
"""

import os
import signal
import sys

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
    if comm.rank == comm.size - 1:
        os.kill(os.getpid(), signal.SIGSTOP if MODE == "stop" else signal.SIGKILL)
    comm.allreduce(total)  # the other ranks would wait here forever
    comm.barrier()
    return 0


sys.exit(run_command(body))
