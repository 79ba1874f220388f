"""How a rank trains its participants of a round: one by one, or in vectorised groups.

``client_batch: 1`` calls :meth:`~hpcfl.algorithms.Algorithm.client_update` for each participant in
turn, the reference every other setting is tested against (and what the default, ``auto``, means
on the CPU). ``client_batch: N`` takes
the participants in groups of N: each declares its :class:`~hpcfl.algorithms.base.LocalTask`, the
group trains as one vectorised step per local step (:func:`~hpcfl.training.batched.batched_local_sgd`),
and each task's ``finish`` makes its upload. Results equal the sequential ones to float32 rounding
(tested to 1e-5 relative) and do not depend on N: every client draws its mini-batches from its own
generator. ``auto`` picks N on a GPU from the memory one client's step measurably needs, and 1 on
the CPU, where batching does not pay (see :func:`auto_client_batch`). Algorithms that declare no local task (MOON, FedCKA, NTK-FL) train one by
one, with one logged line saying why.

When it wins: many small clients on one device (a small CNN's step at batch 64 is a few dozen tiny
kernel launches, so K clients cost about one batched step); a large model already fills the device.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hpcfl.algorithms import Algorithm, ClientData, ClientState, NonFiniteLoss, ServerState, Trainer
from hpcfl.algorithms.base import ClientContext, LocalTask, Upload
from hpcfl.training.sgd import LocalResult

log = logging.getLogger("hpcfl.runner")

#: largest group ``auto`` forms (per rank): beyond it the step is long enough to fill a GPU
AUTO_MAX = 1024
#: the share of the device's memory ``auto`` lets a group's training use
AUTO_MEMORY_SHARE = 0.4

# (k, upload or None when its loss became NaN/inf, new client state or None)
Outcome = tuple[int, Upload | None, ClientState | None]


class ClientExecutor:
    """Trains a rank's participants of one round and yields each one's outcome in order."""

    def __init__(self, size: int = 1, *, rank: int = 0) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"ClientExecutor takes a resolved group size (a positive int), not {size!r}: resolve "
                "client_batch once with resolve_client_batch"
            )
        self.size = size  # participants per vectorised group, ``auto`` already resolved
        self.rank = rank
        self._said: set[str] = set()

    def _say(self, line: str) -> None:
        if self.rank == 0 and line not in self._said:
            self._said.add(line)
            log.warning("hpcfl: %s", line)

    def run(
        self,
        algo: Algorithm,
        server: ServerState,
        trainer: Trainer | None,
        mine: list[int],
        get: Callable[[int], ClientState],
        data: Callable[[int], ClientData],
        context: Callable[[int], ClientContext],
    ) -> Iterator[Outcome]:
        """Each participant's outcome, in ``mine`` order (``get`` reads a client state)."""
        batched = bool(mine) and self.size != 1 and trainer is not None
        if batched and trainer is not None and (why := unbatchable(trainer.flat.model)) is not None:
            self._say(f"client_batch: the model trains its clients one by one ({why})")
            batched = False
        size = self.size if batched else 1
        if size == 1 or trainer is None:
            for k in mine:
                yield _one(algo, server, get(k), data(k), context(k))
            return
        for first in range(0, len(mine), size):
            group = mine[first : first + size]
            yield from self._group(algo, server, trainer, group, get, data, context)

    def _group(
        self,
        algo: Algorithm,
        server: ServerState,
        trainer: Trainer,
        group: list[int],
        get: Callable[[int], ClientState],
        data: Callable[[int], ClientData],
        context: Callable[[int], ClientContext],
    ) -> Iterator[Outcome]:
        states = [get(k) for k in group]
        datas = [data(k) for k in group]
        ctxs = [context(k) for k in group]
        tasks = [algo.local_task(server, s, d, c) for s, d, c in zip(states, datas, ctxs, strict=True)]
        if any(t is None for t in tasks):
            self._say(f"client_batch: {algo.name} trains its clients one by one ({algo.unbatched_reason})")
            for s, d, c in zip(states, datas, ctxs, strict=True):
                yield _one(algo, server, s, d, c)
            return
        # each task with the schedule it trains under: its own, else its participant's (``ctx.trainer``
        # carries the participant's drawn work under ``system.work``), else the run's
        declared: list[LocalTask] = [
            dataclasses.replace(t, schedule=t.schedule or (c.trainer or trainer).schedule)
            for t, c in zip(tasks, ctxs, strict=True)
            if t is not None
        ]
        if len(group) == 1 or not all(trainer.can_batch([t]) for t in declared):
            if len(group) > 1:
                self._say(f"client_batch: {algo.name}'s local tasks bring their own loss; trained one by one")
            for k, t, d, c in zip(group, declared, datas, ctxs, strict=True):
                try:
                    y, result = trainer.run(t, d, c.generator)
                except NonFiniteLoss:
                    yield k, None, None
                    continue
                yield (k, *t.finish(y, result))
            return
        trained = _run_by_schedule(trainer, declared, datas, [c.generator for c in ctxs])
        for k, t, (y, result) in zip(group, declared, trained, strict=True):
            if not result.finite:
                yield k, None, None
            else:
                yield (k, *t.finish(y, result))


def _run_by_schedule(
    trainer: Trainer, tasks: list[LocalTask], datas: list[ClientData], generators: list[torch.Generator]
) -> list[tuple[torch.Tensor, LocalResult]]:
    """The tasks (each with its schedule set) trained in vectorised groups of one schedule each;
    results in ``tasks`` order. Without a ``system`` section that is one group, the whole list.
    (A step count per client inside one group would keep unequal work in one vectorised run:
    ``batched_local_sgd`` already lets clients with fewer steps stop; not done here.)"""
    out: list[Any] = [None] * len(tasks)
    for schedule in dict.fromkeys(t.schedule for t in tasks):  # first-seen order
        idx = [i for i, t in enumerate(tasks) if t.schedule == schedule]
        trained = trainer.run_many(
            [tasks[i] for i in idx], [datas[i] for i in idx], [generators[i] for i in idx]
        )
        for i, result in zip(idx, trained, strict=True):
            out[i] = result
    return out


def _one(
    algo: Algorithm, server: ServerState, state: ClientState, data: ClientData, ctx: ClientContext
) -> Outcome:
    try:
        upload, new = algo.client_update(server, state, data, ctx)
    except NonFiniteLoss:
        return data.k, None, None
    return data.k, upload, new


def resolve_client_batch(
    setting: int | str, trainer: Trainer, sample: torch.Tensor, largest: int, *, rank: int = 0
) -> int:
    """The run's group size: ``setting``, or with ``auto`` what :func:`auto_client_batch` chooses for
    ``sample`` (1, ...) on the trainer's device (logged once, by rank 0, when it groups clients).

    The one place ``auto`` is resolved: once per run (from the shape of the samples and the largest
    client's size, so every rank and a resumed run find the same N); :class:`ClientExecutor` takes
    the result."""
    if setting != "auto":
        return int(setting)
    size, why = auto_client_batch(trainer, sample, largest, memory_share=AUTO_MEMORY_SHARE)
    if rank == 0 and size > 1:
        log.warning("hpcfl: client_batch auto: groups of %d (%s)", size, why)
    return size


def unbatchable(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot train clients as one vectorised group, or None when it can."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.RNNBase):
            return (
                f"{name} is an {type(module).__name__}: torch.func.vmap has no batching rule for "
                "aten::lstm/gru/rnn and cannot loop over per-client weights"
            )
    return None


def auto_client_batch(
    trainer: Trainer, sample: torch.Tensor, n: int, *, memory_share: float
) -> tuple[int, str]:
    """The group size ``auto`` chooses, and why.

    On the CPU: 1. Batching does not pay there: vmap turns a convolution with per-client weights
    into one grouped convolution, whose backward on the CPU costs more than the clients' own
    convolutions one by one (measured on the 2-core dev box, 16 clients × 256 samples, 1 thread:
    simplecnn 0.63×, the MLP 0.73× the sequential speed).

    On a GPU: as many clients as fit ``memory_share`` of its total memory, with one client's need
    measured by :func:`client_footprint` for a client of ``n`` samples shaped like ``sample``
    (1, ...). Fixed by the device, the model and the data, so a resumed run groups clients as the
    uninterrupted one did.
    """
    device = trainer.flat.vector.device
    if device.type != "cuda":
        return 1, "on the CPU one client at a time is faster than vectorised groups"
    per_client = client_footprint(trainer, sample, n)
    total = torch.cuda.get_device_properties(device).total_memory
    n = int(max(1, min(AUTO_MAX, memory_share * total // max(per_client, 1))))
    return (
        n,
        f"{per_client / 2**20:.1f} MiB per client measured, {memory_share:.0%} of {total / 2**30:.0f} GiB",
    )


def client_footprint(trainer: Trainer, sample: torch.Tensor, n: int) -> int:
    """Bytes a client of ``n`` samples shaped like ``sample`` (1, ...) adds to a vectorised group:
    5 state-sized vectors (state, gradient, direction, momentum, correction), its samples, and one
    full mini-batch's activations (every leaf module's output in a forward pass, counted twice:
    kept for and produced by the backward)."""
    flat = trainer.flat
    elem = flat.vector.element_size()
    batch = sample.expand(trainer.schedule.batch_size, *sample.shape[1:])
    acts = _activation_numel(flat.model, batch) * 2 * elem
    return 5 * flat.size * elem + sample.numel() * sample.element_size() * n + acts


def _activation_numel(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Elements of every leaf module's output in one forward pass of ``x`` (no autograd)."""
    count = [0]

    def hook(_m: torch.nn.Module, _i: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            count[0] += out.numel()

    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    training = model.training
    try:
        model.eval()  # no running-statistics update
        with torch.no_grad():
            model(x)
    finally:
        model.train(training)
        for h in handles:
            h.remove()
    return count[0]
