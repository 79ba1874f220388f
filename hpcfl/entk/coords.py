"""Which coordinates of ∂f/∂θ an eNTK feature keeps, and where each parameter's land.

**Index space.** P is the number of elements of the parameters in scope, concatenated in
``model.parameters()`` order, each flattened row-major (``param.flatten()``), exactly as
Algorithm 3 of the TCT paper concatenates ``param.grad.flatten()``:

- ``params="all"``: every parameter of ``model.parameters()`` — with or without
  ``requires_grad`` (the gradient is taken w.r.t. all of them; the paper's models train them all).
- ``params="features"``: the same list **minus the weight and bias of the last layer**
  (``hpcfl.models.last_linear(model)``, the classifier TCT replaces by a fresh head), i.e. ∇_φ of
  Section 4.1 / Appendix A, where θ = φ ∘ ω. For every model of :mod:`hpcfl.models` the
  classifier's parameters are the last two of ``model.parameters()``, so this index space is a
  prefix of the ``"all"`` one.

**Coordinate set.** ``torch.randperm(P)[:p]`` drawn after ``torch.manual_seed(seed)`` — the paper's
choice — reproduced with a private ``torch.Generator().manual_seed(seed)`` (same permutation on CPU,
global RNG untouched), then **sorted**. Columns of the feature matrix follow the sorted order, not
the draw order: a fixed permutation of the features changes nothing downstream (standardisation is
per feature, and the linear model of stage 2 just permutes its weights accordingly), while sorted
coordinates make each parameter's columns one contiguous slice and let the fast path compute them
layer by layer. ``p = P`` keeps every coordinate (the full eNTK, columns in parameter order).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from hpcfl.errors import ConfigError, unknown

ParamScope = Literal["all", "features"]
PARAM_SCOPES: tuple[str, ...] = ("all", "features")


def scope_parameters(model: nn.Module, params: str = "all") -> list[tuple[str, nn.Parameter]]:
    """The (name, parameter) pairs spanning the index space, in ``model.parameters()`` order."""
    named = list(model.named_parameters())
    if params == "all":
        return named
    if params == "features":
        from hpcfl.models import last_linear

        head = {id(t) for t in last_linear(model).parameters(recurse=False)}
        return [(name, t) for name, t in named if id(t) not in head]
    raise unknown("eNTK parameter scope", params, PARAM_SCOPES)


def num_params(model: nn.Module, params: str = "all") -> int:
    """P: the number of coordinates of the index space (see the module docstring)."""
    return sum(t.numel() for _, t in scope_parameters(model, params))


def coordinate_set(num_params: int, p: int, seed: int) -> Tensor:
    """The p kept coordinates out of ``num_params``, sorted ascending → LongTensor (p,), on CPU.

    Equal, as a set, to ``torch.manual_seed(seed); torch.randperm(num_params)[:p]`` (TCT,
    Algorithm 3), without touching the global RNG.

    Raises:
        ConfigError: ``p`` is not in ``1..num_params``.
    """
    if not 1 <= p <= num_params:
        raise ConfigError(
            f"eNTK feature dimension p={p} must be between 1 and the parameter count {num_params}"
        )
    gen = torch.Generator().manual_seed(int(seed))
    # host: a seeded subset, moved by its user
    return torch.randperm(num_params, generator=gen)[:p].sort().values  # (p,)


def coords_hash(coords: Tensor) -> str:
    """sha256 of the coordinate set as little-endian int64 (what the feature store records)."""
    data = coords.detach().to("cpu", torch.int64).contiguous().numpy().astype("<i8").tobytes()
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ParamColumns:
    """The output columns ``[col0, col1)`` of one parameter and its kept flat indices ``local``."""

    name: str
    col0: int
    col1: int
    local: Tensor  # (col1 - col0,) sorted indices into param.flatten()
    numel: int

    @property
    def n(self) -> int:
        """Number of kept coordinates of this parameter."""
        return self.col1 - self.col0

    @property
    def full(self) -> bool:
        """Whether every coordinate of the parameter is kept (columns = the whole flat gradient)."""
        return self.n == self.numel


def param_columns(named: list[tuple[str, nn.Parameter]], coords: Tensor) -> list[ParamColumns]:
    """Split sorted ``coords`` into per-parameter column slices (one entry per parameter)."""
    sizes = torch.tensor([t.numel() for _, t in named], dtype=torch.int64)  # host: index bookkeeping
    ends = torch.cumsum(sizes, 0)  # (K,)
    starts = ends - sizes
    cuts = torch.searchsorted(coords, torch.cat([starts[:1], ends])).tolist()  # (K+1,)
    result = []
    for k, (name, t) in enumerate(named):
        c0, c1 = cuts[k], cuts[k + 1]
        result.append(ParamColumns(name, c0, c1, coords[c0:c1] - int(starts[k]), t.numel()))
    return result
