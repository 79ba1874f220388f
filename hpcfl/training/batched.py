"""Local SGD of many clients as one vectorised step: the batched counterpart of ``descend``.

The K clients' state vectors are stacked into one ``(K, S)`` matrix; each local step runs the model
once under ``torch.func.vmap`` over ``functional_call`` with per-client parameters, per-client
BatchNorm statistics and per-client mini-batches, and one backward pass of the summed per-client
losses gives every client's own gradient (clients share no parameter, so ∂(Σ_j L_j)/∂w_i = ∂L_i/∂w_i).
The optimiser is ``descend``'s (weight decay, correction, momentum initialised to the first
direction, no dampening) applied to the rows.

What keeps it equal to training the clients one by one (to float32 rounding of batched kernels):

- each client's mini-batches are drawn from its own generator by :func:`batch_indices`, exactly as
  ``descend``'s steps draw them, so the result does not depend on how clients are grouped;
- a step runs only the clients that still have a step to take (clients with fewer steps stop; their
  rows and momentum stay as they were), and clients whose mini-batch of that step has another size
  (the last batch of an epoch) run in a separate vectorised call, so no batch is padded (padding would
  change BatchNorm's batch statistics);
- the loss of each client is its own mean over its own mini-batch.

``num_batches_tracked`` of BatchNorm is not part of the state vector (and unused with the default
``momentum=0.1``); it counts vectorised calls here, not client steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, vmap

from hpcfl.training.flat import FlatModel
from hpcfl.training.sgd import Correction, LocalResult, LocalSchedule, LossFn, batch_indices


@dataclass(frozen=True)
class LinearCorrection:
    """The correction ``d ← d − shift + pull·(w − anchor)`` (SCAFFOLD's −c_k + c, FedProx's proximal
    pull, FedDyn's both), callable like any :data:`~hpcfl.training.sgd.Correction` and vectorised
    over stacked clients by :func:`batched_local_sgd`."""

    shift: torch.Tensor | None = None
    pull: float = 0.0
    anchor: torch.Tensor | None = None

    def __call__(self, w: torch.Tensor, d: torch.Tensor) -> None:
        if self.shift is not None:
            d.sub_(self.shift)
        if self.pull:
            assert self.anchor is not None
            d.add_(w - self.anchor, alpha=self.pull)


@dataclass(frozen=True)
class ClientJob:
    """One client's share of a batched run: its start state, samples, generator and correction."""

    x0: torch.Tensor  # (S,)
    x: torch.Tensor  # (n, ...)
    y: torch.Tensor  # (n,)
    generator: torch.Generator
    correction: Correction | None = None


class _Loss(nn.Module):
    """``loss_fn(model, x, y)`` as a module, so ``functional_call`` can swap the model's tensors."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model, x, y)


@dataclass(frozen=True)
class _Slots:
    """Names and shapes of the state vector's pieces: parameters first, then float buffers."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    num_params: int

    @staticmethod
    def of(flat: FlatModel) -> _Slots:
        names, shapes, offsets, off = [], [], [], 0
        for name, p in flat.model.named_parameters():
            if p.requires_grad:
                names.append(f"model.{name}")
                shapes.append(p.shape)
                offsets.append(off)
                off += p.numel()
        for module_name, module in flat.model.named_modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and buf.is_floating_point():
                    names.append(f"model.{module_name}.{name}" if module_name else f"model.{name}")
                    shapes.append(buf.shape)
                    offsets.append(off)
                    off += buf.numel()
        return _Slots(tuple(names), tuple(shapes), tuple(offsets), flat.num_params)

    def tensors(self, state: torch.Tensor) -> tuple[dict[str, torch.Tensor], list, list]:
        """Per-slot (G, *shape) tensors of the stacked states ``state`` (G, S): the parameters as
        leaves that share ``state``'s storage (one leaf per tensor: views of one big leaf would each
        send a zero-filled (G, P) gradient through autograd), the float buffers as contiguous copies
        (vmap's BatchNorm rule updates only contiguous running statistics in place). Returns the dict,
        the parameter leaves (in vector order) and the (offset, buffer) pairs to write back."""
        G = state.shape[0]
        out: dict[str, torch.Tensor] = {}
        leaves, back = [], []
        for name, shape, off in zip(self.names, self.shapes, self.offsets, strict=True):
            n = shape.numel()
            if off < self.num_params:
                leaf = state[:, off : off + n].detach().view(G, *shape).requires_grad_(True)
                out[name] = leaf
                leaves.append(leaf)
            else:
                buf = state[:, off : off + n].reshape(G, *shape).clone()
                out[name] = buf
                back.append((off, buf))
        return out, leaves, back


def batched_local_sgd(
    flat: FlatModel,
    jobs: Sequence[ClientJob],
    schedule: LocalSchedule,
    loss_fn: LossFn,
    *,
    batches: Sequence[list[torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, list[LocalResult]]:
    """Train every job's client from its ``x0`` as ``descend`` would, in vectorised steps.

    ``batches``: each job's mini-batches (host index tensors) when they are already drawn (the
    trainer draws them through its :class:`~hpcfl.training.sgd.LocalSteps`); else drawn here from
    each job's generator by :func:`~hpcfl.training.sgd.batch_indices`, as ``LocalSteps`` draws them.

    Returns the ``(K, S)`` matrix of final state vectors and each client's :class:`LocalResult`
    (``finite=False`` for a client whose loss became NaN/inf; its row is then meaningless). Nothing is
    read back from the device until the end: one read for the whole group. The
    shared ``flat.model`` only lends its structure: its own tensors are not changed.
    """
    K = len(jobs)
    model = flat.model
    model.train()
    slots = _Slots.of(flat)
    P = flat.num_params
    W = torch.stack([j.x0 for j in jobs])  # (K, S)
    # every client's samples in one tensor, so a step gathers its mini-batches with one index
    X = torch.cat([j.x for j in jobs])  # (Σn, ...)
    Y = torch.cat([j.y for j in jobs])  # (Σn,)
    plan = _RoundPlan.build(jobs, schedule, W.device, batches)
    momentum: torch.Tensor | None = None
    loss_sum = torch.zeros(K, dtype=torch.float64, device=W.device)
    alive = torch.ones(K, dtype=torch.bool, device=W.device)  # no non-finite loss yet
    finite_steps = torch.zeros(K, dtype=torch.int64, device=W.device)  # steps before the first one
    shifts, pulls, anchor = _linear_form([j.correction for j in jobs], W)
    wrapped = _Loss(model, loss_fn)

    def client_loss(tensors: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return functional_call(wrapped, tensors, (xb, yb))

    batched_loss = vmap(client_loss)
    for step, groups in enumerate(plan.steps):
        for group in groups:
            rows, every = group.rows, group.every
            state = W if every else W[group.rows_dev]  # (G, S): a view when every client steps, else a copy
            tensors, leaves, buffers = slots.tensors(state)
            losses = batched_loss(tensors, X[group.idx], Y[group.idx])  # (G,)
            # a client whose loss turned non-finite goes on stepping on a row that is then meaningless
            # (rows are independent: it cannot reach the others) and is reported at the end
            ok = torch.isfinite(losses.detach()) & (alive if every else alive[group.rows_dev])  # (G,)
            grads = torch.autograd.grad(losses.sum(), leaves)
            grad = torch.cat([g.reshape(len(rows), -1) for g in grads], dim=1)  # (G, P)
            w = state[:, :P]
            d = grad.add(w, alpha=schedule.weight_decay) if schedule.weight_decay else grad  # (G, P)
            _correct(d, w, group, jobs, shifts, pulls, anchor)
            if schedule.momentum:
                if momentum is None:
                    momentum = torch.zeros_like(W[:, :P])  # (K, P); every client's first step is step 0
                if step == 0:
                    buf = d.clone()
                else:
                    buf = (momentum if every else momentum[group.rows_dev]).mul_(schedule.momentum).add_(d)
                if every:
                    momentum = buf
                else:
                    momentum[group.rows_dev] = buf
                d = buf
            w.add_(d, alpha=-schedule.lr)
            for off, buf in buffers:
                state[:, off : off + buf[0].numel()] = buf.reshape(len(rows), -1)
            if every:
                alive = ok
                finite_steps += ok
                loss_sum += losses.detach().to(torch.float64)
            else:
                W[group.rows_dev] = state
                alive[group.rows_dev] = ok
                finite_steps[group.rows_dev] += ok
                loss_sum[group.rows_dev] += losses.detach().to(torch.float64)
    # one device-to-host read for every client of the group
    good, sums, rows_finite = torch.stack(
        [finite_steps.double(), loss_sum, torch.isfinite(W).all(dim=1).double()]
    ).tolist()
    results = []
    for i in range(K):
        if good[i] < plan.num_steps[i]:
            results.append(LocalResult(loss=float("nan"), steps=int(good[i]), finite=False))
        elif not rows_finite[i]:
            results.append(LocalResult(loss=float("nan"), steps=plan.num_steps[i], finite=False))
        else:
            results.append(
                LocalResult(loss=sums[i] / max(plan.num_steps[i], 1), steps=plan.num_steps[i], finite=True)
            )
    return W, results


@dataclass(frozen=True)
class _Group:
    """The clients that take one vectorised call at a step: those with a step left whose mini-batch
    of that step has one size (no padding: it would change BatchNorm's batch statistics)."""

    rows: list[int]  # host copy, for the per-row corrections
    rows_dev: torch.Tensor  # (G,) on the device
    idx: torch.Tensor  # (G, b) rows of the stacked samples, on the device
    every: bool  # all K clients, in order: the group works on W itself


@dataclass(frozen=True)
class _RoundPlan:
    """Every vectorised call of one round, with its index tensors built on the host and moved to the
    device in ONE copy (no per-step index copy, which waits for the device)."""

    steps: list[list[_Group]]
    num_steps: list[int]

    @staticmethod
    def build(
        jobs: Sequence[ClientJob],
        schedule: LocalSchedule,
        device: torch.device,
        batches: Sequence[list[torch.Tensor]] | None = None,
    ) -> _RoundPlan:
        K = len(jobs)
        if batches is None:
            batches = [batch_indices(j.x.shape[0], schedule, j.generator) for j in jobs]
        sizes = [j.x.shape[0] for j in jobs]
        starts = [sum(sizes[:i]) for i in range(K)]
        num_steps = [len(b) for b in batches]
        layout: list[list[tuple[list[int], torch.Tensor]]] = []
        pieces: list[torch.Tensor] = []
        for step in range(max(num_steps, default=0)):
            by_size: dict[int, list[int]] = {}
            for i in range(K):
                if step < num_steps[i]:
                    by_size.setdefault(int(batches[i][step].numel()), []).append(i)
            groups = []
            for rows in by_size.values():
                idx = torch.stack([batches[i][step] + starts[i] for i in rows])  # (G, b), host
                groups.append((rows, idx))
                pieces += [torch.tensor(rows), idx.flatten()]  # host: moved below in one copy
            layout.append(groups)
        moved = torch.cat(pieces).to(device).split([p.numel() for p in pieces]) if pieces else ()
        steps, at = [], 0
        for groups in layout:
            out = []
            for rows, idx in groups:
                out.append(_Group(rows, moved[at], moved[at + 1].view(idx.shape), rows == list(range(K))))
                at += 2
            steps.append(out)
        return _RoundPlan(steps, num_steps)


def _linear_form(
    corrections: list[Correction | None], W: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | float | None, torch.Tensor | None]:
    """Stack the clients' :class:`LinearCorrection` s: shifts (K, P) (None: no client shifts), the pull
    (one float when all clients share it, else (K, 1)), the anchor ((1, P) when all clients share one
    tensor, else (K, P)). ``(None, None, None)`` when some client's correction is another callable."""
    if any(c is not None and not isinstance(c, LinearCorrection) for c in corrections):
        return None, None, None
    linear = [c if c is not None else LinearCorrection() for c in corrections]
    shifts = None
    if any(c.shift is not None for c in linear):
        P = next(c.shift for c in linear if c.shift is not None).numel()
        shifts = torch.stack([c.shift if c.shift is not None else W.new_zeros(P) for c in linear])
    pulls: torch.Tensor | float = linear[0].pull
    if any(c.pull != linear[0].pull for c in linear):
        pulls = torch.tensor([c.pull for c in linear], dtype=W.dtype, device=W.device).unsqueeze(1)
    anchor = None
    anchors = [c.anchor for c in linear if c.pull]
    if anchors:
        if all(a is anchors[0] for a in anchors) and len(anchors) == len(linear):
            anchor = anchors[0].unsqueeze(0)
        else:
            P = anchors[0].numel()
            anchor = torch.stack([c.anchor if c.anchor is not None else W.new_zeros(P) for c in linear])
    return shifts, pulls, anchor


def _correct(
    d: torch.Tensor,
    w: torch.Tensor,
    group: _Group,
    jobs: Sequence[ClientJob],
    shifts: torch.Tensor | None,
    pulls: torch.Tensor | float | None,
    anchor: torch.Tensor | None,
) -> None:
    """Apply the group's corrections to ``d`` in place: vectorised for linear ones, else row by row."""
    rows, every = group.rows_dev, group.every
    if pulls is None:  # some correction is an arbitrary callable: apply each to its row's views
        for j, i in enumerate(group.rows):
            if jobs[i].correction is not None:
                jobs[i].correction(w[j], d[j])
        return
    if shifts is not None:
        d.sub_(shifts if every else shifts[rows])
    if isinstance(pulls, torch.Tensor):
        a = anchor if anchor is None or anchor.shape[0] == 1 or every else anchor[rows]
        d.add_((w - a) * (pulls if every else pulls[rows]))
    elif pulls:
        assert anchor is not None
        a = anchor if anchor.shape[0] == 1 or every else anchor[rows]
        d.add_(w - a, alpha=pulls)
