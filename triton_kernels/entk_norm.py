"""Subsampled per-sample gradients of per-channel affine parameters (norm layers, conv biases).

For channels ``c_j`` (the selected coordinates of a per-channel parameter):

- :func:`norm_weight_gather`: ``g[b, j] = Σ_l δ[b, c_j, l] · (x[b, c_j, l] − mean[b, c_j]) · rstd[b, c_j]``
  — the weight (γ) gradient of BatchNorm (eval: running statistics, ``mean``/``rstd`` expanded
  from (C,)) and GroupNorm (per-sample group statistics expanded to (B, C)). ``x̂`` is formed on the
  fly, never stored.
- :func:`channel_sum_gather`: ``g[b, j] = Σ_l δ[b, c_j, l]`` — the bias (β) gradient of a norm
  layer and the bias gradient of a convolution.

``δ`` and ``x`` are (B, C, L) with L the flattened spatial positions (L = 1 for 1-d inputs). Each
function has a pure-torch ``*_reference``, a ``*_triton`` kernel (one program per (sample, BLOCK_N
channels), looping over L) and a dispatcher (Triton on CUDA tensors, the reference elsewhere).
"""

from __future__ import annotations

import torch
from torch import Tensor

from triton_kernels._triton import (
    check_index,
    check_out,
    compute_dtype,
    jit,
    require_triton,
    tl,
    triton,
    use_triton,
)


def _check(delta: Tensor, index: Tensor, *others: Tensor) -> int:
    if delta.dim() != 3:
        raise ValueError(f"delta must be (B, C, L), got {tuple(delta.shape)}")
    for t in others:
        if t.shape[:2] != delta.shape[:2]:
            raise ValueError(f"expected leading dims {tuple(delta.shape[:2])}, got {tuple(t.shape)}")
    n = index.numel()
    check_index("index", index, n, delta.shape[1])
    return n


def _store(out: Tensor, value: Tensor) -> Tensor:
    out.copy_(value)
    return out


def norm_weight_gather_reference(
    delta: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, index: Tensor, *, out: Tensor | None = None
) -> Tensor:
    """``Σ_l δ·(x − mean)·rstd`` at channels ``index`` → (B, n), in pure torch.

    Args:
        delta, x: (B, C, L). mean, rstd: (B, C), expanded views are fine. index: (n,) channels.
    """
    n = _check(delta, index, x, mean, rstd)
    out = check_out(out, delta.shape[0], n, delta)
    if n == 0 or delta.shape[0] == 0:
        return out
    # Σ δ·(x − μ) rather than Σ δ·x − μ·Σ δ: same cost, no cancellation when |μ| ≫ std.
    centred = torch.sub(x, mean[:, :, None])  # (B, C, L)
    dot = centred.mul_(delta).sum(dim=2)  # (B, C)
    return _store(out, dot.mul_(rstd).index_select(1, index))


def channel_sum_gather_reference(delta: Tensor, index: Tensor, *, out: Tensor | None = None) -> Tensor:
    """``Σ_l δ[b, c_j, l]`` → (B, n), in pure torch."""
    n = _check(delta, index)
    out = check_out(out, delta.shape[0], n, delta)
    if n == 0 or delta.shape[0] == 0:
        return out
    return _store(out, delta.sum(dim=2).index_select(1, index))  # (B, C) → (B, n)


@jit
def _channel_reduce_kernel(
    delta_ptr,
    x_ptr,
    mean_ptr,
    rstd_ptr,
    idx_ptr,
    out_ptr,
    n,
    length,
    s_db,
    s_dc,
    s_dl,
    s_xb,
    s_xc,
    s_xl,
    s_mb,
    s_mc,
    s_rb,
    s_rc,
    s_ob,
    s_on,
    NORMALISE: tl.constexpr,
    COMPUTE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    pid_n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    mask_n = offs_n < n
    c = tl.load(idx_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_N,), dtype=COMPUTE)
    if NORMALISE:
        mu = tl.load(mean_ptr + b * s_mb + c * s_mc, mask=mask_n, other=0.0).to(COMPUTE)
    for l0 in range(0, length, BLOCK_L):
        offs_l = (l0 + tl.arange(0, BLOCK_L)).to(tl.int64)  # (BL,)
        mask = mask_n[:, None] & (offs_l < length)[None, :]  # (BN, BL)
        d = tl.load(delta_ptr + b * s_db + c[:, None] * s_dc + offs_l[None, :] * s_dl, mask=mask, other=0.0)
        if NORMALISE:
            xv = tl.load(x_ptr + b * s_xb + c[:, None] * s_xc + offs_l[None, :] * s_xl, mask=mask, other=0.0)
            centred = tl.where(mask, xv.to(COMPUTE) - mu[:, None], 0.0)
            acc += tl.sum(d.to(COMPUTE) * centred, axis=1)
        else:
            acc += tl.sum(d.to(COMPUTE), axis=1)
    if NORMALISE:
        acc = acc * tl.load(rstd_ptr + b * s_rb + c * s_rc, mask=mask_n, other=0.0).to(COMPUTE)
    tl.store(out_ptr + b * s_ob + offs_n.to(tl.int64) * s_on, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def _launch(
    delta: Tensor, x: Tensor | None, mean: Tensor | None, rstd: Tensor | None, index: Tensor, out: Tensor
) -> Tensor:
    batch, _, length = delta.shape
    n = index.numel()
    if n == 0 or batch == 0:
        return out
    normalise = x is not None
    xx = x if x is not None else delta
    mm = mean if mean is not None else delta[:, :, 0]
    rr = rstd if rstd is not None else delta[:, :, 0]
    block_n = 32
    block_l = min(128, triton.next_power_of_2(max(1, length)))
    grid = (triton.cdiv(n, block_n), batch)
    _channel_reduce_kernel[grid](
        delta,
        xx,
        mm,
        rr,
        index,
        out,
        n,
        length,
        *delta.stride(),
        *xx.stride(),
        *mm.stride(),
        *rr.stride(),
        out.stride(0),
        out.stride(1),
        NORMALISE=normalise,
        COMPUTE=compute_dtype(delta),
        BLOCK_N=block_n,
        BLOCK_L=block_l,
    )
    return out


def norm_weight_gather_triton(
    delta: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, index: Tensor, *, out: Tensor | None = None
) -> Tensor:
    """Triton version of :func:`norm_weight_gather_reference` (same signature and result)."""
    n = _check(delta, index, x, mean, rstd)
    require_triton(delta, x, index)
    out = check_out(out, delta.shape[0], n, delta)
    return _launch(delta, x, mean, rstd, index, out)


def channel_sum_gather_triton(delta: Tensor, index: Tensor, *, out: Tensor | None = None) -> Tensor:
    """Triton version of :func:`channel_sum_gather_reference` (same signature and result)."""
    n = _check(delta, index)
    require_triton(delta, index)
    out = check_out(out, delta.shape[0], n, delta)
    return _launch(delta, None, None, None, index, out)


def norm_weight_gather(
    delta: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, index: Tensor, *, out: Tensor | None = None
) -> Tensor:
    """Dispatch :func:`norm_weight_gather_triton` on CUDA, :func:`norm_weight_gather_reference` elsewhere."""
    if use_triton(delta, x):
        return norm_weight_gather_triton(delta, x, mean, rstd, index, out=out)
    return norm_weight_gather_reference(delta, x, mean, rstd, index, out=out)


def channel_sum_gather(delta: Tensor, index: Tensor, *, out: Tensor | None = None) -> Tensor:
    """Dispatch :func:`channel_sum_gather_triton` on CUDA, :func:`channel_sum_gather_reference` elsewhere."""
    if use_triton(delta):
        return channel_sum_gather_triton(delta, index, out=out)
    return channel_sum_gather_reference(delta, index, out=out)
