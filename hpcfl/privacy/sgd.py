"""Sample-level DP-SGD (Abadi et al., CCS 2016) as a client's local training.

Each step draws a POISSON batch (every local sample independently with q = B/n, the sampling
Opacus's accountant assumes), computes every sample's gradient with ``torch.func``
(``vmap(grad_and_value(...))`` over ``functional_call``, chunked so chunk × P stays within the
eNTK engine's vmap budget), clips each to norm C with Opacus's factor min(1, C/(‖g_i‖ + 1e-6)),
sums, adds N(0, (σC)²·I) from the client's generator, and divides by the EXPECTED batch size qn
(Opacus's ``DPOptimizer`` with mean reduction). Weight decay, the algorithm's correction (FedProx's
proximal term) and momentum do not read the data, so they act on the privatised gradient as in
:func:`hpcfl.training.sgd.sgd_step`.

Per-sample norms and the clipped sum come from :mod:`hpcfl.privacy.ghost` (book-keeping: layer
inputs and output gradients of ONE backward; Linear layers by their ghost norm, each Conv2d by the
ghost or the materialised norm, whichever costs less; the clipped sum one weighted product per
layer) where the model allows, else from ``vmap`` per-sample gradients, chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from hpcfl.algorithms.base import ClientData, LocalTask, NonFiniteLoss, Trainer
from hpcfl.entk.reference import VMAP_BUDGET_ELEMS
from hpcfl.privacy import ghost
from hpcfl.training.batched import _Loss
from hpcfl.training.flat import FlatModel
from hpcfl.training.sgd import (
    Correction,
    LocalResult,
    LocalSchedule,
    LossFn,
    cross_entropy_loss,
    on_device,
    read_result,
    sgd_step,
)

OPACUS_EPS = 1e-6  # the constant Opacus adds to per-sample norms in its clip factor


def clipped_grad_sum(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, clip: float, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_i g_i·min(1, C/(‖g_i‖ + 1e-6)) over the batch, written into ``out`` (P,) in the flat layout
    (``model.parameters()`` order); returns (per-sample losses (B,), per-sample norms (B,)).

    The fastest correct path: the book-keeping one (:mod:`hpcfl.privacy.ghost`: one forward and one
    backward, no per-sample gradient formed for Linear layers nor for Conv2d layers on small output
    maps) for Linear/Conv2d/GroupNorm models with the default loss (its losses come back as the batch
    mean repeated: the same sum), ``vmap`` per-sample gradients otherwise.
    """
    if loss_fn is cross_entropy_loss and x.shape[0] and ghost.supported(model):
        try:
            return ghost.hooked_clipped_grad_sum(model, x, y, clip, out, OPACUS_EPS)
        except NotImplementedError:
            pass
    return vmap_clipped_grad_sum(model, loss_fn, x, y, clip, out)


def vmap_clipped_grad_sum(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, clip: float, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`clipped_grad_sum` through ``vmap(grad_and_value(...))``, chunk by chunk (any model)."""
    wrapped = _Loss(model, loss_fn)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = {f"model.{n}": p.detach() for n, p in model.named_parameters() if p.requires_grad}
    buffers = {f"model.{n}": b for n, b in model.named_buffers()}

    def one(prm: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return functional_call(wrapped, {**prm, **buffers}, (xi[None], yi[None]))

    per_sample = vmap(grad_and_value(one), in_dims=(None, 0, 0))
    out.zero_()
    P = out.numel()
    chunk = max(1, VMAP_BUDGET_ELEMS // max(P, 1))
    losses, norms = [], []
    for s in range(0, x.shape[0], chunk):
        grads, loss = per_sample(params, x[s : s + chunk], y[s : s + chunk])  # {name: (b, *shape)}, (b,)
        sq = sum(g.flatten(1).pow(2).sum(1) for g in grads.values())  # (b,)
        norm = sq.sqrt()
        factor = (clip / (norm + OPACUS_EPS)).clamp(max=1.0)  # (b,)
        offset = 0
        for n in names:
            g = grads[f"model.{n}"]
            size = g[0].numel()
            out[offset : offset + size] += torch.einsum("b,bp->p", factor, g.flatten(1))
            offset += size
        losses.append(loss.detach())
        norms.append(norm.detach())
    if not losses:
        return out.new_zeros(0), out.new_zeros(0)
    return torch.cat(losses), torch.cat(norms)


def poisson_batches(n: int, schedule: LocalSchedule, generator: torch.Generator) -> list[torch.Tensor]:
    """``schedule.num_steps(n)`` batches, each sample in each independently with q = min(1, B/n).
    Host work on purpose: drawn from the client's seeded CPU generator, so the batches do not depend
    on the device."""
    q = min(1.0, schedule.batch_size / n)
    return [
        torch.nonzero(torch.rand(n, generator=generator, dtype=torch.float64) < q).flatten()  # host: as above
        for _ in range(schedule.num_steps(n))
    ]


def noise_source(generator: torch.Generator, like: torch.Tensor) -> torch.Generator:
    """The generator a client's DP noise is drawn from, on the device of ``like``.

    On the CPU it is the client's own generator (the stream every earlier result was drawn from). On
    an accelerator it is a generator of that device seeded by ONE draw from the client's generator,
    so the noise is made where it is added instead of drawn on the host and copied every step
    (44 MB a step for resnet18); it is then as reproducible, from (seed, round, client), but not the
    same numbers as a CPU run's.
    """
    if like.device.type == "cpu":
        return generator
    seed = int(torch.randint(2**62, (1,), generator=generator))  # host: one draw from the client's stream
    return torch.Generator(device=like.device).manual_seed(seed)


def dp_local_sgd(
    flat: FlatModel,
    x: torch.Tensor,
    y: torch.Tensor,
    schedule: LocalSchedule,
    generator: torch.Generator,
    *,
    clip: float,
    noise_multiplier: float,
    loss_fn: LossFn = cross_entropy_loss,
    correction: Correction | None = None,
) -> LocalResult:
    """DP-SGD on ``flat.model`` in place (module docstring); ``finite=False`` on a NaN/inf loss.

    As :func:`~hpcfl.training.sgd.local_sgd`, nothing is read back from the device until the end
    (one read): a client whose loss turns non-finite runs its remaining steps on a meaningless model
    and is reported with the steps it took before."""
    model = flat.model
    model.train()
    w = flat.params
    n = x.shape[0]
    expected = min(1.0, schedule.batch_size / n) * n  # qn: the fixed denominator
    total = torch.empty_like(flat.grad)
    momentum_buf: torch.Tensor | None = None
    loss_sum = w.new_zeros((), dtype=torch.float64)
    finite_steps = w.new_zeros((), dtype=torch.int64)  # steps before the first non-finite loss
    alive = w.new_ones((), dtype=torch.bool)
    batches = poisson_batches(n, schedule, generator)
    seen = sum(int(b.numel()) for b in batches)
    noise_gen = noise_source(generator, total)
    for idx in on_device(batches, x.device):
        losses, _ = clipped_grad_sum(model, loss_fn, x[idx], y[idx], clip, total)
        alive &= torch.isfinite(losses).all()
        finite_steps += alive
        loss_sum += losses.double().sum()
        noise = torch.randn(total.shape, generator=noise_gen, dtype=total.dtype, device=total.device)
        g = (total + noise * (noise_multiplier * clip)) / expected
        momentum_buf = sgd_step(w, g, schedule, correction, momentum_buf)
    # the loss is the mean over the samples seen, not over the steps
    return read_result(loss_sum, finite_steps, torch.isfinite(w).all(), len(batches), mean_over=seen)


class DPTrainer(Trainer):
    """The run's trainer with DP-SGD as every client's local training (participants one by one)."""

    def __init__(
        self, flat: FlatModel, schedule: LocalSchedule, *, clip: float, noise_multiplier: float
    ) -> None:
        super().__init__(flat, schedule)
        self.clip = clip
        self.noise_multiplier = noise_multiplier

    def train(
        self,
        x0: torch.Tensor,
        data: ClientData,
        generator: torch.Generator,
        *,
        loss_fn: LossFn | None = None,
        correction: Correction | None = None,
        schedule: LocalSchedule | None = None,
    ) -> tuple[torch.Tensor, LocalResult]:
        """DP-SGD from ``x0`` (as :meth:`Trainer.train`, with the private local step)."""
        self.flat.load(x0)
        result = dp_local_sgd(
            self.flat,
            data.x,
            data.y,
            schedule or self.schedule,
            generator,
            clip=self.clip,
            noise_multiplier=self.noise_multiplier,
            loss_fn=loss_fn or self.loss_fn,
            correction=correction,
        )
        if not result.finite:
            raise NonFiniteLoss(f"client {data.k}: non-finite loss after {result.steps} local steps")
        return self.flat.vector.clone(), result

    def can_batch(self, tasks: Sequence[LocalTask]) -> bool:
        """DP-SGD trains its participants one by one (its per-sample step is already vectorised)."""
        return False
