"""Local SGD on a flat model: the work every client does between two communications.

The step matches ``torch.optim.SGD`` (weight decay added to the gradient, momentum buffer
initialised to the first gradient, no dampening) but runs as a few vector ops on the flat buffers.
Algorithms change the gradient through ``correction`` (SCAFFOLD's ``-h_k``, FedProx's proximal
term) and the loss through ``loss_fn`` (MOON, FedCKA).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hpcfl.training.flat import FlatModel

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
Correction = Callable[[torch.Tensor, torch.Tensor], None]  # (params, grad) -> adds to grad in place


@dataclass(frozen=True)
class LocalSchedule:
    """How a client trains in one round: E local epochs, or M local steps when ``steps`` is set.

    ``drop_last``: each epoch's last partial mini-batch is dropped, as a PyTorch ``DataLoader(...,
    drop_last=True)`` does (the FedPVR authors' loaders), so an epoch is ⌊n/B⌋ steps instead of
    ⌈n/B⌉. A client with fewer than B samples still takes one step per epoch on all of them (a
    client with no step has no update and, for SCAFFOLD, no control variate).
    """

    lr: float
    batch_size: int
    epochs: int = 1
    steps: int | None = None
    momentum: float = 0.0
    weight_decay: float = 1e-5
    drop_last: bool = False

    def num_steps(self, n: int) -> int:
        """Number of SGD steps a client with ``n`` samples takes in one round."""
        if self.steps is not None:
            return self.steps
        return self.epochs * self.batches_per_epoch(n)

    def batches_per_epoch(self, n: int) -> int:
        """⌈n/B⌉, or ⌊n/B⌋ (at least 1) with ``drop_last``."""
        if self.drop_last:
            return max(1, n // self.batch_size)
        return math.ceil(n / self.batch_size)

    def effective_steps(self, n: int) -> float:
        """‖a‖₁ of a client with ``n`` samples: see :func:`local_norm`."""
        return local_norm(self.num_steps(n), self.momentum)


def local_norm(steps: int, momentum: float) -> float:
    """‖a‖₁: how far ``steps`` local steps of this module's SGD move the model, in units of η, per
    unit of a constant direction d (the displacement is η‖a‖₁·d).

    With momentum β (buffer initialised to the first direction, no dampening, as
    ``torch.optim.SGD``) the s-th direction enters the remaining steps with the coefficients
    1, β, β², …, so ‖a‖₁ = Σ_{s=1}^{K} (1 − β^{K−s+1})/(1 − β) = (K − β(1 − β^K)/(1 − β))/(1 − β)
    (FedNova's local-momentum case, Wang et al. 2020); K at β = 0, returned as ``float(K)`` so that
    a division by ``local_norm(K, 0)·η`` is bit for bit the division by ``K·η``.

    Every estimate of a mean gradient from a model difference, (x − y)/(η‖a‖₁), uses it: FedNova's
    normalisation and SCAFFOLD's/FedPVR's control variates (dividing by Kη under momentum makes
    the variates ‖a‖₁/K too large and SCAFFOLD diverge, issue 25).
    """
    if not momentum:
        return float(steps)
    beta = momentum
    return (steps - beta * (1.0 - beta**steps) / (1.0 - beta)) / (1.0 - beta)


@dataclass
class LocalResult:
    """What local training reports back: mean loss over its steps and whether it stayed finite."""

    loss: float
    steps: int
    finite: bool


def cross_entropy_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The default local objective: mean cross-entropy of the model's logits."""
    return F.cross_entropy(model(x), y)


def batch_indices(n: int, schedule: LocalSchedule, generator: torch.Generator) -> list[torch.Tensor]:
    """The mini-batches of one round: fresh permutations of ``range(n)``, cut into batches.

    With ``steps`` set, permutations are chained until M batches exist (epochs roll over).
    The last batch of an epoch may be smaller; it is kept, as in a plain PyTorch DataLoader, unless
    ``schedule.drop_last`` (then each epoch is its ⌊n/B⌋ full batches, or one batch of all n < B).
    Host work on purpose: the client's generator lives on the CPU so that its draws, and so the
    result, do not depend on the device (:func:`on_device` moves a round's indices in one copy).
    """
    out: list[torch.Tensor] = []
    total = schedule.num_steps(n)
    end = n
    if schedule.drop_last and n >= schedule.batch_size:
        end = n - n % schedule.batch_size
    while len(out) < total:
        perm = torch.randperm(n, generator=generator)  # host: the client's seeded CPU generator
        for start in range(0, end, schedule.batch_size):
            out.append(perm[start : start + schedule.batch_size])
            if len(out) == total:
                break
    return out


def on_device(batches: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """A round's host-built index tensors as views of ONE tensor on ``device``: one host-to-device
    copy per round instead of one per step (indexing a GPU tensor with a CPU index copies the index
    from pageable memory, which waits for the stream, at every step)."""
    if not batches or batches[0].device == device:
        return batches
    flat = torch.cat(batches).to(device)
    return list(flat.split([b.numel() for b in batches]))


def sgd_step(
    w: torch.Tensor,
    g: torch.Tensor,
    schedule: LocalSchedule,
    correction: Correction | None,
    momentum_buf: torch.Tensor | None,
) -> torch.Tensor | None:
    """One ``torch.optim.SGD`` step on ``w`` from gradient ``g`` (weight decay, the algorithm's
    correction, momentum); returns the momentum buffer for the next step. ``g`` is not changed."""
    d = g.add(w, alpha=schedule.weight_decay) if schedule.weight_decay else g
    if correction is not None:
        if d is g:
            d = g.clone()
        correction(w, d)
    if schedule.momentum:
        if momentum_buf is None:
            momentum_buf = d.clone()
        else:
            momentum_buf.mul_(schedule.momentum).add_(d)
        d = momentum_buf
    w.add_(d, alpha=-schedule.lr)
    return momentum_buf


def local_sgd(
    flat: FlatModel,
    x: torch.Tensor,
    y: torch.Tensor,
    schedule: LocalSchedule,
    generator: torch.Generator,
    *,
    loss_fn: LossFn = cross_entropy_loss,
    correction: Correction | None = None,
) -> LocalResult:
    """Train ``flat.model`` in place on (x, y); ``finite=False`` on a NaN/inf loss or state.

    The loop never waits for the device: the loss sum, the count of steps before the first
    non-finite loss and the final state's finiteness stay on the device and are read back once, at
    the end. A client whose loss turns non-finite at step s therefore runs its remaining steps (on
    a model that is then meaningless) and is reported exactly as an early stop would: ``steps=s``,
    ``finite=False``.
    """
    model = flat.model
    model.train()
    w, g = flat.params, flat.grad
    momentum_buf: torch.Tensor | None = None
    loss_sum = w.new_zeros((), dtype=torch.float64)
    finite_steps = w.new_zeros((), dtype=torch.int64)  # steps before the first non-finite loss
    alive = w.new_ones((), dtype=torch.bool)
    batches = on_device(batch_indices(x.shape[0], schedule, generator), x.device)
    for idx in batches:
        g.zero_()
        loss = loss_fn(model, x[idx], y[idx])
        alive &= torch.isfinite(loss.detach())
        finite_steps += alive
        loss.backward()
        loss_sum += loss.detach().to(torch.float64)
        momentum_buf = sgd_step(w, g, schedule, correction, momentum_buf)
    return read_result(loss_sum, finite_steps, torch.isfinite(w).all(), len(batches))


def read_result(
    loss_sum: torch.Tensor,
    finite_steps: torch.Tensor,
    state_finite: torch.Tensor,
    steps: int,
    *,
    mean_over: int | None = None,
) -> LocalResult:
    """A client's :class:`LocalResult` from its device-side tallies, in ONE device-to-host read: the
    loss is ``loss_sum`` over ``mean_over`` (default: the steps; NaN when it is 0)."""
    total, good, ok = torch.stack([loss_sum.double(), finite_steps.double(), state_finite.double()]).tolist()
    if good < steps:
        return LocalResult(loss=float("nan"), steps=int(good), finite=False)
    if not ok:
        return LocalResult(loss=float("nan"), steps=steps, finite=False)
    if mean_over is None:
        return LocalResult(loss=total / max(steps, 1), steps=steps, finite=True)
    return LocalResult(loss=total / mean_over if mean_over else math.nan, steps=steps, finite=True)
