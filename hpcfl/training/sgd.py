"""Local SGD on a flat model: the work every client does between two communications.

The step matches ``torch.optim.SGD`` (weight decay added to the gradient, momentum buffer
initialised to the first gradient, no dampening) but runs as a few vector ops on the flat buffers.
Algorithms change the gradient through ``correction`` (SCAFFOLD's ``-h_k``, FedProx's proximal
term) and the loss through ``loss_fn`` (MOON, FedCKA).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

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
    scratch: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One ``torch.optim.SGD`` step on ``w`` from gradient ``g`` (weight decay, the algorithm's
    correction, momentum); returns the momentum buffer for the next step. ``g`` is not changed.

    ``scratch`` (a tensor like ``w``, reused by the caller across steps) holds the step's direction
    when it differs from ``g``: without it that direction is a fresh tensor each step, and a model of
    more than 32 MB (glibc's largest heap block) is then mapped and page-faulted anew at every step
    (ResNet-18's 45 MB at batch 50 on 2 CPU cores: 115 ms a step with weight decay, 102 ms with the
    scratch buffer). Bit for bit the same step either way."""
    d = g
    if schedule.weight_decay:
        d = (
            g.add(w, alpha=schedule.weight_decay)
            if scratch is None
            else torch.add(g, w, alpha=schedule.weight_decay, out=scratch)
        )
    if correction is not None:
        if d is g:
            d = g.clone() if scratch is None else scratch.copy_(g)
        correction(w, d)
    if schedule.momentum:
        if momentum_buf is None:
            momentum_buf = d.clone()
        else:
            momentum_buf.mul_(schedule.momentum).add_(d)
        d = momentum_buf
    w.add_(d, alpha=-schedule.lr)
    return momentum_buf


class Tallies(NamedTuple):
    """A local run's device-side tallies, not yet read: :func:`read_result` takes them as they are
    (``read_result(*tallies)``); a method that trains twice per round (FedRep, Ditto) adds two
    runs' tallies and reads them once."""

    loss_sum: torch.Tensor
    finite_steps: torch.Tensor
    state_finite: torch.Tensor
    steps: int
    #: what ``loss_sum`` is averaged over: None, the steps (a mean loss per step); DP-SGD's, the
    #: samples its Poisson batches held (a loss per sample)
    mean_over: int | None = None


class LocalSteps:
    """One client's local steps of a round as its data is read: the mini-batches drawn from its
    generator and, for each, the gradient of ``loss_fn`` at the model's current state, tallied as
    they are taken (loss sum, steps before the first non-finite loss).

    The one way local training reads a client's data: :meth:`hpcfl.algorithms.base.Trainer.steps`
    makes it, every entry point of the trainer and any algorithm with a local loop of its own (APFL)
    iterates it, and DP-SGD's variant (:class:`hpcfl.privacy.sgd.DPSteps`) draws Poisson batches and
    returns clipped, noised gradients instead. Nothing is read back from the device: the tallies are
    read once, at the end (:func:`read_result`).

    Iterating yields each step's mini-batch (an index tensor on the data's device); for it,
    :meth:`gradient` gives the gradient at the model's current state, or :meth:`gradients` the
    gradients at several states from the same mini-batch.
    """

    def __init__(
        self,
        flat: FlatModel,
        x: torch.Tensor,
        y: torch.Tensor,
        schedule: LocalSchedule,
        generator: torch.Generator,
        loss_fn: LossFn = cross_entropy_loss,
    ) -> None:
        self.flat, self.x, self.y, self.schedule, self.loss_fn = flat, x, y, schedule, loss_fn
        flat.model.train()
        self.drawn = self._draw(x.shape[0], generator)  # host: the client's seeded CPU generator
        self._tallies: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _draw(self, n: int, generator: torch.Generator) -> list[torch.Tensor]:
        """The round's mini-batches (host index tensors): :func:`batch_indices`."""
        return batch_indices(n, self.schedule, generator)

    def __len__(self) -> int:
        return len(self.drawn)

    def __iter__(self) -> Iterator[torch.Tensor]:
        self._started()
        return iter(on_device(self.drawn, self.x.device))

    def _started(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss sum, steps before the first non-finite loss, no non-finite loss yet), on the device;
        made on first use, so a source that is only drawn (the batched path) allocates nothing."""
        if self._tallies is None:
            w = self.flat.params
            zero = w.new_zeros((), dtype=torch.float64)
            self._tallies = (zero, w.new_zeros((), dtype=torch.int64), w.new_ones((), dtype=torch.bool))
        return self._tallies

    def _tally(self, loss: torch.Tensor) -> None:
        """Tally one step's loss (the batch's mean, or DP-SGD's per-sample losses: summed), on the
        device: its sum added, the step counted while no loss has been non-finite."""
        loss_sum, finite_steps, alive = self._started()
        alive &= torch.isfinite(loss).all()
        finite_steps += alive
        loss_sum += loss.double().sum()

    def gradient(self, batch: torch.Tensor) -> torch.Tensor:
        """The mean gradient of the loss over ``batch`` at the model's current state (``flat.grad``,
        overwritten by the next call); the loss is tallied."""
        g = self.flat.grad
        g.zero_()
        loss = self.loss_fn(self.flat.model, self.x[batch], self.y[batch])
        self._tally(loss.detach())
        loss.backward()
        return g

    def gradients(
        self, batch: torch.Tensor, states: Sequence[torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The gradient at each of ``states`` from the same ``batch`` (one step's read of it), each
        with the state vector its forward pass left (float buffers updated); the first state's loss is
        tallied. Leaves the last state loaded."""
        out = []
        for i, state in enumerate(states):
            self.flat.load(state)
            if i == 0:
                g = self.gradient(batch)
            else:
                g = self.flat.grad
                g.zero_()
                self.loss_fn(self.flat.model, self.x[batch], self.y[batch]).backward()
            out.append((g if i == len(states) - 1 else g.clone(), self.flat.vector.clone()))
        return out

    def tallies(self, state_finite: torch.Tensor) -> Tallies:
        """The steps' tallies, unread, with the caller's final-state finiteness."""
        loss_sum, finite_steps, _ = self._started()
        return Tallies(loss_sum, finite_steps, state_finite, len(self.drawn))


def descend(flat: FlatModel, steps: LocalSteps, correction: Correction | None = None) -> Tallies:
    """Local SGD on ``flat.params`` in place along ``steps`` (:func:`sgd_step` of each step's
    gradient, with the algorithm's ``correction``); returns the run's tallies unread.

    The loop never waits for the device: the loss sum, the count of steps before the first
    non-finite loss and the final state's finiteness stay on the device and are read back once, at
    the end. A client whose loss turns non-finite at step s therefore runs its remaining steps (on
    a model that is then meaningless) and is reported exactly as an early stop would: ``steps=s``,
    ``finite=False``.
    """
    w = flat.params
    momentum_buf: torch.Tensor | None = None
    scratch = torch.empty_like(w) if steps.schedule.weight_decay or correction is not None else None
    for batch in steps:
        momentum_buf = sgd_step(w, steps.gradient(batch), steps.schedule, correction, momentum_buf, scratch)
    return steps.tallies(torch.isfinite(w).all())


def read_result(
    loss_sum: torch.Tensor,
    finite_steps: torch.Tensor,
    state_finite: torch.Tensor,
    steps: int,
    mean_over: int | None = None,
) -> LocalResult:
    """A client's :class:`LocalResult` from its device-side tallies, in ONE device-to-host read: the
    loss is ``loss_sum`` over ``mean_over`` (default: the steps; NaN when it is 0)."""
    total, good, ok = torch.stack([loss_sum.double(), finite_steps.double(), state_finite.double()]).tolist()
    return _result(total, good, ok, steps, mean_over)


def read_many(runs: Sequence[Tallies]) -> list[LocalResult]:
    """:func:`read_result` of several clients' tallies in ONE device-to-host read."""
    if not runs:
        return []
    columns = [torch.stack([getattr(t, f) for t in runs]).double() for f in Tallies._fields[:3]]
    read = torch.stack(columns, dim=1).tolist()  # (clients, 3)
    return [_result(*row, t.steps, t.mean_over) for row, t in zip(read, runs, strict=True)]


def _result(total: float, good: float, ok: float, steps: int, mean_over: int | None) -> LocalResult:
    if good < steps:
        return LocalResult(loss=float("nan"), steps=int(good), finite=False)
    if not ok:
        return LocalResult(loss=float("nan"), steps=steps, finite=False)
    if mean_over is None:
        return LocalResult(loss=total / max(steps, 1), steps=steps, finite=True)
    return LocalResult(loss=total / mean_over if mean_over else math.nan, steps=steps, finite=True)
