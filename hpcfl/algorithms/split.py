"""A split of the state vector into a shared part and a part each client keeps: the common shape of
the personalised algorithms that exchange only some layers (FedBN's normalisation layers, FedPer's
and FedRep's head, FedBABU's frozen head).

A :class:`Split` is a set of :class:`~hpcfl.training.layout.Entry` slices of the flat state (read
off the :class:`~hpcfl.training.layout.StateLayout`, never off the model); it cuts a vector into its
kept part and its shared part (each the concatenation of its slices in vector order) and puts them
back, on whatever device the vector is on. :class:`SplitAlgorithm` is the frame those algorithms
share: the split built (and checked) before the first round, only the shared part exchanged and
uploaded, the server's mean of it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hpcfl.algorithms.base import (
    Aggregate,
    Algorithm,
    C,
    ClientData,
    Exchange,
    P,
    Received,
    ServerContext,
    ServerState,
    SumSpec,
    Upload,
    model_upload,
)
from hpcfl.algorithms.participation import Population
from hpcfl.errors import ConfigError
from hpcfl.training.layout import Entry, StateLayout
from hpcfl.training.sgd import LocalResult, LocalSchedule


def module_names(value: object, key: str) -> tuple[str, ...]:
    """A ``params`` value naming modules (one name or a list) as a tuple; one clear line otherwise."""
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, list | tuple) or not names or not all(isinstance(m, str) and m for m in names):
        raise ConfigError(f"config key 'params.{key}' must be a module name or a list of them, got {value!r}")
    return tuple(names)


def _ranges(
    entries: Sequence[Entry], size: int
) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """(kept, shared) as merged, sorted (start, stop) ranges covering ``0..size``."""
    kept: list[tuple[int, int]] = []
    for e in sorted(entries, key=lambda e: e.start):
        if kept and kept[-1][1] == e.start:
            kept[-1] = (kept[-1][0], e.stop)
        else:
            kept.append((e.start, e.stop))
    shared, at = [], 0
    for a, b in kept:
        if a > at:
            shared.append((at, a))
        at = b
    if at < size:
        shared.append((at, size))
    return tuple(kept), tuple(shared)


@dataclass(frozen=True)
class Split:
    """The slices a client keeps (``kept``) and those it shares (``shared``), as (start, stop)
    ranges of the state vector of length ``size``; ``kept_params`` counts the kept trainable
    entries (the kept slices below ``num_params``)."""

    kept: tuple[tuple[int, int], ...]
    shared: tuple[tuple[int, int], ...]
    size: int
    num_params: int

    @classmethod
    def of(cls, layout: StateLayout, entries: Sequence[Entry]) -> Split:
        kept, shared = _ranges(entries, layout.size)
        return cls(kept, shared, layout.size, layout.num_params)

    @property
    def kept_size(self) -> int:
        return sum(b - a for a, b in self.kept)

    @property
    def shared_size(self) -> int:
        return self.size - self.kept_size

    @staticmethod
    def _cut(x: torch.Tensor, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
        if not ranges:
            return x.new_empty(0)
        return torch.cat([x[a:b] for a, b in ranges])

    def kept_of(self, x: torch.Tensor) -> torch.Tensor:
        """The kept slices of state vector ``x``, concatenated (a fresh tensor)."""
        return self._cut(x, self.kept)

    def shared_of(self, x: torch.Tensor) -> torch.Tensor:
        """The shared slices of state vector ``x``, concatenated (a fresh tensor)."""
        return self._cut(x, self.shared)

    @staticmethod
    def _put(x: torch.Tensor, ranges: tuple[tuple[int, int], ...], values: torch.Tensor) -> None:
        at = 0
        for a, b in ranges:
            x[a:b] = values[at : at + b - a]
            at += b - a

    def with_kept(self, x: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
        """A copy of ``x`` whose kept slices are ``kept`` (``x`` itself copied when None)."""
        out = x.clone()
        if kept is not None:
            self._put(out, self.kept, kept)
        return out

    def with_shared(self, x: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """A copy of ``x`` whose shared slices are ``shared``."""
        out = x.clone()
        self._put(out, self.shared, shared)
        return out

    def exchange(self, dtype: torch.dtype = torch.float32) -> Exchange:
        """Only the shared part travels: uploaded (summed) and downloaded."""
        return Exchange(
            sums=(SumSpec("x", self.shared_size, dtype),), received=(Received("x", self.shared_size),)
        )

    def averaged(self, server: ServerState, aggregate: Aggregate) -> ServerState:
        """The server state with its shared part replaced by the participants' weighted mean (the
        kept part is the clients' own: the server's copy is only their starting point)."""
        shared = aggregate.sums["x"] / aggregate.weight
        return dataclasses.replace(server, x=self.with_shared(server.x, shared))

    def param_mask(self, like: torch.Tensor, *, kept: bool) -> torch.Tensor:
        """A 0/1 vector over the trainable parameters (dtype and device of ``like``): 1 on the kept
        slices (``kept=True``) or on the shared ones; a gradient multiplied by it trains only those."""
        mask = torch.zeros(self.num_params, dtype=like.dtype, device=like.device)
        for a, b in self.kept:
            mask[a : min(b, self.num_params)] = 1.0
        return mask if kept else 1.0 - mask


@dataclass(frozen=True)
class Freeze:
    """A local-step correction that trains only where ``mask`` is 1: the step direction (gradient,
    weight decay and any other correction already added) is multiplied by the 0/1 ``mask``, so the
    momentum buffer of a frozen entry stays 0 and the entry does not move (bit for bit)."""

    mask: torch.Tensor

    def __call__(self, w: torch.Tensor, d: torch.Tensor) -> None:
        d.mul_(self.mask)


def head_entries(layout: StateLayout, head: Sequence[str], algorithm: str) -> list[Entry]:
    """The trainable entries of the ``head`` modules; one clear line when they name no layer or
    every layer (a head that is the whole model leaves nothing to share)."""
    entries = layout.params_of(head)  # an unknown module is a ConfigError naming the known ones
    if not entries:
        raise ConfigError(f"algorithm {algorithm}: params.head {list(head)} names no layer with parameters")
    if sum(e.size for e in entries) >= layout.num_params:
        raise ConfigError(
            f"algorithm {algorithm}: params.head {list(head)} is the whole model; name the last layer(s) only "
            f"(modules: {', '.join(layout.modules)})"
        )
    return entries


class SplitAlgorithm(Algorithm[P, ServerState, C]):
    """An algorithm whose clients keep some slices of the state vector and share the rest (FedPer,
    FedRep, FedBABU, FedBN): a subclass names the kept slices (:meth:`kept_entries`); this class
    builds the :class:`Split`, exchanges only its shared part (uploaded and downloaded), uploads a
    trained state's shared part weighted by ``params.weighting`` and averages it on the server."""

    def kept_entries(self) -> Sequence[Entry]:
        """The layout entries whose slices each client keeps (a ConfigError when the params name a
        bad choice)."""
        raise NotImplementedError

    @functools.cached_property
    def split(self) -> Split:
        """The kept slices and the shared rest; built on first use (the layout is then real), and by
        :meth:`resolved` before the first round, so a bad choice fails up front."""
        return Split.of(self.layout, self.kept_entries())

    def resolved(
        self, population: Population, schedule: LocalSchedule, *, heterogeneous: bool = False
    ) -> SplitAlgorithm[P, C]:
        self.split  # noqa: B018 - refuses a bad choice of kept layers before any round
        return self

    def exchange(self, dtype: torch.dtype = torch.float32) -> Exchange:
        """The shared part: the state vector without the kept slices."""
        return self.split.exchange(dtype)

    def shared_upload(self, y: torch.Tensor, data: ClientData, result: LocalResult) -> Upload:
        """The upload of trained state ``y``: its shared part, weighted by ``params.weighting``."""
        return model_upload(self.split.shared_of(y), data, result, weighting=self.params.weighting)  # type: ignore[attr-defined]

    def server_update(
        self, server: ServerState, aggregate: Aggregate, ctx: ServerContext
    ) -> tuple[ServerState, dict[str, float]]:
        return self.split.averaged(server, aggregate), {}
