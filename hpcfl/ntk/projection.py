"""CP-NTK-FL's input random projection P (Yue et al., ICML 2022, Section 4.2): one seeded Gaussian
matrix shared by the algorithm (:mod:`hpcfl.algorithms.cp_ntkfl`) and its stage code
(:mod:`hpcfl.ntk.stage`, which projects every client's and the test set's inputs), so it sits below
both."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def projection_matrix(d_in: int, d_out: int, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """P (d_in, d_out) with N(0, 1/d_out) entries from ``seed`` (the same on every client and rank)."""
    g = torch.Generator().manual_seed(int(seed))
    # host: seeded on every rank alike; moved by its user
    return torch.randn(d_in, d_out, generator=g, dtype=torch.float64).div_(math.sqrt(d_out)).to(dtype)
