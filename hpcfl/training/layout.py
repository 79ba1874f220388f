"""Named slices of a flat state vector, by module: what masks such as "the last three Linear layers"
are made of.

A :class:`StateLayout` lists, in vector order, every parameter and float buffer of a model with its
offset. It is read off the model once (the same order :class:`~hpcfl.training.flat.FlatModel` packs
them in) and lets an algorithm say *which part* of the state it treats differently (FedPVR's
variance-reduced layers) without ever touching the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hpcfl.errors import ConfigError
from hpcfl.errors import suggest as _suggest


@dataclass(frozen=True)
class Entry:
    """One tensor of the state: ``name`` (e.g. ``classifier.weight``), its module and its slice."""

    name: str
    module: str
    kind: str  # "param" | "buffer"
    module_type: str  # class name of the owning module, e.g. "Linear"
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class StateLayout:
    """Every entry of a flat state vector: trainable parameters first, then float buffers."""

    entries: tuple[Entry, ...]
    num_params: int
    size: int

    @classmethod
    def of_model(cls, model: nn.Module) -> StateLayout:
        """The layout :class:`~hpcfl.training.flat.FlatModel` gives ``model``."""
        owner = {
            id(p): (m_name, type(m).__name__)
            for m_name, m in model.named_modules()
            for p in m.parameters(recurse=False)
        }
        entries: list[Entry] = []
        off = 0
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            module, mtype = owner[id(p)]
            entries.append(Entry(name, module, "param", mtype, off, off + p.numel()))
            off += p.numel()
        num_params = off
        for m_name, m in model.named_modules():
            for b_name, buf in m.named_buffers(recurse=False):
                if buf is None or not buf.is_floating_point():
                    continue
                full = f"{m_name}.{b_name}" if m_name else b_name
                entries.append(Entry(full, m_name, "buffer", type(m).__name__, off, off + buf.numel()))
                off += buf.numel()
        return cls(tuple(entries), num_params, off)

    @classmethod
    def vector(cls, size: int, name: str = "w") -> StateLayout:
        """A layout of one trainable vector (models that are not modules: TCT's stage-2 W)."""
        return cls((Entry(name, name, "param", "Vector", 0, size),), size, size)

    @property
    def modules(self) -> list[str]:
        """Names of the modules that own trainable parameters, in vector order."""
        seen: dict[str, None] = {}
        for e in self.entries:
            if e.kind == "param":
                seen.setdefault(e.module, None)
        return list(seen)

    def params_of(self, modules: Iterable[str]) -> list[Entry]:
        """The trainable entries of the named modules (a name also selects its sub-modules)."""
        wanted = list(modules)
        known = self.modules
        for m in wanted:
            if not any(k == m or k.startswith(m + ".") for k in known):
                raise ConfigError(
                    f"unknown module {m!r}{_suggest(m, known)}; modules with parameters: {', '.join(known)}"
                )
        return [
            e
            for e in self.entries
            if e.kind == "param" and any(e.module == m or e.module.startswith(m + ".") for m in wanted)
        ]

    def last_modules(self, count: int, module_type: str | None = None) -> list[str]:
        """The last ``count`` parameter-owning modules (of ``module_type`` when given, e.g. "Linear")."""
        order = [m for m in self.modules if module_type is None or self._type(m) == module_type]
        return order[-count:] if count > 0 else []

    def _type(self, module: str) -> str:
        return next(e.module_type for e in self.entries if e.module == module)

    def mask(self, entries: Sequence[Entry], *, device: torch.device | str = "cpu") -> torch.Tensor:
        """A boolean mask over the trainable parameters selecting ``entries``."""
        out = torch.zeros(self.num_params, dtype=torch.bool, device=device)
        for e in entries:
            out[e.start : e.stop] = True
        return out
