"""Run under mpiexec: NTK-FL's kernel assembled from blocks shared among ranks (one reduce) equals
the single-process kernel bit for bit; the update computed from blocks on every rank (local products
+ one reduce) equals the single-process one up to summation order; and NTK-FL's step, evolution and
update computed on rank 0 and shared by one reduce (every loss and mode, with the spectrum), equals
the single-process one bit for bit on every rank."""

import torch

from hpcfl.algorithms.layout import StateLayout
from hpcfl.algorithms.ntkfl import NTKFL, NTKFLParams
from hpcfl.comm.mpi import MPIComm
from hpcfl.ntk.evolution import Rows, balance, evolve, kernel, weight_updates

comm = MPIComm()
g = torch.Generator().manual_seed(0)
C, P = 3, 40
jac = [torch.randn(4 + 3 * m, C, P, generator=g, dtype=torch.float64) for m in range(5)]  # 5 clients
N = sum(j.shape[0] for j in jac)
f0 = torch.randn(N, C, generator=g, dtype=torch.float64)
Y = torch.nn.functional.one_hot(torch.randint(0, C, (N,), generator=g), C).double()

H = kernel(jac, comm.rank, comm.size, comm.allreduce)
H1 = kernel(jac, 0, 1, lambda t: t)
evo = evolve(H, f0, Y, lr=0.5, grid=[1, 10, 50])
owner = balance([float(j.shape[0]) for j in jac], comm.size)
mine = [m for m, r in enumerate(owner) if r == comm.rank]
dw = comm.allreduce(weight_updates(jac, evo.sums, mine, lr=0.5))
dw1 = weight_updates(jac, evolve(H1, f0, Y, lr=0.5, grid=[1, 10, 50]).sums, range(len(jac)), lr=0.5)
shared = len(set(owner)) == comm.size  # every rank really computed a share
ok = torch.equal(H, H1) and torch.allclose(dw, dw1, rtol=1e-12, atol=1e-14) and shared
layout = StateLayout.of_model(torch.nn.Linear(9, 4))  # P = 40 parameters
sizes = [int(j.shape[0]) for j in jac]
rows = Rows(jac, list(f0.split(sizes)), list(Y.split(sizes)))
for loss, mode in (("ce", "discrete"), ("ce", "flow"), ("mse", "flow"), ("mse", "discrete")):
    params = NTKFLParams(grid=(1, 10, 50), eta=0.5, loss=loss, evolution=mode, kernel_cond=True)
    algo = NTKFL(params, layout=layout)
    many = algo.shared_step(H, rows, torch.float64, comm.rank, comm.allreduce)
    one = algo.shared_step(H1, rows, torch.float64, 0, lambda t: t)
    ok = ok and torch.equal(many.updates, one.updates) and torch.equal(many.outputs, one.outputs)
    ok = (
        ok and many.spectrum == one.spectrum and many.steps == one.steps and many.spectrum["kernel_cond"] >= 1
    )
print(f"rank {comm.rank}: {'OK' if ok else 'MISMATCH'}", flush=True)
