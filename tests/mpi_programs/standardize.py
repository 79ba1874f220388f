"""Run under mpiexec: federated standardisation over ranks equals centralised standardisation, and
its bits equal one rank's (the per-client sums are added in client order whatever the placement)."""

import torch

from hpcfl.comm import LocalComm
from hpcfl.comm.mpi import MPIComm
from hpcfl.tct.problem import federated_moments

comm = MPIComm()
g = torch.Generator().manual_seed(0)
blocks = [torch.randn(20 + 5 * k, 7, generator=g) * (k + 1) + k for k in range(5)]  # 5 clients
mine = {k: b for k, b in enumerate(blocks) if k % comm.size == comm.rank}
m = federated_moments(mine, comm, p=7, clients=5, chunk_bytes=8 * 5 * 4)  # 4 columns per allreduce
allz = torch.cat(blocks).double()
ok = torch.allclose(m.mean, allz.mean(0), rtol=1e-12, atol=1e-12) and torch.allclose(
    m.std, allz.std(0, unbiased=False), rtol=1e-10, atol=1e-12
)
one = federated_moments(dict(enumerate(blocks)), LocalComm(), p=7, clients=5)
ok = ok and torch.equal(m.mean, one.mean) and torch.equal(m.std, one.std)
assert m.count == allz.shape[0]
print(f"rank {comm.rank}: {'OK' if ok else 'MISMATCH'}", flush=True)
