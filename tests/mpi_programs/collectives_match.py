"""Run under mpiexec: the deadline-bounded collectives of MPIComm give exactly what mpi4py's blocking
ones give (allreduce bit for bit, objects equal), for small and large payloads and every root."""

import numpy as np
import torch
from mpi4py import MPI

from hpcfl.comm.mpi import MPIComm

comm = MPIComm(timeout=60)
world = MPI.COMM_WORLD
ok = True
g = torch.Generator().manual_seed(comm.rank)
for n in (1, 1000, 1 << 20):
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(n, generator=g, dtype=dtype)
        reference = x.numpy().copy()
        world.Allreduce(MPI.IN_PLACE, reference)
        ok = ok and torch.equal(comm.allreduce(x.clone()), torch.from_numpy(reference))
objects = [None, 3, {"rank": comm.rank, "ids": list(range(comm.rank * 5))}, torch.arange(comm.rank + 3.0)]
objects.append(np.zeros(1 << 18) + comm.rank)  # ~2 MB of pickle
for obj in objects:
    mine, theirs = comm.allgather(obj), world.allgather(obj)
    ok = ok and len(mine) == comm.size and repr(mine) == repr(theirs)
    for root in range(comm.size):
        ok = ok and repr(comm.bcast(obj, root=root)) == repr(world.bcast(obj, root=root))
comm.barrier()
print(f"rank {comm.rank}: {'OK' if ok else 'MISMATCH'}", flush=True)
