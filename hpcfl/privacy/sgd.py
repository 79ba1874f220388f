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

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from hpcfl.algorithms.base import ClientData, Trainer
from hpcfl.entk.reference import VMAP_BUDGET_ELEMS
from hpcfl.errors import ConfigError
from hpcfl.privacy import ghost
from hpcfl.training.batched import _Loss
from hpcfl.training.flat import FlatModel
from hpcfl.training.sgd import (
    LocalSchedule,
    LocalSteps,
    LossFn,
    Tallies,
    cross_entropy_loss,
)

OPACUS_EPS = 1e-6  # the constant Opacus adds to per-sample norms in its clip factor
log = logging.getLogger("hpcfl.privacy")


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
    if loss_fn is cross_entropy_loss and x.shape[0]:
        uncovered = ghost.unsupported_layers(model)
        if not uncovered:
            try:
                return ghost.hooked_clipped_grad_sum(model, x, y, clip, out, OPACUS_EPS)
            except NotImplementedError:
                pass
        elif type(model) not in _NOTED:  # once per model class and process: the run's log says it
            _NOTED.add(type(model))
            recurrent = any(isinstance(m, nn.RNNBase) for m in model.modules())
            log.warning(
                "DP-SGD: the book-keeping per-sample path does not cover %s layers; computing per-sample "
                "gradients with %s for the whole model (slower, same result)",
                ", ".join(uncovered),
                "a per-sample loop (vmap cannot batch recurrent layers)" if recurrent else "vmap",
            )
    return vmap_clipped_grad_sum(model, loss_fn, x, y, clip, out)


_NOTED: set[type] = set()


def vmap_clipped_grad_sum(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, clip: float, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`clipped_grad_sum` through ``vmap(grad_and_value(...))``, chunk by chunk (any model)."""
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    return joint_clipped_grad_sums(model, loss_fn, [params], x, y, clip, [out])


def joint_clipped_grad_sums(
    model: nn.Module,
    loss_fn: LossFn,
    params: Sequence[dict[str, torch.Tensor]],
    x: torch.Tensor,
    y: torch.Tensor,
    clip: float,
    outs: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's gradients at every parameter set of ``params`` (trainable parameters by name)
    clipped TOGETHER: g_i = (g_i¹, ..., g_iᵐ) scaled by min(1, C/(‖g_i‖ + 1e-6)), ‖g_i‖ the norm of
    the whole tuple, and summed over the batch into ``outs`` (each (P,), the flat layout); returns
    (per-sample losses at the first set (B,), per-sample joint norms (B,)). One sample then moves
    the m sums by at most C together, so a step that differentiates m models on one mini-batch is
    ONE release of sensitivity C (APFL's global and mixed models); m = 1 is DP-SGD's clipped sum.
    ``vmap(grad_and_value(...))`` over ``functional_call``, chunk by chunk."""
    wrapped = _Loss(model, loss_fn)
    names = list(params[0])
    buffers = {f"model.{n}": b for n, b in model.named_buffers()}

    def one(prm: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return functional_call(wrapped, {**prm, **buffers}, (xi[None], yi[None]))

    per_sample = vmap(grad_and_value(one), in_dims=(None, 0, 0))
    if any(isinstance(m, nn.RNNBase) for m in model.modules()):
        per_sample = _looped(grad_and_value(one))  # vmap has no batching rule for recurrent layers
    prefixed = [{f"model.{n}": p for n, p in prm.items()} for prm in params]
    for out in outs:
        out.zero_()
    P = outs[0].numel() * len(outs)
    chunk = max(1, VMAP_BUDGET_ELEMS // max(P, 1))
    losses, norms = [], []
    for s in range(0, x.shape[0], chunk):
        # per set: ({name: (b, *shape)}, (b,))
        taken = [per_sample(prm, x[s : s + chunk], y[s : s + chunk]) for prm in prefixed]
        sq = sum(g.flatten(1).pow(2).sum(1) for grads, _ in taken for g in grads.values())  # (b,)
        norm = sq.sqrt()
        factor = (clip / (norm + OPACUS_EPS)).clamp(max=1.0)  # (b,)
        for (grads, _), out in zip(taken, outs, strict=True):
            offset = 0
            for n in names:
                g = grads[f"model.{n}"]
                size = g[0].numel()
                out[offset : offset + size] += torch.einsum("b,bp->p", factor, g.flatten(1))
                offset += size
        losses.append(taken[0][1].detach())
        norms.append(norm.detach())
    if not losses:
        return outs[0].new_zeros(0), outs[0].new_zeros(0)
    return torch.cat(losses), torch.cat(norms)


def _looped(fn):  # noqa: ANN001, ANN202 - the per-sample function's shape, without vmap
    """``vmap(fn, in_dims=(None, 0, 0))``'s result computed one sample at a time (stacked)."""

    def run(prm: dict[str, torch.Tensor], xs: torch.Tensor, ys: torch.Tensor):  # noqa: ANN202
        each = [fn(prm, xi, yi) for xi, yi in zip(xs, ys, strict=True)]
        grads = {n: torch.stack([g[n] for g, _ in each]) for n in each[0][0]}
        return grads, torch.stack([v for _, v in each])

    return run


def parameters_of(flat: FlatModel, state: torch.Tensor) -> dict[str, torch.Tensor]:
    """The trainable parameters of ``flat.model`` as views of the state vector ``state`` (by name,
    in the flat layout's order)."""
    out, offset = {}, 0
    for n, p in flat.model.named_parameters():
        if p.requires_grad:
            out[n] = state[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
    return out


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


class DPSteps(LocalSteps):
    """A client's local steps under DP-SGD (module docstring): POISSON batches, and each step's
    gradient the clipped per-sample sum plus N(0, (σC)²·I), over the expected batch size qn.

    As :class:`~hpcfl.training.sgd.LocalSteps`, nothing is read back from the device until the
    tallies are read (once); the loss is averaged over the samples the batches held."""

    def __init__(
        self,
        flat: FlatModel,
        x: torch.Tensor,
        y: torch.Tensor,
        schedule: LocalSchedule,
        generator: torch.Generator,
        loss_fn: LossFn = cross_entropy_loss,
        *,
        clip: float,
        noise_multiplier: float,
    ) -> None:
        super().__init__(flat, x, y, schedule, generator, loss_fn)
        n = x.shape[0]
        self.clip, self.noise_multiplier = clip, noise_multiplier
        self.expected = min(1.0, schedule.batch_size / n) * n  # qn: the fixed denominator
        self.seen = sum(int(b.numel()) for b in self.drawn)
        self.noise = noise_source(generator, flat.grad)
        self._total: torch.Tensor | None = None

    def _draw(self, n: int, generator: torch.Generator) -> list[torch.Tensor]:
        """:func:`poisson_batches`."""
        return poisson_batches(n, self.schedule, generator)

    def _noised(self, total: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(total.shape, generator=self.noise, dtype=total.dtype, device=total.device)
        return (total + noise * (self.noise_multiplier * self.clip)) / self.expected

    def gradient(self, batch: torch.Tensor) -> torch.Tensor:
        """The privatised gradient of ``batch`` at the model's current state (a fresh tensor)."""
        if self._total is None:
            self._total = torch.empty_like(self.flat.grad)
        x, y = self.x[batch], self.y[batch]
        losses, _ = clipped_grad_sum(self.flat.model, self.loss_fn, x, y, self.clip, self._total)
        self._tally(losses)
        return self._noised(self._total)

    def gradients(
        self, batch: torch.Tensor, states: Sequence[torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The privatised gradients at each of ``states`` from one read of ``batch``: each sample's
        gradients clipped together (:func:`joint_clipped_grad_sums`), each sum noised; the states are
        returned as they are (DP refuses BatchNorm: no forward pass changes a float buffer)."""
        outs = [torch.empty_like(self.flat.grad) for _ in states]
        params = [parameters_of(self.flat, s) for s in states]
        x, y = self.x[batch], self.y[batch]
        losses, _ = joint_clipped_grad_sums(self.flat.model, self.loss_fn, params, x, y, self.clip, outs)
        self._tally(losses)
        if states:
            self.flat.load(states[-1])
        return [(self._noised(out), s.clone()) for out, s in zip(outs, states, strict=True)]

    def tallies(self, state_finite: torch.Tensor) -> Tallies:
        """The tallies, the loss averaged over the samples the batches held (not over the steps)."""
        return super().tallies(state_finite)._replace(mean_over=self.seen)


@dataclass
class Ledger:
    """The DP-SGD steps taken through a recording trainer (and the copies made from it)."""

    steps: int = 0


class DPTrainer(Trainer):
    """The run's trainer with DP-SGD as every client's local training: it overrides the one
    primitive, :meth:`steps`, so every entry point (``train``, ``train_tallies``, ``run``,
    ``run_many``, an algorithm's own loop over ``steps``) is DP-SGD. Participants train one by one
    (the per-sample step is already vectorised)."""

    def __init__(
        self,
        flat: FlatModel,
        schedule: LocalSchedule,
        *,
        clip: float,
        noise_multiplier: float,
        loss_fn: LossFn = cross_entropy_loss,
    ) -> None:
        super().__init__(flat, schedule, loss_fn)
        self.clip = clip
        self.noise_multiplier = noise_multiplier
        self.batch_size = schedule.batch_size  # B of the accountant's rates q_k = B/n_k
        self.ledger: Ledger | None = None  # counts the steps taken when recording

    def steps(
        self,
        data: ClientData,
        generator: torch.Generator,
        *,
        schedule: LocalSchedule | None = None,
        loss_fn: LossFn | None = None,
    ) -> DPSteps:
        """Client ``data``'s DP-SGD steps (:class:`DPSteps`), counted in :attr:`ledger` when recording.
        A schedule with another batch size is refused: its sampling rate is not the accountant's."""
        schedule = schedule or self.schedule
        if schedule.batch_size != self.batch_size:
            raise ConfigError(
                f"privacy.level=sample: the algorithm trains with batch_size {schedule.batch_size}, but the "
                f"accountant samples each client's data at the run's batch_size/n_k ({self.batch_size}/n_k); "
                "train with the run's batch size"
            )
        source = DPSteps(
            self.flat,
            data.x,
            data.y,
            schedule,
            generator,
            loss_fn or self.loss_fn,
            clip=self.clip,
            noise_multiplier=self.noise_multiplier,
        )
        if self.ledger is not None:
            self.ledger.steps += len(source)
        return source

    def recording(self) -> DPTrainer:
        """This trainer counting in a fresh :attr:`ledger` every DP-SGD step taken through it and
        through the trainers made from it (``with_schedule``): what the privacy wrapper hands a
        participant, to account the steps it actually took."""
        other = copy.copy(self)
        other.ledger = Ledger()
        return other
