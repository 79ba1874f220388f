"""Round observers: the metrics of the round loop, kept out of its protocol.

The loop (:func:`hpcfl.runner.rounds.run_rounds`) carries out the protocol the bit-identity
guarantees rest on; everything it MEASURES is an :class:`Observer`. An observer declares

- its **channels**: segments of the round's one allreduced buffer (:class:`Channel`), so the values
  of clients trained on other ranks arrive with the allreduce the round does anyway;
- its **columns**: the keys it adds to a metrics row (and a ``group`` a logger files them under,
  e.g. ``comm/bytes_up``);

and answers five hooks, each with values, never by touching the loop's state:

1. :meth:`Observer.start` when a round begins (CKA keeps the global model's Grams);
2. :meth:`Observer.client` after each of this rank's participants trained: values for its channels
   (the loop writes them into this client's slot, or adds them for a per-round channel);
3. :meth:`Observer.local_done` when this rank's local work is done: values for per-rank channels;
4. :meth:`Observer.eval_counts` in a round that writes a metrics row, after the allreduce and the
   server step: this rank's share of values the evaluation sums in its ONE allreduce
   (:class:`~hpcfl.training.evaluate.JointCounts`);
5. :meth:`Observer.row` then, after the evaluation: the columns, from the summed channels and
   counts.

Observers never change a round's results (the buffer's declared sums, the server state, what is
checkpointed): a metric is added or removed without changing a bit of the trajectory. What must
change results (client-level DP's clipping and noise, issue 29) belongs to the algorithm's steps
instead. :meth:`Observer.row` runs on every rank in the same order, so an observer may use
collectives there, though an evaluation's counts belong in :meth:`Observer.eval_counts`, so the round
evaluates with one allreduce; per-client evaluation (issue 28) is such an observer. Rows go to
``metrics.jsonl`` through the loop's hook (rank 0 writes them), which is where loggers of those rows
belong.

The observer types (:class:`Observer`, :class:`Channel`, :class:`RoundStart`, :class:`LocalWork`,
:class:`RoundEnd`) are part of the stage contract (:mod:`hpcfl.algorithms.stage_types`), because a
:class:`~hpcfl.algorithms.stage_types.RoundPlan` carries them; this module holds the standard
observers and the loop's side of the hooks. A new metric is an observer added to
:attr:`RoundPlan.observers <hpcfl.algorithms.stage_types.RoundPlan>`; the loop does not change.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Mapping, Sequence
from dataclasses import fields, is_dataclass
from typing import Any

import torch

from hpcfl.algorithms.base import Upload
from hpcfl.algorithms.stage_types import (
    EVAL_SLOT,
    Channel,
    LocalWork,
    Observer,
    RoundEnd,
    RoundStart,
    Value,
)
from hpcfl.metrics.drift import DriftDiversity
from hpcfl.metrics.similarity import LayerSimilarity
from hpcfl.runner.buffer import BufferLayout
from hpcfl.training.evaluate import JointCounts


def observer_segments(
    observers: Sequence[Observer], participants: int, clients: int, ranks: int
) -> list[tuple[str, int]]:
    """The buffer segments of ``observers``' channels, in order."""
    return [(ch.name, ch.length(participants, clients, ranks)) for obs in observers for ch in obs.channels()]


class RoundWatch:
    """The observers of one round: their hooks called in order, their values placed in the buffer."""

    def __init__(
        self,
        observers: Sequence[Observer],
        start: RoundStart,
        layout: BufferLayout,
        buf: torch.Tensor,
        rank: int,
    ) -> None:
        self.observers, self.start, self.rank = observers, start, rank
        self._counts: dict[int, torch.Tensor] = {}
        self._channels = {ch.name: ch for obs in observers for ch in obs.channels()}
        self._views = {name: layout.view(buf, name) for name in self._channels}
        for obs in observers:
            obs.start(start)

    def client(self, k: int, upload: Upload) -> None:
        for obs in self.observers:
            self._place(obs.client(self.start, k, upload), k)

    def local_done(self, work: LocalWork) -> None:
        for obs in self.observers:
            self._place(obs.local_done(work), None)

    def eval_counts(self, end: RoundEnd) -> JointCounts:
        """The observers' shares of the evaluation's one allreduce (:meth:`Observer.eval_counts`)."""
        self._counts = {
            i: c for i, obs in enumerate(self.observers) if (c := obs.eval_counts(end)) is not None
        }
        return JointCounts(list(self._counts.values()))

    def row(self, end: RoundEnd) -> dict[str, Any]:
        """The observers' columns, after the evaluation summed their :meth:`eval_counts`."""
        out: dict[str, Any] = {}
        for i, obs in enumerate(self.observers):
            slots = {ch.name: self._views[ch.name] for ch in obs.channels()}
            if i in self._counts:
                slots[EVAL_SLOT] = self._counts[i]
            out.update(obs.row(end, slots))
        return out

    def _place(self, values: Mapping[str, Value], k: int | None) -> None:
        for name, value in values.items():
            ch, view = self._channels[name], self._views[name]
            if ch.per == "round":
                addend, scale = value if isinstance(value, tuple) else (value, 1.0)
                view.add_(addend.to(view.dtype) if isinstance(addend, torch.Tensor) else addend, alpha=scale)
                continue
            if ch.per == "rank":
                slot = self.rank
            elif k is None:
                raise ValueError(
                    f"channel {name!r} has a slot per {ch.per}: fill it in client(), not local_done()"
                )
            else:
                slot = self.start.position[k] if ch.per == "participant" else k
            view[slot * ch.width : (slot + 1) * ch.width] = (
                value  # a float is written as is (no float32 detour)
            )


# -- the standard observers: every metrics row has their columns ---------------------------------


class ClientMetrics(Observer):
    """Mean, min and max over the round's participants of each metric their local update reported
    (``loss`` → ``local_loss``, any other ``m`` → ``client_m``); one slot per participant."""

    group = "train"

    def __init__(self, names: tuple[str, ...] = ("loss",)) -> None:
        self.names = names
        keys = ["local_loss" if n == "loss" else f"client_{n}" for n in names]
        self.columns = tuple(c for key in keys for c in (key, f"{key}_min", f"{key}_max"))

    def channels(self) -> tuple[Channel, ...]:
        return (Channel("metrics", len(self.names), "participant"),)

    def client(self, start: RoundStart, k: int, upload: Upload) -> dict[str, Value]:
        values = [float(upload.metrics.get(n, 0.0)) for n in self.names]
        return {"metrics": torch.tensor(values, dtype=torch.float64)}  # host: per-client floats

    def row(self, end: RoundEnd, slots: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        table = slots["metrics"].view(len(end.work.start.who), len(self.names)).to(torch.float64)
        out: dict[str, float] = {}
        if not len(end.work.start.who):  # a Poisson-sampled round (client-level DP) may have none
            return out
        for j, key in enumerate(self.columns[::3]):
            col = table[:, j]
            out[key] = float(col.mean())
            out[f"{key}_min"] = float(col.min())
            out[f"{key}_max"] = float(col.max())
        return out


class ServerMetrics(Observer):
    """What the algorithm's server update reported (FedAdam's ``pseudo_grad_norm``, FedNova's
    ``tau_eff``, ...): its columns are named by the algorithm, so none are declared here."""

    group = "server"

    def row(self, end: RoundEnd, slots: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return dict(end.server_metrics)


class Participants(Observer):
    """Who trained, when not everyone did."""

    group = "train"
    columns = ("participants",)

    def row(self, end: RoundEnd, slots: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        start = end.work.start
        return {"participants": list(start.who)} if len(start.who) < start.population.size else {}


class SystemRecord(Observer):
    """Under a ``system`` section: the local steps each participant that arrived took
    (``work_steps``, in the order of ``participants``), the round's stragglers and the participants
    that dropped out (ids). Every rank drew the same, so nothing is exchanged."""

    group = "system"
    columns = ("work_steps", "stragglers", "dropped")

    def row(self, end: RoundEnd, slots: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        start = end.work.start
        if start.system is None:
            return {}
        return {
            "work_steps": [start.system.steps[k] for k in start.who],
            "stragglers": list(start.system.stragglers),
            "dropped": list(start.dropped),
        }


class RankLoad(Observer):
    """Load imbalance (max/mean of the ranks' compute seconds), the longest client-state I/O wait and
    the largest peak memory over ranks; one slot per rank, so no extra collective."""

    group = "system"
    columns = ("imbalance", "state_io_s", "peak_rss_mb")

    def channels(self) -> tuple[Channel, ...]:
        return (
            Channel("rank_compute", 1, "rank"),
            Channel("rank_state_io", 1, "rank"),
            Channel("rank_rss", 1, "rank"),
        )

    def local_done(self, work: LocalWork) -> dict[str, Value]:
        return {
            "rank_compute": work.trained - work.start.started,
            "rank_state_io": work.state_io_s,
            "rank_rss": peak_rss_mb(),
        }

    def row(self, end: RoundEnd, slots: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        per_rank = slots["rank_compute"].to(torch.float64)
        return {
            "imbalance": float(per_rank.max() / per_rank.mean()) if float(per_rank.mean()) > 0 else 1.0,
            "state_io_s": float(slots["rank_state_io"].max()),
            "peak_rss_mb": float(slots["rank_rss"].max()),
        }


class Traffic(Observer):
    """Bytes a round moves, counted from what is exchanged: up (every participant's declared sums
    plus its gathered objects), down (per participant, the server state but its ``server_only``
    fields, and of a field the exchange declares ``received`` only that part:
    :meth:`~hpcfl.algorithms.base.Exchange.download_nbytes`) and the allreduced buffer."""

    group = "comm"
    columns = ("bytes_up", "bytes_down", "allreduce_bytes")

    def row(self, end: RoundEnd, slots: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        start = end.work.start
        n = len(start.who)  # the uploads that arrived; a dropped participant had downloaded the state
        return {
            "bytes_up": n * end.upload_bytes + _nbytes(end.aggregate.gathered),
            "bytes_down": (n + len(start.dropped)) * end.download_bytes,
            "allreduce_bytes": end.buffer_bytes,
        }


class Timing(Observer):
    """Wall seconds of the round and of its phases on this rank: local work, allreduce (with the wait
    for the slowest rank), and the rest (server update, evaluation, the other observers' rows)."""

    group = "time"
    columns = ("seconds", "compute_s", "allreduce_s", "eval_s")

    def row(self, end: RoundEnd, slots: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        now, work = time.perf_counter(), end.work
        return {
            "seconds": now - work.start.started,
            "compute_s": work.trained - work.start.started,
            "allreduce_s": end.reduced - work.trained,
            "eval_s": now - end.reduced,
        }


def with_standard_observers(
    chosen: Sequence[Observer],
    client_metrics: tuple[str, ...] = ("loss",),
    *,
    system: bool = False,
    clock: Observer | None = None,
) -> tuple[Observer, ...]:
    """The observers of a round, in the order their columns appear in a row: the client metrics, the
    server's, who participated (and, with ``system``, the work and dropouts; with ``clock``, the
    simulated time: :class:`hpcfl.runner.asynchronous.ClockRecord`), the ``chosen`` ones
    (CKA, drift diversity, ...), then per-rank load,
    traffic and timing (last, so that its seconds include every other observer's work)."""
    return (
        ClientMetrics(client_metrics),
        ServerMetrics(),
        Participants(),
        *((SystemRecord(),) if system else ()),
        *((clock,) if clock is not None else ()),
        *chosen,
        RankLoad(),
        Traffic(),
        Timing(),
    )


# -- observers a config chooses ------------------------------------------------------------------


class LayerCKA(Observer):
    """Per-layer CKA of every participant's model against the global one (``cka_metrics: true``;
    :mod:`hpcfl.metrics.similarity`), in rounds that write a row; one slot per client."""

    group = "representation"
    columns = ("cka",)

    def __init__(self, similarity: LayerSimilarity) -> None:
        self.similarity = similarity
        self._active = False

    def channels(self) -> tuple[Channel, ...]:
        return (Channel("cka", len(self.similarity.layers), "client"),)

    def start(self, start: RoundStart) -> None:
        self._active = start.writes_row
        if self._active:
            self.similarity.set_reference(start.server.x)

    def client(self, start: RoundStart, k: int, upload: Upload) -> dict[str, Value]:
        return {"cka": self.similarity.values(upload.sums["x"])} if self._active else {}

    def row(self, end: RoundEnd, slots: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return self.similarity.row(slots["cka"])


class Drift(Observer):
    """Per-layer drift diversity of the participants' updates (``drift_diversity: true``;
    :mod:`hpcfl.metrics.drift`): one per-round channel of L weighted squared norms."""

    group = "representation"
    columns = ("drift_diversity",)

    def __init__(self, drift: DriftDiversity, num_params: int) -> None:
        self.drift, self.num_params = drift, num_params

    def channels(self) -> tuple[Channel, ...]:
        return (Channel("drift", self.drift.size),)

    def client(self, start: RoundStart, k: int, upload: Upload) -> dict[str, Value]:
        P = self.num_params
        squares = self.drift.squares(upload.sums["x"][:P], start.server.x[:P])
        return {"drift": (squares, upload.weight * upload.weight)}

    def row(self, end: RoundEnd, slots: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        P = self.num_params
        x_before = end.work.start.server.x[:P]
        return self.drift.row(slots["drift"], end.sums["x"][:P], end.aggregate.weight, x_before)


# -- helpers ---------------------------------------------------------------------------------------


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
