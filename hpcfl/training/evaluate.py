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
    model.eval()
    start, stop = shard_range(x.shape[0], comm.rank, comm.size)
    stats = torch.zeros(3, dtype=torch.float64)  # correct, loss sum, count
    device = next(model.parameters()).device
    for s in range(start, stop, batch_size):
        xb = x[s : min(s + batch_size, stop)].to(device, non_blocking=True)
        yb = y[s : min(s + batch_size, stop)].to(device, non_blocking=True)
        logits = model(xb)
        stats[0] += (logits.argmax(1) == yb).sum().item()
        stats[1] += F.cross_entropy(logits, yb, reduction="sum").item()
        stats[2] += yb.numel()
    comm.allreduce(stats)
    n = max(stats[2].item(), 1.0)
    return stats[0].item() / n, stats[1].item() / n
