"""The round loop: who trains, local work, one allreduce, the server step, evaluation, bookkeeping.

The algorithm declares its round (:meth:`~hpcfl.algorithms.Algorithm.exchange`,
:meth:`~hpcfl.algorithms.Algorithm.participants`); this loop carries it out the same way for every
algorithm:

1. the participants are drawn from a generator that depends only on (seed, stage, round) and placed
   on ranks balanced by sample count (any rank can train any client);
2. each rank runs its participants' local updates (one by one, or ``client_batch`` at a time as one
   vectorised step: :mod:`hpcfl.runner.executor`) and adds their uploads into one buffer
   (:class:`~hpcfl.runner.buffer.BufferLayout`); with ``reduction: float64`` it accumulates in
   float64 and rounds once after the allreduce, so the result does not depend on how participants
   are placed on ranks (bit-identical on 1, 2 or 3 ranks);
3. ONE allreduce (plus an allgather only when the algorithm gathers);
4. the same server update on every rank; evaluation sharded over ranks;
5. bookkeeping (metrics, checkpoints, progress, stop requests) in the hook.
"""

from __future__ import annotations

import functools
import pickle
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, is_dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from hpcfl.algorithms import Algorithm, ClientData, ClientState, ServerState, Trainer
from hpcfl.algorithms.base import (
    Aggregate,
    ClientContext,
    ServerContext,
    Upload,
    state_from_dict,
    state_to_dict,
)
from hpcfl.algorithms.participation import Population
from hpcfl.comm.base import Communicator
from hpcfl.comm.placement import place_round
from hpcfl.errors import DivergenceError
from hpcfl.metrics.drift import DriftDiversity
from hpcfl.metrics.similarity import LayerSimilarity
from hpcfl.runner.buffer import BufferLayout
from hpcfl.runner.executor import ClientExecutor

if TYPE_CHECKING:
    from hpcfl.runner.checkpoint import Checkpoint

# Called after every round with (round_done, server, states, metrics_row or None); returns True to stop.
RoundHook = Callable[[int, ServerState, "ClientStore", dict[str, Any] | None], bool]
# Evaluates the server state; returns metric columns (test_accuracy, test_loss, ...).
Evaluator = Callable[[ServerState], dict[str, float]]
# The RNG of client k in round r (a pure function of seed, round and client).
GeneratorFn = Callable[[int, int], torch.Generator]


class ClientStore(Protocol):
    """Where client states live between rounds (memory or the on-disk client-state store)."""

    def get(self, k: int) -> ClientState: ...

    def put(self, k: int, state: ClientState) -> None: ...

    def written_elsewhere(self, k: int) -> None:
        """Another rank trained client ``k`` this round and stored its state."""

    def checkpoint(self) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
        """What a round checkpoint keeps: (per-client files this rank writes, entries of the
        checkpoint's ``extra``)."""
        ...

    def restore(self, ckpt: Checkpoint, reset: Iterable[int] = ()) -> None:
        """Return to ``ckpt``; the clients in ``reset`` start again from ``init(k)``."""


class MemoryStates:
    """Client states in a dict; a client never trained reads as ``init(k)``."""

    def __init__(
        self, init: Callable[[int], ClientState], states: dict[int, ClientState] | None = None
    ) -> None:
        self.init = init
        self.states: dict[int, ClientState] = dict(states or {})

    def get(self, k: int) -> ClientState:
        return self.states[k] if k in self.states else self.init(k)

    def put(self, k: int, state: ClientState) -> None:
        if fields(state):  # stateless algorithms keep nothing
            self.states[k] = state

    def written_elsewhere(self, k: int) -> None:
        """Nothing to do: in memory, a client is always trained on the same rank."""

    def checkpoint(self) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
        """One file per held client (the tensors themselves: saved before they change)."""
        return {k: state_to_dict(c) for k, c in self.states.items()}, {}

    def restore(self, ckpt: Checkpoint, reset: Iterable[int] = ()) -> None:
        """Take the checkpoint's per-client files (a zip CRC-checked by the loader), ``reset`` aside."""
        if "client_map" in ckpt.extra:
            raise RuntimeError("a checkpoint with a client-state store must restore into ClientStates")
        dropped, cls = set(reset), type(self.init(0))
        self.states.update({k: state_from_dict(cls, d) for k, d in ckpt.clients.items() if k not in dropped})


class StateIO:
    """Client-state reads and writes of one round, overlapped with training.

    One worker thread does every read and write in order: the next participant's state is read
    while the current one trains, and a new state is written behind. ``get``/``finish`` return
    only the time this rank actually WAITED for I/O (what the round pays for it). States in memory
    take the direct path: nothing to overlap.
    """

    def __init__(self, states: ClientStore, order: list[int]) -> None:
        self.states = states
        self.order = order
        self.waited = 0.0
        self._pool: Any = None
        self._next: dict[int, Any] = {}
        if not isinstance(states, MemoryStates) and order:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpcfl-state-io")
            self._writes: list[Any] = []
            self._prefetch(0)

    def _prefetch(self, index: int) -> None:
        if index < len(self.order):
            k = self.order[index]
            self._next[k] = self._pool.submit(self.states.get, k)

    def get(self, k: int) -> ClientState:
        if self._pool is None:
            return self.states.get(k)
        t = time.perf_counter()
        state = self._next.pop(k).result()
        self.waited += time.perf_counter() - t
        self._prefetch(self.order.index(k) + 1)
        return state

    def put(self, k: int, state: ClientState) -> None:
        if self._pool is None:
            self.states.put(k, state)
        else:
            self._writes.append(self._pool.submit(self.states.put, k, state))

    def finish(self) -> float:
        """Wait for the writes (and drop unused reads); returns the seconds spent waiting."""
        if self._pool is not None:
            t = time.perf_counter()
            for fut in [*self._writes, *self._next.values()]:
                fut.result()
            self._pool.shutdown()
            self.waited += time.perf_counter() - t
        return self.waited


def round_generator(seed: int, stage: int, rnd: int) -> torch.Generator:
    """The generator the participants of round ``rnd`` are drawn from: a pure function of (seed,
    stage, round), independent of ranks and resumes."""
    state = np.random.SeedSequence([seed, 0x9A7, stage, rnd]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


@dataclass
class RoundPlan:
    """What the loop needs besides the states: who may train, on what, and how results are judged."""

    algorithm: Algorithm
    comm: Communicator
    data: Callable[[int], ClientData]  # any client's data, on the training device
    trainer: Trainer | None
    population: Population
    generator: GeneratorFn
    evaluate: Evaluator
    seed: int = 0
    stage_index: int = 0
    eval_every: int = 1
    reduction: str = "float64"  # float64 (placement-independent) | float32
    lr_hint: str = ""  # how to name the learning rate in a divergence message
    similarity: LayerSimilarity | None = None  # per-layer CKA of each client vs global (cka_metrics)
    drift: DriftDiversity | None = None  # per-layer drift diversity (drift_diversity: true)
    client_metrics: tuple[str, ...] = ("loss",)
    client_batch: int | str = 1  # participants per vectorised training step: 1 | N | auto


def round_layout(plan: RoundPlan, num_participants: int, dtype: torch.dtype) -> BufferLayout:
    """The round's buffer: every declared sum, then the runner's channels (per-rank slots carry each
    rank's compute time, client-state I/O time and peak memory, so load imbalance is measured
    without another collective)."""
    ex = plan.algorithm.exchange(dtype)
    S = plan.similarity.size if plan.similarity is not None else 0
    return BufferLayout.of(
        [(f"sum:{s.name}", s.length) for s in ex.sums]
        + [
            ("weight", 1),
            ("count", 1),
            ("nonfinite", num_participants),
            ("metrics", num_participants * len(plan.client_metrics)),
            ("cka", S),
            ("drift", plan.drift.size if plan.drift is not None else 0),
            ("rank_compute", plan.comm.size),
            ("rank_state_io", plan.comm.size),
            ("rank_rss", plan.comm.size),
        ]
    )


def buffer_dtype(plan: RoundPlan, dtype: torch.dtype) -> torch.dtype:
    """float64 for a placement-independent sum (or when a declared sum is float64), else float32."""
    ex = plan.algorithm.exchange(dtype)
    if plan.reduction == "float64" or any(s.dtype == torch.float64 for s in ex.sums):
        return torch.float64
    return ex.sums[0].dtype if ex.sums else dtype


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _nbytes(obj: Any) -> int:
    """Bytes a gathered object costs on the wire: tensors by their encoding, others pickled."""
    if isinstance(obj, torch.Tensor):
        if obj.is_sparse:
            obj = obj.coalesce()
            return obj.values().nbytes + obj.indices().nbytes
        return obj.nbytes
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(o) for o in obj.values())
    if is_dataclass(obj) and not isinstance(obj, type):
        return sum(_nbytes(getattr(obj, f.name)) for f in fields(obj))
    return len(pickle.dumps(obj))


def _state_nbytes(server: ServerState) -> int:
    """Bytes a participant downloads: every tensor of the server state but its ``server_only`` ones."""
    return sum(
        v.nbytes
        for f in fields(server)
        if f.name not in server.server_only and isinstance(v := getattr(server, f.name), torch.Tensor)
    )


def run_rounds(
    plan: RoundPlan,
    server: ServerState,
    states: ClientStore,
    start: int,
    stop: int,
    *,
    stage: str = "train",
    round_offset: int = 0,
    hook: RoundHook | None = None,
) -> tuple[ServerState, int]:
    """Run rounds ``start`` .. ``stop - 1``; returns the final server state and the rounds completed.

    ``round_offset`` shifts the round numbers written to metrics (TCT's stage 2 continues stage 1's
    count).
    """
    algo, comm = plan.algorithm, plan.comm
    dtype = server.x.dtype
    ex = algo.exchange(dtype)
    bdtype = buffer_dtype(plan, dtype)
    upload_bytes = sum(s.nbytes for s in ex.sums)
    executor = ClientExecutor(
        plan.client_batch, rank=comm.rank, largest=max(plan.population.sizes, default=1)
    )
    done = start
    for rnd in range(start, stop):
        t0 = time.perf_counter()
        # 1. who trains, and where
        who = algo.participants(rnd, plan.population, round_generator(plan.seed, plan.stage_index, rnd))
        position = {k: i for i, k in enumerate(who)}
        sizes = [plan.population.sizes[k] for k in who]
        mine = place_round(who, sizes, comm.size)[comm.rank]
        layout = round_layout(plan, len(who), dtype)
        buf = layout.allocate(bdtype, server.x.device)
        sums = {s.name: layout.view(buf, f"sum:{s.name}") for s in ex.sums}
        flags, cmetrics = layout.view(buf, "nonfinite"), layout.view(buf, "metrics")
        sims, drift = layout.view(buf, "cka"), layout.view(buf, "drift")
        x_before = server.x
        evaluate_now = (rnd + 1) % plan.eval_every == 0 or rnd + 1 == stop
        probe = plan.similarity if evaluate_now else None
        if probe is not None:
            probe.set_reference(server.x)
        gathered: list[tuple[int, dict[str, Any]]] = []
        io = StateIO(states, mine)  # reads the next participant's state while this one trains
        # 2. local updates of this rank's participants (one by one or in vectorised groups), added
        #    into the one buffer
        outcomes = executor.run(
            algo,
            server,
            plan.trainer,
            mine,
            io.get,
            plan.data,
            functools.partial(_client_context, plan, rnd, tuple(who)),
        )
        diverged = []
        for k, upload, new_state in outcomes:
            i = position[k]
            if upload is None:
                flags[i] = 1.0
                diverged.append(k)
                continue
            io.put(k, new_state)
            _accumulate(upload, sums, ex, bdtype)
            layout.view(buf, "weight").add_(upload.weight)
            layout.view(buf, "count").add_(1.0)
            for j, name in enumerate(plan.client_metrics):
                cmetrics[i * len(plan.client_metrics) + j] = float(upload.metrics.get(name, 0.0))
            if ex.gathers:
                gathered.append((i, {g: upload.gathered[g] for g in ex.gathers}))
            if probe is not None:
                probe.record(k, upload.sums["x"], sims)
            if plan.drift is not None:
                plan.drift.record(
                    upload.sums["x"][: algo.num_params], server.x[: algo.num_params], upload.weight, drift
                )
        state_io = io.finish()
        for k in diverged:  # a NaN right after reading a state: check that state first
            if not _finite(states.get(k)):
                flags[position[k]] = 2.0
        t1 = time.perf_counter()
        layout.view(buf, "rank_compute")[comm.rank] = t1 - t0
        layout.view(buf, "rank_state_io")[comm.rank] = state_io
        layout.view(buf, "rank_rss")[comm.rank] = peak_rss_mb()
        # 3. one allreduce per round (and one allgather when the algorithm gathers)
        comm.allreduce(buf)
        everything = sorted(p for part in comm.allgather(gathered) for p in part) if ex.gathers else []
        t2 = time.perf_counter()
        bad = [who[i] for i in torch.nonzero(flags).flatten().tolist()]
        for k in set(who) - set(mine):
            states.written_elsewhere(k)
        damaged = [who[i] for i in torch.nonzero(flags > 1.5).flatten().tolist()]
        if damaged:
            raise DivergenceError(
                f"loss became NaN/inf in round {round_offset + rnd + 1} on client {damaged[0]}, whose stored "
                f"state already held NaN/inf when it was read (clients {','.join(map(str, damaged))}): the "
                f"state is damaged, not the learning rate; resume with --reset-client-states "
                f"{','.join(map(str, damaged))} to re-initialise it"
            )
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise DivergenceError(
                f"loss became NaN/inf in round {round_offset + rnd + 1} on client {bad[0]}{more}; "
                f"lower the learning rate{plan.lr_hint}"
            )
        # 4. the same server update on every rank
        aggregate = Aggregate(
            sums={s.name: sums[s.name].to(s.dtype) for s in ex.sums},
            weight=float(layout.view(buf, "weight")),
            count=int(layout.view(buf, "count")),
            gathered={g: [obj[g] for _, obj in everything] for g in ex.gathers},
        )
        sctx = ServerContext(rnd, tuple(who), plan.population, comm.allreduce, comm.rank, comm.size)
        server, server_metrics = algo.server_update(server, aggregate, sctx)
        done = rnd + 1
        # 5. evaluation, sharded over ranks
        row = None
        if evaluate_now:
            row = {"round": round_offset + done, "stage": stage, **plan.evaluate(server)}
            row.update(_client_metrics(plan.client_metrics, cmetrics, len(who)))
            row.update(server_metrics)
            if len(who) < plan.population.size:
                row["participants"] = list(who)
            if probe is not None:
                row.update(probe.row(sims))
            if plan.drift is not None:
                P = algo.num_params
                row.update(plan.drift.row(drift, sums["x"][:P], aggregate.weight, x_before[:P]))
            t3 = time.perf_counter()
            per_rank = layout.view(buf, "rank_compute").to(torch.float64)
            row.update(
                imbalance=float(per_rank.max() / per_rank.mean()) if float(per_rank.mean()) > 0 else 1.0,
                state_io_s=float(layout.view(buf, "rank_state_io").max()),
                peak_rss_mb=float(layout.view(buf, "rank_rss").max()),
            )
            gathered_bytes = sum(_nbytes(obj) for _, obj in everything)
            row.update(
                bytes_up=len(who) * upload_bytes + gathered_bytes,
                bytes_down=len(who) * _state_nbytes(server),
                allreduce_bytes=layout.nbytes(bdtype),
                seconds=t3 - t0,
                compute_s=t1 - t0,
                allreduce_s=t2 - t1,
                eval_s=t3 - t2,
            )
        # 6. bookkeeping (metrics, checkpoint, progress) lives in the hook
        if hook is not None and hook(done, server, states, row):
            return server, done
    return server, done


def _finite(state: ClientState) -> bool:
    """True when every tensor of a client state is finite (None fields count as finite)."""
    return all(
        bool(torch.isfinite(v).all())
        for f in fields(state)
        if isinstance(v := getattr(state, f.name), torch.Tensor) and v.is_floating_point()
    )


def _client_context(plan: RoundPlan, rnd: int, who: tuple[int, ...], k: int) -> ClientContext:
    return ClientContext(rnd, who, plan.population, plan.trainer, plan.generator(rnd, k))


def _accumulate(upload: Upload, sums: dict[str, torch.Tensor], ex: Any, bdtype: torch.dtype) -> None:
    for spec in ex.sums:
        vec = upload.sums[spec.name]
        if vec.dtype != bdtype:
            vec = vec.to(bdtype)
        if spec.weighted:
            sums[spec.name].add_(vec, alpha=upload.weight)
        else:
            sums[spec.name].add_(vec)


def _client_metrics(names: tuple[str, ...], values: torch.Tensor, count: int) -> dict[str, float]:
    """Mean, min and max of each client metric over the round's participants."""
    table = values.view(count, len(names)).to(torch.float64)
    out: dict[str, float] = {}
    for j, name in enumerate(names):
        col = table[:, j]
        key = "local_loss" if name == "loss" else f"client_{name}"
        out[key] = float(col.mean())
        out[f"{key}_min"] = float(col.min())
        out[f"{key}_max"] = float(col.max())
    return out
