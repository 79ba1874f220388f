"""Evaluation of the global model, sharded over ranks with one allreduce of the counts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpcfl.comm.base import Communicator


def shard_range(n: int, rank: int, size: int) -> tuple[int, int]:
    """Contiguous slice [start, stop) of ``n`` items that ``rank`` of ``size`` evaluates."""
    return n * rank // size, n * (rank + 1) // size


@torch.no_grad()
def evaluate(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    comm: Communicator,
    *,
    batch_size: int = 1000,
) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of ``model`` on (x, y), each rank doing its shard."""
    accuracy, loss, _ = _evaluate(model, x, y, comm, batch_size=batch_size, keep=False)
    return accuracy, loss


@torch.no_grad()
def evaluate_with_probs(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    comm: Communicator,
    *,
    batch_size: int = 1000,
) -> tuple[float, float, torch.Tensor]:
    """:func:`evaluate` plus the softmax outputs of every input (n, C) float64, identical on every
    rank (each rank fills its shard; the same allreduce carries them) — for conformal sets."""
    accuracy, loss, probs = _evaluate(model, x, y, comm, batch_size=batch_size, keep=True)
    assert probs is not None
    return accuracy, loss, probs


def _evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, comm: Communicator, *, batch_size: int, keep: bool
) -> tuple[float, float, torch.Tensor | None]:
    model.eval()
    n = x.shape[0]
    start, stop = shard_range(n, comm.rank, comm.size)
    stats = torch.zeros(3, dtype=torch.float64)  # correct, loss sum, count
    probs: torch.Tensor | None = None
    device = next(model.parameters()).device
    for s in range(start, stop, batch_size):
        xb = x[s : min(s + batch_size, stop)].to(device, non_blocking=True)
        yb = y[s : min(s + batch_size, stop)].to(device, non_blocking=True)
        logits = model(xb)
        stats[0] += (logits.argmax(1) == yb).sum().item()
        stats[1] += F.cross_entropy(logits, yb, reduction="sum").item()
        stats[2] += yb.numel()
        if keep:
            if probs is None:
                probs = torch.zeros(3 + n * logits.shape[1], dtype=torch.float64)
            width = logits.shape[1]
            probs[3 + s * width : 3 + (s + yb.numel()) * width] = logits.softmax(1).reshape(-1).double().cpu()
    if keep:
        if probs is None:  # this rank's shard is empty: learn the width from one input
            width = model(x[:1].to(device)).shape[1]
            probs = torch.zeros(3 + n * width, dtype=torch.float64)
        probs[:3] = stats
        comm.allreduce(probs)
        stats = probs[:3]
        probs = probs[3:].view(n, -1)
    else:
        comm.allreduce(stats)
    n_seen = max(stats[2].item(), 1.0)
    return stats[0].item() / n_seen, stats[1].item() / n_seen, probs
