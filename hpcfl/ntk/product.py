"""Products v ↦ H v with the round's kernel: the whole cost of the cross-entropy evolution.

The evolution (:mod:`hpcfl.ntk.evolution`) takes one product of the N × N kernel H with the N × C
residual per step, sequentially, 2,000 of them at the paper's grid. At the paper's setup (N = 4,200,
C = 10) a float32 product is memory- and shape-bound on a CPU (17 ms on one core: an N × 10 right
side is a poor GEMM shape), which made the evolution ~80× the kernel's own computation. Three ways,
chosen by ``precision`` (:data:`PRECISIONS`):

- ``float64``: H v exactly as stored (the reference; what a float64 model gets under ``auto``).
- ``float32``: H held once in float32, the right side padded to 16 columns (measured 1.7× faster than
  10 columns on the same numbers), the result in float64; relative error ~1e-7 of f's movement.
- ``int8``: H = B Uᵀ + diag(d) + R, with U (N, k) H's dominant invariant subspace (k = :data:`DEFLATE`,
  from a seeded randomized subspace iteration; any U gives the same H, a good one only makes R small)
  and the low-rank and diagonal parts applied in float64, and R (zero diagonal) stored as two int8
  limbs per entry with a per-row scale, R ≈ s_i (Q₁ + Q₂/254), the right side likewise per column
  (v ≈ t_c (p₁ + p₂/254)). The integer products Q₁[p₁ p₂] and Q₂p₁ accumulate exactly in int32
  (``torch._int_mm``; |sum| ≤ N·127² < 2³¹ for N < 133,000), so the only errors are the limbs'
  roundings, ~1.5e-5 of a row's or column's largest entry. Both split-offs matter: R's rounding acts
  through λ_{k+1}(H), not λ_max(H) (~30× smaller at the paper's setup), and on the off-diagonal
  entries' scale, not the diagonal's (27× smaller for unstructured inputs). Measured against the
  float32 iteration (itself 4e-8 from float64) at the paper's setup (MLP-100 at Kaiming init,
  N = 4,200, η = 0.01, the 12-point grid to 2,000), the largest error of f over the grid relative to
  its largest movement: 2.2e-5 on Fashion-MNIST images, 2.8e-5 on Gaussian inputs (without the
  diagonal split 4.9e-5 and 3.4e-4; without deflation 5.5e-4). :data:`INT8_TOLERANCE` states 1e-4,
  tested on a smaller real kernel. Two int8 products of 17.6 MB matrices per step
  (``benchmarks/ntkfl_server_time.py --products`` has the times).
- ``auto``: ``float64`` for a float64 model, ``int8`` on a CPU from N ≥ :data:`INT8_FROM` rows,
  ``float32`` otherwise (on a GPU the float32 product is bandwidth-bound and far from the bottleneck).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

PRECISIONS = ("auto", "float64", "float32", "int8")

INT8_FROM = 1024
"""Rows from which ``auto`` picks the int8 product on a CPU (below it the float32 product is cheap)."""

INT8_TOLERANCE = 1e-4
"""The int8 product's stated accuracy in the evolution: max over grid points of the error of f (and
of S), relative to their largest movement, against the float64 iteration (tested)."""

DEFLATE = 16
"""Dominant directions of H applied exactly in float64 by the int8 product."""

LIMB = 254.0
"""Second-limb scale: |x − round(x)| ≤ ½ maps into int8's ±127."""

Product = Callable[[Tensor], Tensor]
"""v (N, C) float64 ↦ H v (N, C) float64."""


def resolve_precision(precision: str, H: Tensor, dtype: torch.dtype) -> str:
    """The product ``auto`` stands for, given H and the model's ``dtype``."""
    if precision != "auto":
        return precision
    if dtype == torch.float64:
        return "float64"
    if H.device.type == "cpu" and H.shape[0] >= INT8_FROM:
        return "int8"
    return "float32"


def kernel_product(H: Tensor, precision: str = "auto", dtype: torch.dtype = torch.float32) -> Product:
    """v ↦ H v for the float64 kernel ``H``, by the product ``precision`` names (module docstring)."""
    chosen = resolve_precision(precision, H, dtype)
    if chosen == "float64":
        return lambda v: H @ v
    if chosen == "float32":
        return _Float32Product(H)
    if chosen == "int8":
        return _Int8Product(H)
    raise ValueError(f"kernel product: unknown precision {precision!r}; choose one of {PRECISIONS}")


class _Float32Product:
    """H in float32, the right side padded to a multiple of 16 columns."""

    def __init__(self, H: Tensor) -> None:
        self.H = H.to(torch.float32)

    def __call__(self, v: Tensor) -> Tensor:
        C = v.shape[1]
        pad = -C % 16
        w = torch.nn.functional.pad(v.to(torch.float32), (0, pad))
        return (self.H @ w)[:, :C].to(torch.float64)


def _limbs(x: Tensor, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """x ≈ scale·(p₁ + p₂/LIMB) with the scale the largest |x| along ``dim`` over 127: (p₁, p₂, scale)
    as float64 integers (exact in int8)."""
    scale = x.abs().amax(dim=dim, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny) / 127
    z = x / scale
    p1 = z.round()
    return p1, ((z - p1) * LIMB).round(), scale


def dominant_subspace(H: Tensor, k: int, iterations: int = 3, seed: int = 0) -> tuple[Tensor, Tensor]:
    """(U (N, k), λ (k,)): Ritz pairs of symmetric H from a seeded randomized subspace iteration with
    8 extra directions (Halko et al. 2011, Alg. 4.4); deterministic for the same H."""
    N = H.shape[0]
    k = min(k, N)
    g = torch.Generator(device=H.device).manual_seed(seed)
    omega = torch.randn(N, min(k + 8, N), generator=g, dtype=H.dtype, device=H.device)
    Q = torch.linalg.qr(H @ omega)[0]
    for _ in range(iterations):
        Q = torch.linalg.qr(H @ Q)[0]
    lam, W = torch.linalg.eigh(Q.T @ H @ Q)
    return Q @ W[:, -k:], lam[-k:]


class _Int8Product:
    """H = (U diag λ) Uᵀ + diag(d) + R with R's off-diagonal entries in two int8 limbs (module
    docstring)."""

    def __init__(self, H: Tensor) -> None:
        if H.shape[0] >= 133_000:
            raise ValueError("int8 kernel product: N >= 133,000 rows could overflow int32 sums")
        U, lam = dominant_subspace(H, DEFLATE)
        self.U, self.B = U, U * lam
        R = H - self.B @ U.T
        self.d = torch.diagonal(R).clone()
        R.diagonal().zero_()
        r1, r2, self.s = _limbs(R, dim=1)
        self.q1, self.q2 = r1.to(torch.int8), r2.to(torch.int8)

    def __call__(self, v: Tensor) -> Tensor:
        C = v.shape[1]
        p1, p2, t = _limbs(v, dim=0)
        first = torch._int_mm(self.q1, torch.cat([p1, p2], dim=1).to(torch.int8)).to(torch.float64)
        second = torch._int_mm(self.q2, p1.to(torch.int8)).to(torch.float64)
        low = first[:, :C] + (first[:, C:] + second) / LIMB
        return self.B @ (self.U.T @ v) + self.d[:, None] * v + low * self.s * t
