"""The eNTK feature implementations, behind one enum (one signature, see :func:`entk_features`)."""

from __future__ import annotations

from enum import StrEnum


class EntkMethod(StrEnum):
    """How :func:`hpcfl.entk.entk_features` computes the per-sample gradients.

    - ``LOOP``: one forward + backward per sample, then index (TCT Algorithm 3). The reference:
      exact and model-agnostic, but it runs batch-1 kernels (simplecnn, p = 1e5, 2 CPU cores:
      300-600 samples/s against 2,000-3,400 for ``FUSED``). Wins only for a handful of samples.
    - ``VMAP``: ``torch.func.vmap(torch.func.grad(f))`` over ``functional_call`` (per-sample
      gradients the functional way), in chunks bounding B×P, then index. Works for any
      functorch-compatible model; memory and time scale with the full P (350 MB extra for
      simplecnn at 188 samples per chunk), so it wins only when p ≈ P on a small model, or as
      the fallback when ``FUSED`` does not support a layer.
    - ``FUSED``: one batched forward + one backward of Σ_b f(x_b) per batch (eval mode: samples are
      independent), capturing every parametrised layer's input and output gradient, then computing
      only the kept coordinates layer by layer (Triton gathers on CUDA). Cost ≈ one training step
      plus writing the (B, p) output (0.7-0.85× the throughput of plain forward+backward on CPU);
      never forms B×P. Wins whenever it supports the layers (Linear, Conv2d, BatchNorm1d/2d in
      eval mode, GroupNorm).
    - ``AUTO``: ``FUSED`` when supported, else ``VMAP`` (the default).
    """

    AUTO = "auto"
    LOOP = "loop"
    VMAP = "vmap"
    FUSED = "fused"
