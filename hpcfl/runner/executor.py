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

``client_threads: T`` (the CPU, one client at a time per thread) trains T participants at once in
Python threads, each on its own copy of the model with the rank's torch threads divided among them
(``threads // T``, at least 1); the tasks are declared, and their uploads made, in the main thread in
participant order. A small model's step does not fill 2 cores with intra-op threads (simplecnn at
batch 32: 2 threads are 1.3x one, 2 clients on 1 thread each 1.7x), and torch releases the GIL
inside its kernels. Each client's result is bit for bit the one ``client_threads: 1`` gives with
the same per-client torch threads (tested); how many threads a client's kernels used is in the
run's ``determinism.json``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from hpcfl.algorithms import Algorithm, ClientData, ClientState, NonFiniteLoss, ServerState, Trainer
from hpcfl.algorithms.base import ClientContext, LocalTask, Upload
from hpcfl.training.flat import FlatModel
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

    def __init__(self, size: int = 1, *, rank: int = 0, threads: int = 1) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"ClientExecutor takes a resolved group size (a positive int), not {size!r}: resolve "
                "client_batch once with resolve_client_batch"
            )
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"ClientExecutor takes a positive number of client threads, not {threads!r}")
        self.size = size  # participants per vectorised group, ``auto`` already resolved
        self.rank = rank
        self.threads = threads  # participants trained at once in Python threads (``client_threads``)
        self._said: set[str] = set()
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()  # each worker thread's copy of the trainer

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
        if size == 1 and self.threads > 1 and trainer is not None and len(mine) > 1:
            if type(trainer) is Trainer:
                yield from self._threaded(algo, server, trainer, mine, get, data, context)
                return
            self._say(f"client_threads: {type(trainer).__name__} trains its clients one by one")
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

    def _threaded(
        self,
        algo: Algorithm,
        server: ServerState,
        trainer: Trainer,
        mine: list[int],
        get: Callable[[int], ClientState],
        data: Callable[[int], ClientData],
        context: Callable[[int], ClientContext],
    ) -> Iterator[Outcome]:
        """``mine`` trained ``self.threads`` at a time, outcomes in ``mine`` order. Tasks are declared
        ahead (at most two per thread waiting), so a thread that finishes a small client takes the
        next one at once; the caller's work on an outcome overlaps the threads' training."""
        first = mine[0]
        state, d, ctx = get(first), data(first), context(first)
        task = algo.local_task(server, state, d, ctx)
        if task is None or task.loss_fn is not None:  # the method's: one by one on all the threads
            why = algo.unbatched_reason if task is None else "its local task brings its own loss"
            self._say(f"client_threads: {algo.name} trains its clients one by one ({why})")
            yield _one(algo, server, state, d, ctx)
            for k in mine[1:]:
                yield _one(algo, server, get(k), data(k), context(k))
            return
        outer = torch.get_num_threads()
        inner = max(1, outer // self.threads)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="hpcfl-client")
        pending: deque[tuple[int, LocalTask | None, Future[Any]]] = deque()
        torch.set_num_threads(inner)  # the main thread's share while the workers train
        try:
            pending.append(self._submit(trainer, first, task, d, ctx, inner))
            for k in mine[1:]:
                pending.append(self._start(algo, server, trainer, k, get(k), data(k), context(k), inner))
                if len(pending) >= 2 * self.threads:
                    yield _finished(*pending.popleft())
            while pending:
                yield _finished(*pending.popleft())
        finally:
            torch.set_num_threads(outer)

    def _start(
        self,
        algo: Algorithm,
        server: ServerState,
        trainer: Trainer,
        k: int,
        state: ClientState,
        d: ClientData,
        ctx: ClientContext,
        inner: int,
    ) -> tuple[int, LocalTask | None, Future[Any]]:
        """Participant ``k``'s work, begun: its declared task on a worker thread, or (a participant
        whose method declares none for it, or whose task brings a loss of its own) its whole update
        here, done."""
        task = algo.local_task(server, state, d, ctx)
        if task is None or task.loss_fn is not None:
            done: Future[Any] = Future()
            done.set_result(_one(algo, server, state, d, ctx))
            return k, None, done
        return self._submit(trainer, k, task, d, ctx, inner)

    def _submit(
        self, trainer: Trainer, k: int, task: LocalTask, d: ClientData, ctx: ClientContext, inner: int
    ) -> tuple[int, LocalTask | None, Future[Any]]:
        """``task`` (participant ``k``'s) queued for a worker thread, under its participant's schedule."""
        task = dataclasses.replace(task, schedule=task.schedule or (ctx.trainer or trainer).schedule)
        assert self._pool is not None
        return k, task, self._pool.submit(self._train, trainer, task, d, ctx.generator, inner)

    def _train(
        self, trainer: Trainer, task: LocalTask, d: ClientData, generator: torch.Generator, inner: int
    ) -> tuple[torch.Tensor, LocalResult] | None:
        """On a worker thread: ``task`` trained on this thread's copy of ``trainer``'s model (None when
        its loss became NaN/inf)."""
        torch.set_num_threads(inner)
        entry = getattr(self._local, "copy", None)
        if entry is None or entry[0] is not trainer:
            twin = copy.copy(trainer)
            twin.flat = FlatModel(copy.deepcopy(trainer.flat.model))
            entry = self._local.copy = (trainer, twin)
        try:
            return entry[1].run(task, d, generator)
        except NonFiniteLoss:
            return None


def _finished(k: int, task: LocalTask | None, future: Future[Any]) -> Outcome:
    """The outcome of a begun participant (:meth:`ClientExecutor._start`): its task's upload made
    from the trained state, here on the calling thread."""
    if task is None:
        outcome: Outcome = future.result()
        return outcome
    trained = future.result()
    if trained is None:
        return k, None, None
    return (k, *task.finish(*trained))


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
