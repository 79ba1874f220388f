"""CP-NTK-FL (Yue et al., ICML 2022, Section 4.2 and Figure 2): NTK-FL with communication-efficient
and private uploads. Each tool is optional and they combine freely:

- data subsampling: participant m keeps a uniform subset B_m of ⌈β·N_m⌉ samples (its round
  generator draws it, so the choice is the same on any number of ranks and after a resume);
- input random projection Z = XP, P ∈ ℝ^{d₁×d₁′} Gaussian from ``projection_seed`` (the trusted key
  server's seed ρ, the same for all clients): the model's first layer takes d₁′ inputs, and the
  clients' and the test set's inputs are projected before anything sees them
  (:mod:`hpcfl.ntk.stage`). The entries are N(0, 1/d₁′) rather than the paper's N(0, 1): the scale
  keeps ‖z‖ ≈ ‖x‖ (Johnson-Lindenstrauss), so the unprojected model's η still applies, and a
  scalar factor carries no information;
- top-k sparsification: each participant keeps the ``keep`` fraction of its Jacobian's entries of
  largest magnitude and uploads them as (flat int32/int64 indices, values) — ``bytes_up`` counts
  that encoding;
- shuffling: the (J, f, Y) rows of all participants are permuted together (the shuffling server),
  by a generator of (``shuffle_seed``, round); the update Σ_j J_:j:ᵀ R_:j is a sum over rows, so it
  is invariant to the permutation up to floating-point summation order (tested).

β = 1, no projection, keep = 1 and no shuffling is NTK-FL bit for bit (tested). The defaults are the
paper's Table 1 setting (β = 0.3, d₁′ = 200) with 90 % sparsity (Appendix B: "above 80%-90%").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hpcfl.algorithms.base import Aggregate, ClientContext, ClientData, ServerContext
from hpcfl.algorithms.ntkfl import NTKFL, NTKFLParams
from hpcfl.entk.jacobian import FactoredJacobian
from hpcfl.errors import ConfigError
from hpcfl.ntk.evolution import Jacobian, Rows
from hpcfl.training.seeds import seeded_generator


@dataclass(frozen=True)
class CPNTKFLParams(NTKFLParams):
    """CP-NTK-FL's tools on top of NTK-FL's evolution (Yue et al., ICML 2022, Section 4.2).

    - ``beta`` β ∈ (0, 1]: per-client sampling rate (Figure 6 sweeps 0.2-0.7; Table 1: 0.3);
    - ``projection_dim`` d₁′: input random projection dimension, 0 = none (Figure 6: 100-600;
      Table 1: 200); needs a model on flat inputs (``mlp``);
    - ``projection_seed`` ρ: the seed shared by all clients for P;
    - ``keep`` ∈ (0, 1]: fraction of Jacobian entries kept by top-k (1 = dense upload);
    - ``shuffle``: permute the rows of all participants before the kernel (the shuffling server);
    - ``shuffle_seed``: seed of the permutations (one per round).
    """

    beta: float = 0.3
    projection_dim: int = 200
    projection_seed: int = 0
    keep: float = 0.1
    shuffle: bool = True
    shuffle_seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.beta <= 1:
            raise ConfigError(f"config key 'params.beta' must be in (0, 1], got {self.beta}")
        if self.projection_dim < 0:
            raise ConfigError(
                f"config key 'params.projection_dim' must be >= 0 (0: none), got {self.projection_dim}"
            )
        if not 0 < self.keep <= 1:
            raise ConfigError(f"config key 'params.keep' must be in (0, 1], got {self.keep}")
        if self.keep < 1 and self.upload == "factored":
            raise ConfigError(
                "config key 'params.upload: factored' cannot be sparsified: set params.keep: 1 or params.upload: auto"
            )


def sparsify(J: Tensor, keep: float) -> dict[str, Any]:
    """Top-k of |J| as {"index": flat indices, "value": values, "shape": J's shape}; indices int32
    when J has fewer than 2³¹ entries."""
    flat = J.reshape(-1)
    k = max(1, math.ceil(keep * flat.numel()))
    # the k-th largest magnitude as a threshold (kthvalue is ~1.7x faster than topk at this size);
    # ties at the threshold are filled in index order, so exactly k entries are kept
    a = flat.abs()
    threshold = torch.kthvalue(a, a.numel() - k + 1).values
    above = torch.nonzero(a > threshold).squeeze(1)
    tied = torch.nonzero(a == threshold).squeeze(1)[: k - above.numel()]
    index = torch.cat([above, tied]).sort().values
    itype = torch.int32 if flat.numel() < 2**31 else torch.int64
    return {"index": index.to(itype), "value": flat[index].clone(), "shape": tuple(J.shape)}


def densify(sparse: dict[str, Any]) -> Tensor:
    """Inverse of :func:`sparsify` (zeros where nothing was kept)."""
    value = sparse["value"]
    out = torch.zeros(math.prod(sparse["shape"]), dtype=value.dtype, device=value.device)
    out[sparse["index"].long()] = value
    return out.view(sparse["shape"])


def shuffle_generator(seed: int, rnd: int) -> torch.Generator:
    """The shuffling server's generator of round ``rnd``: a pure function of (seed, round)."""
    return seeded_generator(seed, 0x5F1, rnd)


def permute_rows(rows: Rows, perm: Tensor) -> Rows:
    """The same rows permuted by ``perm`` (N,), regrouped into chunks of the original sizes (the
    chunks are what ranks share out; a chunk is no longer one client's data)."""
    sizes = rows.sizes

    def apply(parts: list[Any]) -> list[Any]:
        if isinstance(parts[0], FactoredJacobian):
            return FactoredJacobian.cat(parts).rows(perm).split(sizes)
        return list(torch.cat(parts)[perm.to(parts[0].device)].split(sizes))

    return Rows(
        apply(rows.jacobians),
        apply(rows.outputs),
        apply(rows.labels),
        apply(rows.inputs) if rows.inputs is not None else None,
    )


class CPNTKFL(NTKFL):
    """NTK-FL with subsampling, input projection (in the stage plan), top-k Jacobians, shuffling."""

    name = "cp-ntkfl"
    dp_refusal = "it uploads Jacobians, not a clippable update"
    Params = CPNTKFLParams
    example_params = CPNTKFLParams(grid=(10, 20))
    params: CPNTKFLParams

    def local_rows(self, data: ClientData, ctx: ClientContext) -> tuple[Tensor, Tensor]:
        """A uniform subset of ⌈β·N_m⌉ samples, drawn from the client's round generator."""
        n = data.n
        m = max(1, math.ceil(self.params.beta * n))
        if m >= n:
            return data.x, data.y
        # host: the client's CPU generator
        pick = torch.randperm(n, generator=ctx.generator)[:m].sort().values.to(data.y.device)
        return data.x[pick], data.y[pick]

    def factored(self, model: nn.Module) -> bool:
        return self.params.keep >= 1 and super().factored(model)

    def jacobian(self, model: nn.Module, x: Tensor) -> Any:
        J = super().jacobian(model, x)
        return J if self.params.keep >= 1 else sparsify(J, self.params.keep)

    def decode(self, uploaded: Any) -> Jacobian:
        return densify(uploaded) if isinstance(uploaded, dict) else uploaded

    def rows(self, aggregate: Aggregate, ctx: ServerContext) -> Rows:
        rows = super().rows(aggregate, ctx)
        if not self.params.shuffle:
            return rows
        # host: a seeded row order
        perm = torch.randperm(rows.total, generator=shuffle_generator(self.params.shuffle_seed, ctx.round))
        return permute_rows(rows, perm)
