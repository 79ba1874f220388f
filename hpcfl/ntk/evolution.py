"""The server side of one NTK-FL round (Yue et al., ICML 2022, Section 4.1, Eqs. 6-11).

With N = Σ_m N_m samples, C outputs and the round's per-sample Jacobians J (N, C, P):

- kernel (Eq. 6): H_ij = (1/C)⟨J_i, J_j⟩_F (N × N); the block H_ml of clients m, l is one product
  J_m J_lᵀ, and the blocks are shared among ranks (largest first to the least-loaded rank), each rank
  filling its blocks of a zero matrix and one reducer call summing them into the full H;
- evolution (Eq. 9a), one eigendecomposition H = U diag(λ) Uᵀ in float64: with R₀ = f⁽⁰⁾ − Y and
  c = ηλ/N, the residual at step t is R(t) = U diag(g_t(c)) Uᵀ R₀ and the sum the weights need is
  S(t) = Σ_{u<t} R(u) = U diag(G_t(c)) Uᵀ R₀, for every t of the grid at once:

  ``flow`` (the paper's Eq. 9a, gradient flow sampled at integer u): g_t = e^{−ct},
  G_t = (1 − e^{−ct})/(1 − e^{−c}); ``discrete`` (gradient descent of the linearised model,
  exactly): g_t = (1 − c)^t, G_t = (1 − (1 − c)^t)/c; both G_t = t at c = 0;
- weight update (Eqs. 9b, 10): Δw(t) = −(η/(N·C)) Σ_m J_mᵀ S_m(t), a product over each rank's own
  clients plus ONE reducer call for all grid points.

The paper's H sums the C diagonal output blocks of the full (NC × NC) NTK (Eq. 6), so f evolves
under H ⊗ I_C; for C = 1 this is exactly gradient descent of the linearised network (tested).

``loss="ce"`` is the reference code's cross-entropy evolution, df/dt = −(η/N) H (softmax(f) − Y),
integrated by explicit Euler steps of ``dt`` time units (S accumulates dt·R at each step); its
weight update is the reference code's −(η/N) Σ Jᵀ S, gradient descent on the per-sample cross
entropy (summed over outputs). The flow it is paired with uses H = ⟨J, J⟩/C as the reference
does, so the weights move C times further than the linearised flow predicts; t* is then chosen
by the real network's loss, which absorbs the factor.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from hpcfl.entk.jacobian import FactoredJacobian

Jacobian = Tensor | FactoredJacobian
"""A group of rows' per-sample Jacobians: dense (n, C, P) or as Linear-layer factors (same values)."""


@dataclass
class Rows:
    """The round's gathered rows, grouped by (virtual) client, in a fixed order.

    ``jacobians[m]`` (n_m, C, P), ``outputs[m]`` f⁽⁰⁾(X_m) (n_m, C), ``labels[m]`` one-hot (n_m, C),
    ``inputs[m]`` the samples the real network is evaluated on when t* is chosen by training loss
    (None when it is chosen otherwise).
    """

    jacobians: list[Jacobian]
    outputs: list[Tensor]
    labels: list[Tensor]
    inputs: list[Tensor] | None = None

    @property
    def sizes(self) -> list[int]:
        return [int(j.shape[0]) for j in self.jacobians]

    @property
    def total(self) -> int:
        return sum(self.sizes)


def balance(costs: Sequence[float], world: int) -> list[int]:
    """The rank that does each item: largest cost first to the least-loaded rank (ties: lowest rank,
    then item order), so every rank computes the same assignment."""
    owner = [0] * len(costs)
    loads = [(0.0, r) for r in range(world)]
    heapq.heapify(loads)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(loads)
        owner[i] = r
        heapq.heappush(loads, (load + costs[i], r))
    return owner


def gram(a: Jacobian, b: Jacobian) -> Tensor:
    """G_ij = Σ_c ⟨J_ic, J'_jc⟩ (n_a, n_b) in the Jacobians' dtype: one matrix product when dense,
    the layer factors' Gram matrices when factored."""
    if isinstance(a, FactoredJacobian) and isinstance(b, FactoredJacobian):
        return a.gram(b)
    if isinstance(a, FactoredJacobian) or isinstance(b, FactoredJacobian):
        raise TypeError("a round's Jacobians must be all dense or all factored")
    return a.reshape(a.shape[0], -1) @ b.reshape(b.shape[0], -1).T


def transposed_product(J: Jacobian, S: Tensor) -> Tensor:
    """Σ_i Σ_c S[ψ, i, c] J[i, c, :] for every ψ: S (Ψ, n, C) → (Ψ, P) in the Jacobian's dtype."""
    if isinstance(J, FactoredJacobian):
        return J.transposed_product(S)
    n, C, P = J.shape
    return S.reshape(S.shape[0], n * C).to(J.dtype) @ J.reshape(n * C, P)


def kernel(
    jacobians: Sequence[Jacobian], rank: int, world: int, reduce: Callable[[Tensor], Tensor]
) -> Tensor:
    """H (N, N) float64, H_ij = (1/C)⟨J_i, J_j⟩, blocks shared among ranks and summed by ``reduce``.

    Each block is computed in the Jacobians' dtype by one matrix product (the same product on
    whichever rank owns it), so H does not depend on the number of ranks.
    """
    sizes = [int(j.shape[0]) for j in jacobians]
    C = int(jacobians[0].shape[1])
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    pairs = [(m, l) for m in range(len(sizes)) for l in range(m, len(sizes))]
    owner = balance([float(sizes[m] * sizes[l]) for m, l in pairs], world)
    device = jacobian_device(jacobians[0])
    H = torch.zeros(starts[-1], starts[-1], dtype=torch.float64, device=device)
    for (m, l), r in zip(pairs, owner, strict=True):
        if r != rank:
            continue
        block = gram(jacobians[m], jacobians[l]).to(torch.float64) / C  # (n_m, n_l)
        H[starts[m] : starts[m + 1], starts[l] : starts[l + 1]] = block
        if l != m:
            H[starts[l] : starts[l + 1], starts[m] : starts[m + 1]] = block.T
    return reduce(H)


@dataclass
class Evolution:
    """The closed-form trajectory at the grid points: S(t) = Σ_{u<t}(f⁽ᵘ⁾ − Y) and f⁽ᵗ⁾ (Ψ, N, C),
    and the kernel's eigenvalues (ascending)."""

    sums: Tensor
    outputs: Tensor
    eigenvalues: Tensor
    eigh_seconds: float = 0.0  # time of the eigendecomposition (eigenvalues only for CE) alone


def evolve(
    H: Tensor,
    f0: Tensor,
    Y: Tensor,
    *,
    lr: float,
    grid: Sequence[int],
    mode: str = "flow",
    loss: str = "mse",
    dt: int = 10,
) -> Evolution:
    """The function-space evolution over ``grid`` (see the module docstring); all in float64."""
    N = H.shape[0]
    f0, Y = f0.to(torch.float64), Y.to(torch.float64)
    if loss == "ce":
        return _evolve_ce(H, f0, Y, lr=lr, grid=grid, dt=dt)
    start = time.perf_counter()
    lam, U = torch.linalg.eigh(H)
    eigh_seconds = time.perf_counter() - start
    lam = lam.clamp_min(0.0)  # round-off negatives of a PSD matrix
    c = lr * lam / N  # (N,)
    t = torch.tensor(list(grid), dtype=torch.float64, device=H.device).unsqueeze(1)  # (Ψ, 1)
    if mode == "flow":
        g = torch.exp(-c * t)  # (Ψ, N)
        G = torch.where(c > 0, torch.expm1(-c * t) / torch.expm1(-c).where(c > 0, -1.0), t)
    else:
        g = (1.0 - c) ** t
        G = torch.where(c > 0, (1.0 - g) / c.where(c > 0, 1.0), t)
    r0 = U.T @ (f0 - Y)  # (N, C) residual in the eigenbasis
    sums = U @ (G.unsqueeze(2) * r0)  # (Ψ, N, C)
    outputs = Y + U @ (g.unsqueeze(2) * r0)
    return Evolution(sums=sums, outputs=outputs, eigenvalues=lam, eigh_seconds=eigh_seconds)


def _evolve_ce(H: Tensor, f0: Tensor, Y: Tensor, *, lr: float, grid: Sequence[int], dt: int) -> Evolution:
    """Explicit Euler of df/dt = −(η/N) H (softmax(f) − Y) with steps of ``dt``; grid points must be
    multiples of ``dt`` (checked by the hyper-parameters)."""
    N = H.shape[0]
    f, acc = f0.clone(), torch.zeros_like(f0)
    wanted = {int(t): i for i, t in enumerate(grid)}
    sums = torch.empty(len(grid), *f0.shape, dtype=torch.float64, device=f0.device)
    outputs = torch.empty_like(sums)
    for step in range(0, max(wanted) + 1, dt):
        if step in wanted:
            sums[wanted[step]], outputs[wanted[step]] = acc, f
        residual = torch.softmax(f, dim=1) - Y
        acc = acc + dt * residual
        f = f - (dt * lr / N) * (H @ residual)
    start = time.perf_counter()
    lam = torch.linalg.eigvalsh(H).clamp_min(0.0)  # the metrics' spectrum only: no eigenvectors
    return Evolution(sums=sums, outputs=outputs, eigenvalues=lam, eigh_seconds=time.perf_counter() - start)


def jacobian_device(J: Jacobian) -> torch.device:
    """The device a Jacobian's numbers live on."""
    return J.layers[0].a.device if isinstance(J, FactoredJacobian) else J.device


def weight_updates(
    jacobians: Sequence[Jacobian], sums: Tensor, mine: Sequence[int], *, lr: float, per_output: bool = True
) -> Tensor:
    """This rank's part of Δw(t) = −(η/(N·C)) Σ_m J_mᵀ S_m(t) for every grid point → (Ψ, P) float64,
    over the clients ``mine`` (sum the parts of all ranks for the update). ``per_output=False`` drops
    the 1/C: −(η/N) Σ Jᵀ S, gradient descent on the cross entropy summed over outputs (the reference
    code's update for ``loss="ce"``)."""
    Psi, N, C = sums.shape
    P = int(jacobians[0].shape[2])
    out = torch.zeros(Psi, P, dtype=torch.float64, device=sums.device)
    start = 0
    bounds = []
    for j in jacobians:
        bounds.append((start, start + int(j.shape[0])))
        start += int(j.shape[0])
    for m in mine:
        a, b = bounds[m]
        out += transposed_product(jacobians[m], sums[:, a:b]).to(torch.float64)
    return out * (-lr / (N * C if per_output else N))
