"""Subsampled per-sample gradient of an ``nn.Conv2d`` weight, summed over output positions.

For the j-th selected weight coordinate ``W[o_j, c_j - g(o_j)·C/G, ky_j, kx_j]`` (``c_j`` is the
*absolute* input channel, so grouped convolutions need no special case here):

    g[b, j] = Σ_{h, w} δ[b, o_j, h, w] · x_pad[b, c_j, h·s_h + ky_j·d_h, w·s_w + kx_j·d_w]

with ``δ`` (B, O, Ho, Wo) the gradient w.r.t. the layer's output, ``x`` (B, C, H, W) its input and
``x_pad`` that input zero-padded by ``padding``. Only the n selected coordinates are computed; the
(B, O, C/G, kh, kw) per-sample gradient and the unfolded input are never materialised.

- :func:`conv2d_gather_reference`: pure torch (gather the input windows of the padded input by
  precomputed flat offsets — each distinct window once when coordinates share it — and the δ
  rows, multiply, sum), the CPU path for sparse selections and the tests' ground truth.
- :func:`conv2d_gather_triton`: one program per (sample, BLOCK_N coordinates), looping over output
  positions in BLOCK_L steps; padding is handled by masks instead of a padded copy.
- :func:`conv2d_gather`: Triton on CUDA tensors, the reference elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from triton_kernels import _triton
from triton_kernels._triton import (
    autotune,
    check_index,
    check_out,
    compute_dtype,
    jit,
    require_triton,
    tl,
    triton,
    use_triton,
)

_TILE_ELEMS = 1 << 18
"""Elements of each (B, chunk, L) temporary of the reference (1 MiB in float32). The two
temporaries are allocated once per call and refilled in place (``index_select(out=...)``): a fresh
multi-MiB tensor per chunk costs more in page faults than the gather itself (vgg11-shaped layer,
32 samples, 1 thread: 29 ms for a fresh 48 MB gather against 5.6 ms into a reused buffer)."""

_SHARED_WINDOWS = 2
"""From this many coordinates per distinct input window on (same input channel and kernel offset,
different output channels), each window is gathered once and its rows picked for the coordinates."""

Pair = tuple[int, int]


def _check(delta: Tensor, x: Tensor, out_index: Tensor, chan_index: Tensor, ky: Tensor, kx: Tensor) -> int:
    if delta.dim() != 4 or x.dim() != 4 or delta.shape[0] != x.shape[0]:
        raise ValueError(
            f"delta (B, O, Ho, Wo) and x (B, C, H, W) must share B, got {tuple(delta.shape)} and {tuple(x.shape)}"
        )
    n = out_index.numel()
    for name, index in (("out_index", out_index), ("chan_index", chan_index), ("ky", ky), ("kx", kx)):
        check_index(name, index, n, 0)
    return n


def conv2d_gather_reference(
    delta: Tensor,
    x: Tensor,
    out_index: Tensor,
    chan_index: Tensor,
    ky: Tensor,
    kx: Tensor,
    *,
    stride: Pair,
    padding: Pair,
    dilation: Pair,
    out: Tensor | None = None,
) -> Tensor:
    """Per-sample conv weight gradient at the selected coordinates → (B, n), in pure torch.

    Args:
        delta: (B, O, Ho, Wo) gradient w.r.t. the convolution's output.
        x: (B, C, H, W) the convolution's input (unpadded).
        out_index, chan_index, ky, kx: (n,) output channel, absolute input channel and kernel
            offsets of each selected coordinate.
        stride, padding, dilation: the layer's (zero-padding) geometry.
        out: optional (B, n) destination, possibly a strided view of a larger matrix.

    Every op works on whole chunks of coordinates (a few dozen ops per call whatever n is): the
    input windows (B, chunk, L) and the matching δ rows are gathered, multiplied and summed over
    the L output positions.
    """
    n = _check(delta, x, out_index, chan_index, ky, kx)
    batch, channels_out, h_out, w_out = delta.shape
    _, channels, height, width = x.shape
    out = check_out(out, batch, n, delta)
    if n == 0 or batch == 0:
        return out
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    hp, wp = height + 2 * ph, width + 2 * pw
    xp = F.pad(x, (pw, pw, ph, ph)) if ph or pw else x
    xp = xp.reshape(batch, channels * hp * wp)  # (B, C·Hp·Wp)
    length = h_out * w_out
    d = delta.reshape(batch, channels_out, length).contiguous()  # (B, O, L): rows of L gathered below
    dev = x.device
    rows = torch.arange(h_out, device=dev) * (sh * wp)  # (Ho,)
    cols = torch.arange(w_out, device=dev) * sw  # (Wo,)
    pos = (rows[:, None] + cols[None, :]).reshape(-1)  # (L,) flat offset of each output position
    base = chan_index.long() * (hp * wp) + ky.long() * (dh * wp) + kx.long() * dw  # (n,) window start
    windows, which = _distinct(base, channels * hp * wp)  # (u,), (n,)
    shared = n >= _SHARED_WINDOWS * windows.numel()
    if shared:  # every distinct window once: (B, u, L)
        source = xp.index_select(1, (windows[:, None] + pos[None, :]).reshape(-1))
        source = source.view(batch, windows.numel(), length)
    chunk = max(1, min(n, _TILE_ELEMS // (batch * length)))
    xs_buf = torch.empty(batch * chunk * length, dtype=x.dtype, device=dev)
    ds_buf = torch.empty(batch * chunk * length, dtype=delta.dtype, device=dev)
    for j0 in range(0, n, chunk):
        j1 = min(n, j0 + chunk)
        cj = j1 - j0
        xs = xs_buf[: batch * cj * length].view(batch, cj, length)
        if shared:
            torch.index_select(source, 1, which[j0:j1], out=xs)
        else:
            offsets = (base[j0:j1, None] + pos[None, :]).reshape(-1)  # (cj·L,)
            torch.index_select(xp, 1, offsets, out=xs.view(batch, cj * length))
        ds = ds_buf[: batch * cj * length].view(batch, cj, length)
        torch.index_select(d, 1, out_index[j0:j1], out=ds)
        prod = xs.mul_(ds)  # (B, cj, L)
        if out.dtype == prod.dtype:
            torch.sum(prod, dim=2, out=out[:, j0:j1])
        else:
            out[:, j0:j1].copy_(prod.sum(dim=2))
    return out


def _distinct(keys: Tensor, span: int) -> tuple[Tensor, Tensor]:
    """(sorted distinct keys, index of each key among them) for keys in [0, span).

    A marker over the key range (no sort) when the range is small against the keys; the fused
    path calls this once per layer and sample tile on every batch (vgg11, 24k coordinates:
    ~1 ms for ``torch.unique`` against ~0.1 ms here).
    """
    if span > 16 * keys.numel():
        return torch.unique(keys, return_inverse=True)
    seen = torch.zeros(span, dtype=torch.bool, device=keys.device)
    seen[keys] = True
    rank = torch.cumsum(seen, 0) - 1  # (span,) position of each key among the distinct ones
    return seen.nonzero().squeeze(1), rank[keys]


@jit
def _conv2d_gather_kernel(
    delta_ptr,
    x_ptr,
    oidx_ptr,
    cidx_ptr,
    ky_ptr,
    kx_ptr,
    out_ptr,
    n,
    height,
    width,
    h_out,
    w_out,
    s_db,
    s_dc,
    s_dh,
    s_dw,
    s_xb,
    s_xc,
    s_xh,
    s_xw,
    s_ob,
    s_on,
    SH: tl.constexpr,
    SW: tl.constexpr,
    PH: tl.constexpr,
    PW: tl.constexpr,
    DH: tl.constexpr,
    DW: tl.constexpr,
    COMPUTE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    pid_n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    mask_n = offs_n < n
    o = tl.load(oidx_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
    c = tl.load(cidx_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
    ky = tl.load(ky_ptr + offs_n, mask=mask_n, other=0)
    kx = tl.load(kx_ptr + offs_n, mask=mask_n, other=0)
    length = h_out * w_out
    acc = tl.zeros((BLOCK_N,), dtype=COMPUTE)
    for l0 in range(0, length, BLOCK_L):
        offs_l = l0 + tl.arange(0, BLOCK_L)  # (BL,)
        mask_l = offs_l < length
        oh = offs_l // w_out
        ow = offs_l % w_out
        ih = oh[None, :] * SH - PH + ky[:, None] * DH  # (BN, BL)
        iw = ow[None, :] * SW - PW + kx[:, None] * DW  # (BN, BL)
        valid = mask_n[:, None] & mask_l[None, :]
        inside = valid & (ih >= 0) & (ih < height) & (iw >= 0) & (iw < width)
        x_ptrs = x_ptr + b * s_xb + c[:, None] * s_xc + ih.to(tl.int64) * s_xh + iw.to(tl.int64) * s_xw
        d_ptrs = delta_ptr + b * s_db + o[:, None] * s_dc + (oh * s_dh + ow * s_dw).to(tl.int64)[None, :]
        xv = tl.load(x_ptrs, mask=inside, other=0.0)
        dv = tl.load(d_ptrs, mask=valid, other=0.0)
        acc += tl.sum(xv.to(COMPUTE) * dv.to(COMPUTE), axis=1)
    out_ptrs = out_ptr + b * s_ob + offs_n.to(tl.int64) * s_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


CONV_TILES = [
    {"BLOCK_N": 32, "BLOCK_L": 128, "num_warps": 4},  # the fixed tiles (for L >= 128)
    {"BLOCK_N": 64, "BLOCK_L": 64, "num_warps": 4},
    {"BLOCK_N": 128, "BLOCK_L": 32, "num_warps": 4},
    {"BLOCK_N": 16, "BLOCK_L": 256, "num_warps": 4},
    {"BLOCK_N": 64, "BLOCK_L": 128, "num_warps": 8},
    {"BLOCK_N": 256, "BLOCK_L": 16, "num_warps": 4},
]
"""The tile sizes ``triton.autotune`` tries (when :data:`triton_kernels._triton.AUTOTUNE`), per
(n, Ho, Wo): wide BLOCK_L for large maps, wide BLOCK_N for the 4×4 maps of deep layers."""

_conv2d_gather_tuned = autotune(CONV_TILES, key=["n", "h_out", "w_out"])(_conv2d_gather_kernel)


def conv2d_gather_triton(
    delta: Tensor,
    x: Tensor,
    out_index: Tensor,
    chan_index: Tensor,
    ky: Tensor,
    kx: Tensor,
    *,
    stride: Pair,
    padding: Pair,
    dilation: Pair,
    out: Tensor | None = None,
) -> Tensor:
    """Triton version of :func:`conv2d_gather_reference` (same signature and result)."""
    n = _check(delta, x, out_index, chan_index, ky, kx)
    require_triton(delta, x, out_index)
    batch, _, h_out, w_out = delta.shape
    out = check_out(out, batch, n, delta)
    if n == 0 or batch == 0:
        return out
    args = (
        delta,
        x,
        out_index,
        chan_index,
        ky,
        kx,
        out,
        n,
        x.shape[2],
        x.shape[3],
        h_out,
        w_out,
        *delta.stride(),
        *x.stride(),
        out.stride(0),
        out.stride(1),
    )
    geometry = dict(SH=stride[0], SW=stride[1], PH=padding[0], PW=padding[1], DH=dilation[0], DW=dilation[1])
    if _triton.AUTOTUNE and _conv2d_gather_tuned is not None:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), batch)  # noqa: E731
        _conv2d_gather_tuned[grid](*args, **geometry, COMPUTE=compute_dtype(delta))
        return out
    block_n = 32
    block_l = min(128, triton.next_power_of_2(h_out * w_out))
    grid = (triton.cdiv(n, block_n), batch)
    _conv2d_gather_kernel[grid](
        *args, **geometry, COMPUTE=compute_dtype(delta), BLOCK_N=block_n, BLOCK_L=block_l
    )
    return out


def conv2d_gather(
    delta: Tensor,
    x: Tensor,
    out_index: Tensor,
    chan_index: Tensor,
    ky: Tensor,
    kx: Tensor,
    *,
    stride: Pair,
    padding: Pair,
    dilation: Pair,
    out: Tensor | None = None,
) -> Tensor:
    """Dispatch :func:`conv2d_gather_triton` on CUDA tensors, :func:`conv2d_gather_reference` elsewhere."""
    fn = conv2d_gather_triton if use_triton(delta, x) else conv2d_gather_reference
    return fn(
        delta, x, out_index, chan_index, ky, kx, stride=stride, padding=padding, dilation=dilation, out=out
    )
