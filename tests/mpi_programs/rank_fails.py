"""Run under ``mpiexec -n 2``: rank 1 fails alone while rank 0 waits in a collective.

``MODE`` is ``user`` (an HpcflError), ``bug`` (any other exception) or ``kill`` (SIGKILL, as the
out-of-memory killer would). It goes through the same rank guard and error path as ``hpcfl``.
"""

import os
import signal
import sys

from hpcfl.cli.main import run_command
from hpcfl.comm import get_comm, launched_world_size, launcher_rank, supervise_rank
from hpcfl.errors import DataError

supervise_rank([__file__, *sys.argv[1:]], rank=launcher_rank(), world_size=launched_world_size())

MODE = sys.argv[1]


def body() -> int:
    comm = get_comm()
    comm.barrier()
    if comm.rank == 1:
        if MODE == "user":
            raise DataError("the scratch disk of this node is full")
        if MODE == "bug":
            raise ZeroDivisionError("division by zero in a client update")
        os.kill(os.getpid(), signal.SIGKILL)
    comm.barrier()  # rank 0 would wait here forever
    return 0


sys.exit(run_command(body))
