"""Evaluation of the global model, sharded over ranks with one allreduce of the counts.

Every evaluation is two steps: this rank's counts on its shard (:func:`shard_counts`: correct,
loss sum, count; and, for conformal sets, the softmax outputs of the shard) and, after their sum
over ranks, the columns (:func:`accuracy_loss`). :func:`evaluate` does both with its own allreduce;
a round's evaluation sums the counts of everything it evaluates — test, validation and training
sets, the other models a server names, and the per-client evaluation's table (issue 28) — in ONE
allreduce (:class:`JointCounts`). The counts are sums of integers and of per-sample losses that
each rank adds for its own shard, so packing them into one tensor changes no bit of the sum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hpcfl.comm.base import Communicator


def shard_range(n: int, rank: int, size: int) -> tuple[int, int]:
    """Contiguous slice [start, stop) of ``n`` items that ``rank`` of ``size`` evaluates."""
    return n * rank // size, n * (rank + 1) // size


class JointCounts:
    """Values the round's observers add to the evaluation's ONE allreduce (per-client evaluation's
    table), summed together with the evaluator's own counts by :meth:`reduce`.

    ``parts`` are float64 1-D tensors, this rank's share (zeros where another rank fills a slot);
    after :meth:`reduce` they hold their sums over ranks, in place. An evaluator reduces them with
    its own counts; one that reduces nothing (a test's stub) leaves them to :meth:`settle`.
    """

    def __init__(self, parts: Sequence[torch.Tensor] = ()) -> None:
        self.parts = list(parts)
        self.reduced = False

    def reduce(self, comm: Communicator, own: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Sum ``own`` (float64 1-D) and :attr:`parts` over ranks in one allreduce; returns ``own``
        summed (new tensors) and writes the parts' sums into them. One call per round."""
        if self.reduced:
            raise RuntimeError("the evaluation's counts were already reduced this round")
        everything = [*own, *self.parts]
        buf = torch.cat([t.reshape(-1).to(torch.float64) for t in everything]) if everything else None
        self.reduced = True
        if buf is None:
            return []
        comm.allreduce(buf)
        out, at = [], 0
        for t in everything:
            out.append(buf[at : at + t.numel()].view(t.shape))
            at += t.numel()
        for part, summed in zip(self.parts, out[len(own) :], strict=True):
            part.copy_(summed)
        return out[: len(own)]

    def settle(self, comm: Communicator) -> None:
        """Reduce the parts alone when the evaluator did not (it evaluates nothing over ranks)."""
        if not self.reduced and self.parts:
            self.reduce(comm, [])
        self.reduced = True


@torch.no_grad()
def shard_counts(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    comm: Communicator,
    *,
    batch_size: int = 1000,
    probs: bool = False,
    tick: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """This rank's (correct, loss sum, count) on its shard of (x, y), float64; with ``probs`` followed
    by the softmax outputs of every input (n·C, zero outside this rank's shard), for conformal sets.
    ``tick(k)`` after each batch of k samples (a progress bar; host-side, no device read)."""
    model.eval()
    n = x.shape[0]
    start, stop = shard_range(n, comm.rank, comm.size)
    device = next(model.parameters()).device
    stats = torch.zeros(3, dtype=torch.float64, device=device)  # correct, loss sum, count
    out: torch.Tensor | None = None
    for s in range(start, stop, batch_size):
        xb = x[s : min(s + batch_size, stop)].to(device, non_blocking=True)
        yb = y[s : min(s + batch_size, stop)].to(device, non_blocking=True)
        logits = model(xb)
        stats[0] += (logits.argmax(1) == yb).sum()
        stats[1] += F.cross_entropy(logits, yb, reduction="sum").double()
        stats[2] += yb.numel()
        if tick is not None:
            tick(int(yb.shape[0]))
        if probs:
            if out is None:
                # host: probabilities come back
                out = torch.zeros(3 + n * logits.shape[1], dtype=torch.float64)
            width = logits.shape[1]
            out[3 + s * width : 3 + (s + yb.numel()) * width] = logits.softmax(1).reshape(-1).double().cpu()
    stats = stats.cpu()  # the shard's one read back
    if not probs:
        return stats
    if out is None:  # this rank's shard is empty: learn the width from one input
        width = model(x[:1].to(device)).shape[1]
        out = torch.zeros(3 + n * width, dtype=torch.float64)  # host: probabilities come back
    out[:3] = stats
    return out


def accuracy_loss(counts: torch.Tensor) -> tuple[float, float]:
    """Accuracy and mean loss from (correct, loss sum, count, ...) summed over ranks."""
    n_seen = max(counts[2].item(), 1.0)
    return counts[0].item() / n_seen, counts[1].item() / n_seen


def with_probs(counts: torch.Tensor, n: int) -> tuple[float, float, torch.Tensor]:
    """Accuracy, mean loss and the (n, C) softmax outputs of :func:`shard_counts` with ``probs``,
    summed over ranks."""
    return (*accuracy_loss(counts), counts[3:].view(n, -1))


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
    return accuracy_loss(comm.allreduce(shard_counts(model, x, y, comm, batch_size=batch_size)))


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
    counts = comm.allreduce(shard_counts(model, x, y, comm, batch_size=batch_size, probs=True))
    return with_probs(counts, x.shape[0])
