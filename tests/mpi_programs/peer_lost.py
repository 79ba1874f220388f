"""Run under ``mpiexec -n N``: some ranks stop answering while the others wait in a collective.

``MODE`` is ``stop`` (the ranks SIGSTOP themselves mid-run: a host that vanished without its
processes exiting), ``kill`` (SIGKILL mid-run; run with the rank guard off and
``-disable-auto-cleanup``, so nothing but the communicator notices), ``start`` (SIGSTOP after MPI is
initialised, before the communicator's start-up exchange) or ``run`` (nobody stops; the job runs
``STEPS`` steps, a healthy job for strangers to knock on). ``TIMEOUT`` is the collective deadline in
seconds; ``RANKS`` the comma-separated ranks that stop (default: the last). Every rank prints
``OK <sum>`` when the job ends normally. ``slow SECONDS`` (in place of ``RANKS``): the last rank
computes (matrix products, its main thread busy) for SECONDS, many deadlines long, before the
collective the others wait in; every rank then prints ``OK <rank> waited <seconds>`` when the sums
are right. It goes through the same rank guard and error path as ``hpcfl``.
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
SLOW_S = float(sys.argv[3]) if MODE == "slow" else 0.0
STOPPING = (
    [int(r) for r in sys.argv[3].split(",")]
    if len(sys.argv) > 3 and MODE != "slow"
    else [launched_world_size() - 1]
)
STEPS = int(sys.argv[4]) if len(sys.argv) > 4 else 3


def body() -> int:
    if MODE == "start":
        from mpi4py import MPI  # initialises MPI: every rank is past MPI_Init

        if MPI.COMM_WORLD.Get_rank() in STOPPING:
            os.kill(os.getpid(), signal.SIGSTOP)
    comm = get_comm("auto", TIMEOUT)
    if MODE == "slow":
        return slow(comm)
    total = 0.0
    for step in range(STEPS):
        total += float(comm.allreduce(torch.full((1000,), float(step + 1), dtype=torch.float64)).sum())
        total += sum(comm.allgather(step)) + comm.bcast(step)
        if MODE == "run":
            time.sleep(0.01)  # a step of work: strangers knock while the ranks compute and wait
    if MODE in ("stop", "kill") and comm.rank in STOPPING:
        os.kill(os.getpid(), signal.SIGSTOP if MODE == "stop" else signal.SIGKILL)
    comm.allreduce(torch.ones(1000, dtype=torch.float64))  # the other ranks would wait here forever
    comm.barrier()
    print(f"OK {total:.1f}", flush=True)
    return 0


def slow(comm) -> int:
    """The last rank computes for SLOW_S seconds while the others wait in an allreduce."""
    total = torch.ones(1000, dtype=torch.float64)
    for step in range(3):
        comm.allreduce(total)
        comm.allgather(step)
        comm.bcast(step)
    if comm.rank in STOPPING:
        torch.set_num_threads(1)
        a, until = torch.randn(256, 256, dtype=torch.float64), time.monotonic() + SLOW_S
        while time.monotonic() < until:  # compute, not sleep: the main thread stays busy
            a = torch.tanh(a @ a)
    started = time.monotonic()
    comm.allreduce(total)  # the other ranks wait here through many deadlines
    waited = time.monotonic() - started
    comm.barrier()
    assert torch.equal(total, torch.full_like(total, float(comm.size) ** 4)), total[:3]
    print(f"OK {comm.rank} waited {waited:.1f}", flush=True)
    return 0


sys.exit(run_command(body))
