"""TCT stage 2's convex problem on one client: linear regression on standardised features.

ψ = (φ, b) is stored as one matrix W of shape (p + 1, C): the bias is the weight of a constant
feature appended to every standardised row, so every solver works with Z̃ = [Z, 1] alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hpcfl.comm.base import Communicator


def centred_one_hot(
    labels: torch.Tensor, num_classes: int, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """TCT's regression targets: one-hot − 1/C, so every target row has mean 0 (Appendix A.2), on
    the labels' device."""
    y = torch.full((labels.numel(), num_classes), -1.0 / num_classes, dtype=dtype, device=labels.device)
    y[torch.arange(labels.numel(), device=labels.device), labels.long()] += 1.0
    return y


@dataclass(frozen=True)
class FeatureMoments:
    """Mean and standard deviation of every feature over ALL clients' training samples."""

    mean: torch.Tensor  # (p,)
    std: torch.Tensor  # (p,)
    count: int


def federated_moments(
    blocks: Mapping[int, torch.Tensor],
    comm: Communicator,
    *,
    p: int,
    clients: int,
    eps: float = 1e-12,
    chunk_bytes: int = 64 * 2**20,
    device: torch.device | None = None,
) -> FeatureMoments:
    """Mean and std over every client's training features from their (Σz, Σz², n): no client's
    features leave its rank. ``blocks``: this rank's clients' features by id; ``clients``: K.

    Each client's sums (float64, so the result matches centralised standardisation to rounding) go
    into the client's own row of the allreduced buffer; rows of clients on other ranks are zero, so
    the allreduce moves them exactly, and the rows are then added in client order. The moments are
    therefore the same bits on any number of ranks (the running sum one rank computes, operation for
    operation), as the round loop's float64 sums are (:func:`hpcfl.runner.rounds.ordered_sums`).
    The buffer (K rows) is reduced in column chunks of at most ``chunk_bytes``, one allreduce each.
    Constant features get std 1 (they become exactly 0 after centring).

    The sums and moments live on ``device`` (the run's device; default: the blocks' device, the CPU
    for a rank without blocks), where the features are.
    """
    if device is None:
        device = next(iter(blocks.values())).device if blocks else torch.device("cpu")
    width = 2 * p + 1
    own = {}
    for k, z in blocks.items():
        z64 = z.to(torch.float64)
        count = torch.full((1,), float(z.shape[0]), dtype=torch.float64, device=z.device)
        own[k] = torch.cat([z64.sum(0), (z64 * z64).sum(0), count])
    total = torch.zeros(width, dtype=torch.float64, device=device)
    step = max(1, chunk_bytes // (8 * max(clients, 1)))
    for lo in range(0, width, step):
        hi = min(width, lo + step)
        rows = torch.zeros(clients, hi - lo, dtype=torch.float64, device=device)  # (K, chunk)
        for k, sums in own.items():
            rows[k] = sums[lo:hi]
        comm.allreduce(rows)
        acc = total[lo:hi]
        for k in range(clients):
            acc += rows[k]
    n = float(total[-1])  # one host read per run: the sample count, for the division and the record
    mean = total[:p] / n
    var = (total[p : 2 * p] / n - mean * mean).clamp_min(0.0)
    std = var.sqrt()
    std = torch.where(std > eps, std, torch.ones_like(std))
    return FeatureMoments(mean=mean, std=std, count=int(n))


def design_matrix(
    z: torch.Tensor, moments: FeatureMoments | None, *, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Z̃ = [(z − mean)/std, 1] (or [z, 1] without normalisation), in ``dtype``, on z's device."""
    out = torch.empty(z.shape[0], z.shape[1] + 1, dtype=dtype, device=z.device)  # (n, p + 1)
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
