"""How this machine computes eNTK features and Jacobians: the ``entk:`` config section, the
environment variables that override it, and the effective values a run uses and records.

Three settings change the eNTK path's implementation, never its mathematics, but two of them can
move results in the last bits, so they belong in the config and in the run's record (docs/determinism.md):

- ``costs`` (``$HPCFL_ENTK_COSTS``): a JSON file of fitted layer-form constants
  (``benchmarks/entk_layer_costs.py``) replacing the built-in ones for its device type
  (:mod:`hpcfl.entk.costs`). They choose each Linear/Conv2d weight's form, and the forms round
  differently, so TCT's stage 2 depends on them;
- ``cuda_graph`` (``$HPCFL_ENTK_CUDA_GRAPH``): replay the fused path's full batches as CUDA graphs
  (:mod:`hpcfl.entk.cuda_graph`; the same kernels, checked against the eager batch; a no-op on the
  CPU);
- ``triton_autotune`` (``$HPCFL_TRITON_AUTOTUNE``): launch the Triton gathers through
  ``triton.autotune`` (tile sizes chosen per shape by timing; a conv gather's tile sets its
  reduction order) instead of their fixed tiles;
- ``native`` (``$HPCFL_ENTK_NATIVE``, on by default): on the CPU, form the kept per-sample gradient
  coordinates of Linear and Conv2d weights with the compiled AVX-512 kernel of
  :mod:`hpcfl.entk.native` where this machine can build it (else the torch forms run). It sums
  a conv's terms in its own order, so the record also says whether the kernel was in use.

An environment variable that is set (non-empty) overrides the config key, so a job script can point
every run of a cluster at its GPU's fitted constants; the record names the source of each value.
A run resolves them once (:func:`resolve`), records them (:func:`record`) and holds them in force
while it runs (:func:`applied`, the one place that sets the process's eNTK switches, as ``threads``
sets torch's); outside a run (library calls, benchmarks) :func:`active` reads the environment.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcfl.entk.cost_file import fitted_file
from hpcfl.errors import ConfigError

COSTS_ENV = "HPCFL_ENTK_COSTS"
CUDA_GRAPH_ENV = "HPCFL_ENTK_CUDA_GRAPH"
AUTOTUNE_ENV = "HPCFL_TRITON_AUTOTUNE"
NATIVE_ENV = "HPCFL_ENTK_NATIVE"

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


@dataclass
class EntkSection:
    """``entk:``: how eNTK features (TCT stage 2) and Jacobians (NTK-FL) are computed on this
    machine; each key is overridden by its environment variable when that is set (module docstring).

    - ``costs``: path of a fitted layer-form constants file (``benchmarks/entk_layer_costs.py``'s
      JSON), or null for the built-in constants; made absolute where it enters;
    - ``cuda_graph``: replay the fused path's full batches as CUDA graphs (GPU only);
    - ``triton_autotune``: autotune the Triton gathers' tiles per shape (GPU only);
    - ``native``: use the compiled CPU kernel (:mod:`hpcfl.entk.native`) where it builds (CPU only).
    """

    costs: str | None = None
    cuda_graph: bool = False
    triton_autotune: bool = False
    native: bool = True

    def __post_init__(self) -> None:
        if self.costs is not None:
            if not str(self.costs).strip():
                raise ConfigError("config key 'entk.costs' must be a file path or null, got ''")
            self.costs = str(Path(self.costs).expanduser().resolve())
            fitted_file(self.costs, f"config key 'entk.costs' ({self.costs})")  # bad: one line at load


@dataclass(frozen=True)
class EntkSettings:
    """The effective eNTK settings of a run (config, then environment) and where each came from
    (``"config"`` or the variable's name); ``method``: the eNTK/Jacobian implementation the
    algorithm's params choose, None when the algorithm computes none."""

    costs: str | None = None
    cuda_graph: bool = False
    triton_autotune: bool = False
    native: bool = True
    costs_from: str = "config"
    cuda_graph_from: str = "config"
    triton_autotune_from: str = "config"
    native_from: str = "config"
    method: str | None = None


def parse_flag(name: str, value: str) -> bool:
    """An on/off environment variable: 1/true/yes/on or 0/false/no/off/empty, else one line."""
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r}: must be 1 or 0 (or true/false, yes/no, on/off)")


def resolve(
    section: EntkSection | None = None, *, method: str | None = None, env: Mapping[str, str] | None = None
) -> EntkSettings:
    """The effective settings: ``section``'s values, each replaced by its environment variable when
    that is set (non-empty). A bad flag value or costs file is one :class:`ConfigError` line."""
    section = section if section is not None else EntkSection()
    env = os.environ if env is None else env
    costs, costs_from = section.costs, "config"
    if env.get(COSTS_ENV):
        costs, costs_from = env[COSTS_ENV], COSTS_ENV
        fitted_file(costs, f"{COSTS_ENV}={costs}")
    flags: dict[str, tuple[bool, str]] = {}
    for key, name in (
        ("cuda_graph", CUDA_GRAPH_ENV),
        ("triton_autotune", AUTOTUNE_ENV),
        ("native", NATIVE_ENV),
    ):
        raw = env.get(name)
        flags[key] = (parse_flag(name, raw), name) if raw else (bool(getattr(section, key)), "config")
    return EntkSettings(
        costs=costs,
        cuda_graph=flags["cuda_graph"][0],
        triton_autotune=flags["triton_autotune"][0],
        native=flags["native"][0],
        costs_from=costs_from,
        cuda_graph_from=flags["cuda_graph"][1],
        triton_autotune_from=flags["triton_autotune"][1],
        native_from=flags["native"][1],
        method=method,
    )


def costs_label(settings: EntkSettings) -> str:
    """How an error names the costs file in force: ``HPCFL_ENTK_COSTS=PATH`` or the config key."""
    if settings.costs_from == COSTS_ENV:
        return f"{COSTS_ENV}={settings.costs}"
    return f"config key 'entk.costs' ({settings.costs})"


def record(settings: EntkSettings) -> dict[str, Any]:
    """The settings as ``determinism.json``'s ``entk`` entry: every effective value, its source and
    the method (the run's record adds whether the native CPU kernel was in use:
    :func:`hpcfl.entk.native.status`)."""
    return {
        "method": settings.method,
        "costs": settings.costs,
        "costs_from": settings.costs_from,
        "cuda_graph": settings.cuda_graph,
        "cuda_graph_from": settings.cuda_graph_from,
        "triton_autotune": settings.triton_autotune,
        "triton_autotune_from": settings.triton_autotune_from,
        "native": settings.native,
        "native_from": settings.native_from,
    }


_ACTIVE: EntkSettings | None = None


def active() -> EntkSettings:
    """The settings in force: the running run's (:func:`applied`), else the environment's alone."""
    return _ACTIVE if _ACTIVE is not None else resolve()


@contextmanager
def applied(settings: EntkSettings) -> Iterator[None]:
    """Hold ``settings`` in force for the eNTK code of this process (the cost constants and the
    CUDA-graph default read :func:`active`; the Triton gathers read ``triton_kernels._triton.AUTOTUNE``),
    restoring what was before on exit. The kernels are imported (~0.5 s) only when the run computes
    eNTK features or Jacobians or something already imported them."""
    global _ACTIVE
    before = _ACTIVE
    kernels = sys.modules.get("triton_kernels._triton")
    if kernels is None and settings.method is not None:
        import triton_kernels._triton as kernels
    tuned = getattr(kernels, "AUTOTUNE", None)
    _ACTIVE = settings
    if kernels is not None:
        kernels.AUTOTUNE = settings.triton_autotune
    try:
        yield
    finally:
        _ACTIVE = before
        if kernels is not None:
            kernels.AUTOTUNE = tuned
