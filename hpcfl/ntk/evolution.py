"""The server side of one NTK-FL round (Yue et al., ICML 2022, Section 4.1, Eqs. 6-11).

With N = Σ_m N_m samples, C outputs and the round's per-sample Jacobians J (N, C, P):

- kernel (Eq. 6): H_ij = (1/C)⟨J_i, J_j⟩_F (N × N); the block H_ml of clients m, l is one product
  J_m J_lᵀ, and the blocks are shared among ranks (largest first to the least-loaded rank), each rank
  filling its blocks of a zero matrix and one reducer call summing them into the full H;
- evolution of f over the grid {t₁…t_Ψ} and the residual sums S(t) the weights need (below);
- weight update (Eqs. 9b, 10): Δw(t) = −(η/(N·κ)) Σ_m J_mᵀ S_m(t) for all grid points, over a given
  set of clients (κ = C for MSE, 1 for cross entropy); NTK-FL computes evolution and update on
  rank 0 and shares them (:meth:`hpcfl.algorithms.ntkfl.NTKFL.shared_step`).

The time scale is the weight update's. Every evolution here is the one the update Δw realises on the
linearised model f(w) = f⁽⁰⁾ + J(w − w⁽⁰⁾) with the kernel H ⊗ I_C (exact when the full NTK block
J_i J_jᵀ is H_ij·I_C, e.g. a linear model; tested: J·Δw(t) = f(t) − f(0) to 1e-10):

- ``loss="mse"``: hpcfl's (and the paper's, Section 3.2) loss is (1/N)Σ_i (1/C)Σ_j ½(f_ij − y_ij)²,
  whose gradient step is Eq. 10's Δw = −(η/(N·C)) Σ Jᵀ(f − Y); it moves f by −(η/(N·C)) H (f − Y).
  So f evolves with c = η·λ/(N·C) per unit of t in H's eigenbasis. The paper's Eq. 9a prints
  exp(−ηtH/N), which would move f C times faster than its own Eq. 10 can move the weights; the
  authors' code (``gradient_descent_mse`` divides by ``y_train.numel()`` = N·C) uses N·C, the
  consistent form, and so does this module. One float64 eigendecomposition H = U diag(λ) Uᵀ serves
  all grid points, with R₀ = f⁽⁰⁾ − Y: R(t) = U diag(g_t(c)) Uᵀ R₀, S(t) = U diag(G_t(c)) Uᵀ R₀:

  ``discrete`` (gradient descent on the linearised model, exactly): g_t = (1 − c)^t and
  S(t) = Σ_{u=0}^{t−1} R(u), G_t = (1 − (1 − c)^t)/c — the sum unrolled gradient descent gives:
  w(t) = w(0) − η/(N·C) Σ_{u=0}^{t−1} Jᵀ R(u). The authors' MSE update sums u = 1..t, one step
  late (the residual after each step rather than the one the step is taken from); hpcfl does not.
  ``flow`` (the gradient flow, Eq. 5/7 on this time scale): g_t = e^{−ct} and S(t) = ∫₀ᵗ R(u) du,
  G_t = (1 − e^{−ct})/c, so that J·Δw(t) = f(t) − f(0) holds for the flow too. Both G_t = t at c = 0.

- ``loss="ce"``: df/dt = −(η/N) H (softmax(f) − Y) (the reference code's right-hand side), whose
  weight update is −(η/N) Σ Jᵀ S: gradient descent on the mean per-sample cross entropy summed over
  outputs, no 1/C (the reference code's; the same kernel H = ⟨J, J⟩/C as the paper). No closed form:

  ``discrete``: gradient descent on the linearised model with step 1 (f ← f − (η/N)H(softmax(f) − Y),
  S ← S + softmax(f) − Y, u = 0..t−1), which is exact, so its only error is that of the products of
  H, one per step (:func:`hpcfl.ntk.product.kernel_product`: float64, float32, or deflated int8 limbs
  to :data:`hpcfl.ntk.product.INT8_TOLERANCE` on a CPU; f and S accumulate in float64).
  ``flow``: the continuous flow, classical Runge-Kutta (RK4) on (f, S) with equal steps of at most
  ``dt`` between grid points, split further so that h·μ ≤ :data:`RK4_STEP` where μ = η·ρ/(2N) bounds
  the right-hand side's Lipschitz constant (ρ = :func:`lambda_bound` ≥ λ_max(H), ½ ≥ the softmax
  Jacobian's largest eigenvalue); RK4's real stability limit is 2.785, so no step is ever unstable,
  and a ``dt`` past the limit is split, the step taken reported (``Evolution.dt``). Accuracy at this
  setting (:data:`RK4_TOLERANCE`): max over grid points of ‖f − f_exact‖ ≤ 1e-4 · max ‖f(t) − f(0)‖
  (tested against RK4 with 10× shorter steps; measured ≤ 6e-6 on the tests' tiny-MLP kernels and
  5e-7 on a Fashion-MNIST MLP kernel, N = 192, η = 0.01, the 12-point grid to 2,000). It costs 4 products of H per step, against 1 for ``discrete``.

The reference code integrates the cross-entropy flow with torchdiffeq's adaptive dopri5; explicit Euler
with steps of 10 (hpcfl before issue 32) was past its stability limit at the paper's setup
(dt·η·λ_max/N ≈ 25·s with s ≤ ½), so it is gone.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from hpcfl.entk.jacobian import FactoredJacobian
from hpcfl.ntk.product import Product, kernel_product

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


RK4_STEP = 2.0
"""Largest h·μ of a flow step (μ = η·ρ/(2N) bounds the cross-entropy flow's Lipschitz constant);
RK4's stability interval on the negative real axis ends at 2.785."""

RK4_TOLERANCE = 1e-4
"""The cross-entropy flow's stated accuracy at :data:`RK4_STEP`: max over grid points of the error
of f, relative to the largest movement max_t ‖f(t) − f(0)‖ (tested)."""


@dataclass
class Evolution:
    """The trajectory at the grid points: S(t) (Ψ, N, C) the residual sum (``discrete``) or integral
    (``flow``) the weight update needs, f⁽ᵗ⁾ (Ψ, N, C), and how it was computed: ``steps`` (products
    of H taken; 0 for the closed form), ``dt`` (the flow's step actually taken; 0 when none), the
    eigenvalues when an eigendecomposition was needed (MSE), else None."""

    sums: Tensor
    outputs: Tensor
    steps: int = 0
    dt: float = 0.0
    eigenvalues: Tensor | None = None
    eigh_seconds: float = 0.0  # time of the eigendecomposition alone (MSE)


def lambda_bound(H: Tensor) -> float:
    """ρ ≥ λ_max(H) for a symmetric H, without an eigendecomposition: min(max row ‖·‖₁, ‖H‖_F),
    both upper bounds of the spectral radius; O(N²), and close for an NTK's dominant mode."""
    return min(float(H.abs().sum(dim=1).max()), float(torch.linalg.matrix_norm(H)))


def condition(H: Tensor, eigenvalues: Tensor | None = None) -> tuple[float, float]:
    """(λ_max, λ_max/λ_min) of the PSD kernel (λ_min floored at λ_max·1e-16); eigenvalues only
    (``eigvalsh``), reusing ``eigenvalues`` when the evolution already has them."""
    lam = torch.linalg.eigvalsh(H) if eigenvalues is None else eigenvalues
    lam = lam.clamp_min(0.0)
    lam_max = float(lam[-1])
    return lam_max, lam_max / max(float(lam[0]), lam_max * 1e-16, 1e-300)


def evolve(
    H: Tensor,
    f0: Tensor,
    Y: Tensor,
    *,
    lr: float,
    grid: Sequence[float],
    mode: str = "discrete",
    loss: str = "ce",
    dt: float = 10.0,
    dtype: torch.dtype = torch.float64,
    precision: str = "auto",
) -> Evolution:
    """The function-space evolution over ``grid`` (see the module docstring), in float64; the
    cross-entropy evolution's products of H by ``precision`` (:mod:`hpcfl.ntk.product`; ``auto``
    resolves with ``dtype``, the model's), accumulated in float64."""
    f0, Y = f0.to(torch.float64), Y.to(torch.float64)
    if loss == "ce":
        matvec = kernel_product(H, precision, dtype)
        if mode == "discrete":
            return _descend_ce(matvec, f0, Y, lr=lr, grid=grid)
        return _flow_ce(H, matvec, f0, Y, lr=lr, grid=grid, dt=dt)
    N, C = f0.shape
    start = time.perf_counter()
    lam, U = torch.linalg.eigh(H)
    eigh_seconds = time.perf_counter() - start
    lam = lam.clamp_min(0.0)  # round-off negatives of a PSD matrix
    c = lr * lam / (N * C)  # (N,): f's rate per unit of t, on the update's time scale
    t = torch.tensor([float(u) for u in grid], dtype=torch.float64, device=H.device).unsqueeze(1)  # (Ψ, 1)
    positive = c > 0
    safe = c.where(positive, 1.0)
    if mode == "flow":
        g = torch.exp(-c * t)  # (Ψ, N)
        G = torch.where(positive, -torch.expm1(-c * t) / safe, t)  # ∫₀ᵗ e^{−cu} du
    else:
        g = (1.0 - c) ** t
        G = torch.where(positive, (1.0 - g) / safe, t)  # Σ_{u=0}^{t−1} (1 − c)^u
    r0 = U.T @ (f0 - Y)  # (N, C) residual in the eigenbasis
    sums = U @ (G.unsqueeze(2) * r0)  # (Ψ, N, C)
    outputs = Y + U @ (g.unsqueeze(2) * r0)
    return Evolution(sums=sums, outputs=outputs, eigenvalues=lam, eigh_seconds=eigh_seconds)


def _descend_ce(matvec: Product, f0: Tensor, Y: Tensor, *, lr: float, grid: Sequence[float]) -> Evolution:
    """Gradient descent with step 1 on the linearised model's cross entropy: one product per step."""
    N = f0.shape[0]
    if any(float(t) != int(t) for t in grid):
        raise ValueError("evolution: discrete needs integer grid points")
    f, acc = f0.clone(), torch.zeros_like(f0)
    wanted = {int(t): i for i, t in enumerate(grid)}
    sums = torch.empty(len(grid), *f0.shape, dtype=torch.float64, device=f0.device)
    outputs = torch.empty_like(sums)
    last = max(wanted)
    for step in range(last + 1):
        if step in wanted:
            sums[wanted[step]], outputs[wanted[step]] = acc, f
        if step == last:
            break
        residual = torch.softmax(f, dim=1) - Y
        acc = acc + residual
        f = f - (lr / N) * matvec(residual)
    return Evolution(sums=sums, outputs=outputs, steps=last, dt=1.0)


def flow_step(H: Tensor, N: int, lr: float, dt: float) -> float:
    """The flow's step: the largest h ≤ ``dt`` with h·η·ρ/(2N) ≤ :data:`RK4_STEP` (ρ from
    :func:`lambda_bound`); grid intervals are then cut into equal steps no longer than it."""
    mu = lr * lambda_bound(H) / (2 * N)
    return min(float(dt), RK4_STEP / mu) if mu > 0 else float(dt)


def _flow_ce(
    H: Tensor, matvec: Product, f0: Tensor, Y: Tensor, *, lr: float, grid: Sequence[float], dt: float
) -> Evolution:
    """RK4 on (f, S) of df/dt = −(η/N) H (softmax(f) − Y), dS/dt = softmax(f) − Y (``matvec``: v ↦ H v)."""
    N = H.shape[0]
    h_max = flow_step(H, N, lr, dt)
    a = lr / N

    def rhs(f: Tensor) -> tuple[Tensor, Tensor]:
        r = torch.softmax(f, dim=1) - Y
        return -a * matvec(r), r

    f, acc, now, steps, taken = f0.clone(), torch.zeros_like(f0), 0.0, 0, 0.0
    sums = torch.empty(len(grid), *f0.shape, dtype=torch.float64, device=f0.device)
    outputs = torch.empty_like(sums)
    for i, t in enumerate(grid):
        n = math.ceil((float(t) - now) / h_max - 1e-9) if float(t) > now else 0
        h = (float(t) - now) / n if n else 0.0
        taken = max(taken, h)
        for _ in range(n):
            k1f, k1s = rhs(f)
            k2f, k2s = rhs(f + 0.5 * h * k1f)
            k3f, k3s = rhs(f + 0.5 * h * k2f)
            k4f, k4s = rhs(f + h * k3f)
            f = f + (h / 6) * (k1f + 2 * k2f + 2 * k3f + k4f)
            acc = acc + (h / 6) * (k1s + 2 * k2s + 2 * k3s + k4s)
        steps += 4 * n
        now = float(t)
        sums[i], outputs[i] = acc, f
    return Evolution(sums=sums, outputs=outputs, steps=steps, dt=taken)


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
