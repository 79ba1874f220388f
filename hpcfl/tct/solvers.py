"""Local solvers of TCT stage 2: M SCAFFOLD steps W ← W − η(g_k(W) − h) on a client's problem.

Gradient scale as in the TCT reference code: g_k(W) = (1/n_k)·Z̃ᵀ(Z̃W − Y) (mean, not the plain sum
of Appendix A.2: with standardised p = 100k features and η = 5e-5 the sum form diverges).

- :class:`PrimalSolver` takes the M steps explicitly (2M products with Z̃): the reference, and the
  only one for the cross-entropy variant.
- :class:`ClosedFormSolver` is exactly equal for the squared loss: the step is linear, so with
  K = Z̃Z̃ᵀ = UΛUᵀ (n×n, float64, once per client), β = 1 − ηλ/n and q = ηZ̃h the residual
  R_m = Z̃W_m − Y obeys R_{m+1} = (I − (η/n)K)R_m + q, i.e. r̃_m = βᵐr̃₀ + (1−βᵐ)/(1−β)·q̃ in the
  eigenbasis, and W_M = W₀ + ηMh − (η/n)Z̃ᵀΣ_{m<M}R_m: three products with Z̃ per round.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from hpcfl.tct.problem import LinearProblem


class LocalSolver(Protocol):
    """Runs a client's M local steps from W₀ with correction h."""

    problem: LinearProblem

    def local_steps(self, w0: torch.Tensor, h: torch.Tensor, lr: float, steps: int) -> torch.Tensor: ...

    def lambda_max(self) -> float:
        """Largest eigenvalue of Z̃Z̃ᵀ (= of Z̃ᵀZ̃): the steps diverge iff η·λ_max/n > 2."""
        ...


def zt_times(z: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Zᵀ·R for a tall Z (n, d) and a thin R (n, C), computed as (RᵀZ)ᵀ.

    Same numbers to rounding, but the transposed-left GEMM is 3–12× slower on CPU BLAS for these
    shapes (n = 6000, d = 100,001, C = 10: 15 s vs 1.2 s in float32; benchmarks/README.md).
    """
    return (r.T @ z).T


def mse_gradient(problem: LinearProblem, w: torch.Tensor) -> torch.Tensor:
    """(1/n)·Z̃ᵀ(Z̃W − Y)."""
    return zt_times(problem.z, problem.z @ w - problem.y) / problem.n


def ce_gradient(problem: LinearProblem, w: torch.Tensor) -> torch.Tensor:
    """(1/n)·Z̃ᵀ(softmax(Z̃W) − onehot): the cross-entropy variant of stage 2."""
    probs = torch.softmax(problem.z @ w, dim=1)
    probs[torch.arange(problem.n, device=probs.device), problem.labels.long()] -= 1.0
    return zt_times(problem.z, probs) / problem.n


def power_lambda_max(z: torch.Tensor, *, iters: int = 1000, tol: float = 1e-10, seed: int = 0) -> float:
    """λ_max(Z̃ᵀZ̃) by power iteration with matrix-vector products only (no n×n or p×p matrix), on
    z's device; one host read per iteration (the Rayleigh quotient and the norm together), set-up
    work once per client."""
    # the start vector is drawn from a seeded CPU generator, so λ_max (and the iteration count) do
    # not depend on where z lives, and moved to z's device once
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(z.shape[1], generator=g, dtype=z.dtype).to(z.device)  # host: seeded draw; (d,)
    v /= v.norm()
    lam = 0.0
    for _ in range(iters):
        w = z.T @ (z @ v)
        norm = w.norm()
        new, norm_value = torch.stack([v @ w, norm]).tolist()
        if norm_value == 0:
            return 0.0
        v = w / norm
        if abs(new - lam) <= tol * max(abs(new), 1.0):
            return new
        lam = new
    return lam


class PrimalSolver:
    """M explicit full-batch steps: the reference for the closed form, and the CE solver."""

    def __init__(self, problem: LinearProblem, *, loss: str = "mse") -> None:
        self.problem = problem
        self._grad = mse_gradient if loss == "mse" else ce_gradient
        self._lam: float | None = None

    def local_steps(self, w0: torch.Tensor, h: torch.Tensor, lr: float, steps: int) -> torch.Tensor:
        w = w0.clone()
        for _ in range(steps):
            w -= lr * (self._grad(self.problem, w) - h)
        return w

    def lambda_max(self) -> float:
        if self._lam is None:
            self._lam = power_lambda_max(self.problem.z)
        return self._lam


def _geometric_sums(
    eigenvalues: torch.Tensor, n: int, lr: float, steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per eigenvalue λ, with β = 1 − ηλ/n: S1 = Σ_{m<M} βᵐ and S2 = Σ_{m<M} (1 − βᵐ)/(1 − β)."""
    M = steps
    one_minus = lr * eigenvalues / n  # 1 − β, exact rather than by subtraction
    beta = 1.0 - one_minus
    small = one_minus.abs() < 1e-12
    safe = torch.where(small, torch.ones_like(one_minus), one_minus)
    s1 = torch.where(small, torch.full_like(beta, M), (1.0 - beta.pow(M)) / safe)
    s2 = torch.where(small, torch.full_like(beta, M * (M - 1) / 2), (M - s1) / safe)
    return s1, s2


class ClosedFormSolver:
    """The M local steps in closed form, exactly equal to :class:`PrimalSolver` for the squared loss.

    Picks the smaller eigensystem once per client, in float64:
    - kernel form (n_k ≤ p + 1): K = Z̃Z̃ᵀ = UΛUᵀ, the residual recursion in the module docstring;
      a round costs three products with Z̃.
    - covariance form (n_k > p + 1): A = Z̃ᵀZ̃ = VΛVᵀ, B = Z̃ᵀY; W̃_{m+1} = βW̃_m + η(B̃/n + h̃) in
      the eigenbasis, so W̃_M = βᴹW̃₀ + S1·c̃; a round costs three (p+1)² C products and never
      touches the n_k rows again.
    """

    def __init__(self, problem: LinearProblem, *, form: str = "auto") -> None:
        self.problem = problem
        n, d = problem.z.shape
        self.form = form if form != "auto" else ("kernel" if n <= d else "covariance")
        z = problem.z.to(torch.float64)
        y = problem.y.to(torch.float64)
        if self.form == "kernel":
            self._z, self._y = z, y
            lam, vec = torch.linalg.eigh(z @ z.T)  # (n,), (n, n)
        else:
            self._b = zt_times(z, y)  # (p+1, C)
            lam, vec = torch.linalg.eigh(z.T @ z)  # (p+1,), (p+1, p+1)
            self._b_tilde = vec.T @ self._b
        self.eigenvalues = lam.clamp_min(0.0)  # PSD; tiny negatives are rounding
        self.eigenvectors = vec

    def lambda_max(self) -> float:
        return float(self.eigenvalues[-1])

    def local_steps(self, w0: torch.Tensor, h: torch.Tensor, lr: float, steps: int) -> torch.Tensor:
        n, vec = self.problem.n, self.eigenvectors
        w0_64, h64 = w0.to(torch.float64), h.to(torch.float64)
        s1, s2 = _geometric_sums(self.eigenvalues, n, lr, steps)
        if self.form == "kernel":
            z = self._z
            r0 = vec.T @ (z @ w0_64 - self._y)  # (n, C) residual in the eigenbasis
            q = vec.T @ (lr * (z @ h64))  # (n, C)
            residual_sum = vec @ (s1[:, None] * r0 + s2[:, None] * q)  # Σ_{m<M} R_m
            w = w0_64 + (lr * steps) * h64 - (lr / n) * zt_times(z, residual_sum)
        else:
            beta_m = 1.0 - s1 * (lr * self.eigenvalues / n)  # βᴹ = 1 − (1 − β)·S1
            c = lr * (self._b_tilde / n + vec.T @ h64)  # (p+1, C)
            w = vec @ (beta_m[:, None] * (vec.T @ w0_64) + s1[:, None] * c)
        return w.to(w0.dtype)


def max_stable_lr(lam_max: float, n: int) -> float:
    """Largest η for which the local steps do not diverge: η·λ_max/n ≤ 2."""
    return math.inf if lam_max <= 0 else 2.0 * n / lam_max
