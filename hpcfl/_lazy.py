"""Packages whose public names load on first use, so that importing them stays light.

``hpcfl status`` and ``hpcfl report`` only read files, yet every ``hpcfl.*`` import runs the
``__init__`` of the packages above it; when those re-export eagerly, reading a run directory imports
torch and zarr (1.6 s and 312 MB on a login node). A package calls :func:`lazy_exports` instead of
its ``from ... import ...`` lines: a name's module is imported the first time the name is read
(PEP 562 semantics), and ``from pkg import name`` keeps working.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Mapping, Sequence
from typing import Any


class _LazyModule(types.ModuleType):
    """A package module whose exported names resolve on first access."""

    def __getattr__(self, name: str) -> Any:  # only called when normal lookup fails
        source = self.__dict__["_lazy_sources"].get(name)
        if source is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        self.__dict__[name] = value  # later reads are plain attribute lookups
        return value

    def __dir__(self) -> list[str]:
        return sorted({*self.__dict__, *self.__dict__["_lazy_sources"]})

    def __setattr__(self, name: str, value: Any) -> None:
        # Importing a submodule binds it on its package; where an exported name equals a submodule's
        # name (``hpcfl.data.partition``, the function and its module), the exported name wins, as
        # it did when the package re-exported eagerly.
        if isinstance(value, types.ModuleType) and name in self.__dict__["_lazy_sources"]:
            return
        super().__setattr__(name, value)


def lazy_exports(package: str, exports: Mapping[str, Sequence[str]]) -> None:
    """Make ``package`` (an already executing ``__init__``) resolve ``exports`` lazily.

    ``exports`` maps a module to the names read from it, e.g. ``{"hpcfl.comm.local": ["LocalComm"]}``.
    """
    module = sys.modules[package]
    sources = {name: source for source, names in exports.items() for name in names}
    module.__dict__["_lazy_sources"] = sources
    module.__class__ = _LazyModule
