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


def mse_gradient(problem: LinearProblem, w: torch.Tensor) -> torch.Tensor:
    """(1/n)·Z̃ᵀ(Z̃W − Y)."""
    return problem.z.T @ (problem.z @ w - problem.y) / problem.n


def ce_gradient(problem: LinearProblem, w: torch.Tensor) -> torch.Tensor:
    """(1/n)·Z̃ᵀ(softmax(Z̃W) − onehot): the cross-entropy variant of stage 2."""
    probs = torch.softmax(problem.z @ w, dim=1)
    probs[torch.arange(problem.n), problem.labels.long()] -= 1.0
    return problem.z.T @ probs / problem.n


def power_lambda_max(z: torch.Tensor, *, iters: int = 1000, tol: float = 1e-10, seed: int = 0) -> float:
    """λ_max(Z̃ᵀZ̃) by power iteration with matrix-vector products only (no n×n or p×p matrix)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(z.shape[1], generator=g, dtype=z.dtype)
    v /= v.norm()
    lam = 0.0
    for _ in range(iters):
        w = z.T @ (z @ v)
        new = float(v @ w)
        norm = w.norm()
        if norm == 0:
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


class ClosedFormSolver:
    """The M local steps in closed form through the eigendecomposition of K = Z̃Z̃ᵀ (float64)."""

    def __init__(self, problem: LinearProblem) -> None:
        self.problem = problem
        z = problem.z.to(torch.float64)
        self._z = z
        self._y = problem.y.to(torch.float64)
        lam, u = torch.linalg.eigh(z @ z.T)  # (n,), (n, n)
        self.eigenvalues = lam.clamp_min(0.0)  # K is PSD; tiny negatives are rounding
        self.eigenvectors = u

    def lambda_max(self) -> float:
        return float(self.eigenvalues[-1])

    def _sums(self, lr: float, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-eigenvalue S1 = Σ_{m<M} βᵐ and S2 = Σ_{m<M} (1 − βᵐ)/(1 − β)."""
        n, M = self.problem.n, steps
        beta = 1.0 - lr * self.eigenvalues / n
        one_minus = lr * self.eigenvalues / n  # 1 − β, exact rather than by subtraction
        small = one_minus.abs() < 1e-12
        safe = torch.where(small, torch.ones_like(one_minus), one_minus)
        beta_m = beta.pow(M)
        s1 = torch.where(small, torch.full_like(beta, M), (1.0 - beta_m) / safe)
        s2 = torch.where(small, torch.full_like(beta, M * (M - 1) / 2), (M - s1) / safe)
        return s1, s2

    def local_steps(self, w0: torch.Tensor, h: torch.Tensor, lr: float, steps: int) -> torch.Tensor:
        z, u, n = self._z, self.eigenvectors, self.problem.n
        w0_64, h64 = w0.to(torch.float64), h.to(torch.float64)
        r0 = u.T @ (z @ w0_64 - self._y)  # (n, C) residual in the eigenbasis
        q = u.T @ (lr * (z @ h64))  # (n, C)
        s1, s2 = self._sums(lr, steps)
        residual_sum = u @ (s1[:, None] * r0 + s2[:, None] * q)  # Σ_{m<M} R_m, (n, C)
        w = w0_64 + (lr * steps) * h64 - (lr / n) * (z.T @ residual_sum)
        return w.to(w0.dtype)


def max_stable_lr(lam_max: float, n: int) -> float:
    """Largest η for which the local steps do not diverge: η·λ_max/n ≤ 2."""
    return math.inf if lam_max <= 0 else 2.0 * n / lam_max
