"""Run under mpiexec on a GPU machine: MPIComm's allreduce of CUDA tensors equals the sum that a
single process (LocalComm) would hold, host-staged and, where MPI reports CUDA awareness, direct."""

import torch

from hpcfl.comm import LocalComm
from hpcfl.comm.mpi import MPIComm

comm = MPIComm()
aware = comm._cuda_aware  # what the library reports
ok = True
for dtype in (torch.float32, torch.float64):
    mine = [
        torch.randn(1001, generator=torch.Generator().manual_seed(r), dtype=dtype) for r in range(comm.size)
    ]
    expected = LocalComm().allreduce(torch.stack(mine).sum(0))
    for staged in (True, False):
        if not staged and not aware:
            continue
        comm._cuda_aware = not staged
        got = comm.allreduce(mine[comm.rank].cuda())
        ok &= got.is_cuda and torch.allclose(got.cpu(), expected, rtol=1e-6, atol=1e-6)
print(f"rank {comm.rank}: MPI CUDA-aware: {aware}", flush=True)
print(f"rank {comm.rank}: {'OK' if ok else 'MISMATCH'}", flush=True)
