"""TCT stage 2's convex problem on one client: linear regression on standardised features.

ψ = (φ, b) is stored as one matrix W of shape (p + 1, C): the bias is the weight of a constant
feature appended to every standardised row, so every solver works with Z̃ = [Z, 1] alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcfl.comm.base import Communicator


def centred_one_hot(
    labels: torch.Tensor, num_classes: int, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """TCT's regression targets: one-hot − 1/C, so every target row has mean 0 (Appendix A.2)."""
    y = torch.full((labels.numel(), num_classes), -1.0 / num_classes, dtype=dtype)
    y[torch.arange(labels.numel()), labels.long()] += 1.0
    return y


@dataclass(frozen=True)
class FeatureMoments:
    """Mean and standard deviation of every feature over ALL clients' training samples."""

    mean: torch.Tensor  # (p,)
    std: torch.Tensor  # (p,)
    count: int


def federated_moments(
    blocks: list[torch.Tensor], comm: Communicator, *, p: int, eps: float = 1e-12
) -> FeatureMoments:
    """Mean and std from ONE allreduce of (Σz, Σz², n): no client's features leave its rank.

    Sums are accumulated in float64, so the result matches centralised standardisation to
    rounding. Constant features get std 1 (they become exactly 0 after centring).
    """
    buf = torch.zeros(2 * p + 1, dtype=torch.float64)
    for z in blocks:
        z64 = z.to(torch.float64)
        buf[:p] += z64.sum(0)
        buf[p : 2 * p] += (z64 * z64).sum(0)
        buf[-1] += z.shape[0]
    comm.allreduce(buf)
    n = float(buf[-1])
    mean = buf[:p] / n
    var = (buf[p : 2 * p] / n - mean * mean).clamp_min(0.0)
    std = var.sqrt()
    std = torch.where(std > eps, std, torch.ones_like(std))
    return FeatureMoments(mean=mean, std=std, count=int(n))


def design_matrix(
    z: torch.Tensor, moments: FeatureMoments | None, *, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Z̃ = [(z − mean)/std, 1] (or [z, 1] without normalisation), in ``dtype``."""
    out = torch.empty(z.shape[0], z.shape[1] + 1, dtype=dtype)
    out[:, :-1] = z
    if moments is not None:
        out[:, :-1] -= moments.mean.to(dtype)
        out[:, :-1] /= moments.std.to(dtype)
    out[:, -1] = 1.0
    return out


@dataclass
class LinearProblem:
    """One client's data for stage 2: design matrix Z̃ (n, p+1), targets Y (n, C), labels (n,)."""

    z: torch.Tensor
    y: torch.Tensor
    labels: torch.Tensor

    @property
    def n(self) -> int:
        return int(self.z.shape[0])
