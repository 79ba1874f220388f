"""Subsampled per-sample gradient of an ``nn.Linear`` weight: ``g[b, j] = δ[b, o_j] · a[b, i_j]``.

``δ`` (B, O) is the gradient of the summed logit w.r.t. the layer's output, ``a`` (B, I) the layer's
input, and ``(o_j, i_j)`` the row/column of the j-th selected weight coordinate. Only the n selected
products are formed: the (B, O, I) per-sample gradient is never materialised.

- :func:`linear_gather_reference`: pure torch, the CPU path and the tests' ground truth.
- :func:`linear_gather_triton`: one Triton program per (BLOCK_B × BLOCK_N) tile of the output.
- :func:`linear_gather`: Triton on CUDA tensors, the reference elsewhere.
"""

from __future__ import annotations

import torch
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

_TILE_ELEMS = 1 << 19
"""Elements per temporary of the row-tile path (2 MiB in float32), small enough to stay in cache."""

_MIN_RUN = 128
_MIN_RUN_ELEMS = 8192
"""Sorted coordinates come in runs of equal output row o (n/O of them on average). When the mean run
is at least ``_MIN_RUN`` long and holds at least ``_MIN_RUN_ELEMS`` products (batch × run), the
reference walks the runs: one gather of ``act`` per run and a broadcast multiply by the column
δ[:, o], instead of gathering both factors. Otherwise the per-run Python loop costs more than it
saves. Measured on the 2-core dev box, 1 thread: simplecnn fc1 (B 256, n 73,631, runs of ~575):
19 ms for the runs against 34-40 ms for row tiles; a Transformer's head (B 10, O 80, I 64, runs of
~55): 0.77 ms for the runs against 0.05 ms for row tiles; B 64, runs of 223: 0.64× the tiles'
time; B 10, runs of 223: 3.9× (``walks_runs`` is the rule)."""


def walks_runs(batch: int, n: int, rows: int) -> bool:
    """Whether :func:`linear_gather_reference` walks the runs of equal output row (see ``_MIN_RUN``)
    for ``n`` coordinates spread over ``rows`` distinct output rows at ``batch`` samples."""
    mean_run = n / max(rows, 1)
    return mean_run >= _MIN_RUN and batch * mean_run >= _MIN_RUN_ELEMS


def _check(delta: Tensor, act: Tensor, out_index: Tensor, in_index: Tensor) -> int:
    if delta.dim() != 2 or act.dim() != 2 or delta.shape[0] != act.shape[0]:
        raise ValueError(
            f"delta (B, O) and act (B, I) must share B, got {tuple(delta.shape)} and {tuple(act.shape)}"
        )
    n = out_index.numel()
    check_index("out_index", out_index, n, delta.shape[1])
    check_index("in_index", in_index, n, act.shape[1])
    return n


def linear_gather_reference(
    delta: Tensor, act: Tensor, out_index: Tensor, in_index: Tensor, *, out: Tensor | None = None
) -> Tensor:
    """``out[b, j] = delta[b, out_index[j]] * act[b, in_index[j]]`` → (B, n), in pure torch.

    ``out`` may be a strided view (e.g. a column slice of a larger feature matrix) of any floating
    dtype; products are formed in the inputs' dtype and cast on store.
    """
    n = _check(delta, act, out_index, in_index)
    batch = delta.shape[0]
    out = check_out(out, batch, n, delta)
    if n == 0 or batch == 0:
        return out
    rows, counts = torch.unique_consecutive(out_index, return_counts=True)
    if walks_runs(batch, n, rows.numel()):
        _runs(delta, act, rows.tolist(), counts.tolist(), in_index, out)
    else:
        _row_tiles(delta, act, out_index, in_index, out)
    return out


def _runs(
    delta: Tensor, act: Tensor, rows: list[int], counts: list[int], in_index: Tensor, out: Tensor
) -> None:
    """Runs of equal output row o: ``out[:, run] = act[:, i_run] * δ[:, o]`` (δ is not gathered)."""
    batch = delta.shape[0]
    tmp = torch.empty(batch * max(counts), dtype=act.dtype, device=act.device)
    start = 0
    for o, count in zip(rows, counts, strict=True):
        stop = start + count
        gathered = tmp[: batch * count].view(batch, count)
        torch.index_select(act, 1, in_index[start:stop], out=gathered)  # (B, run)
        scale = delta[:, o : o + 1]  # (B, 1)
        if out.dtype == gathered.dtype:
            torch.mul(gathered, scale, out=out[:, start:stop])
        else:
            out[:, start:stop].copy_(gathered.mul_(scale))
        start = stop


def _row_tiles(delta: Tensor, act: Tensor, out_index: Tensor, in_index: Tensor, out: Tensor) -> None:
    """A few samples at a time: gather both factors into cache-sized temporaries, multiply."""
    batch, n = delta.shape[0], out_index.numel()
    rows = max(1, _TILE_ELEMS // n)
    for b0 in range(0, batch, rows):
        b1 = min(batch, b0 + rows)
        d = delta[b0:b1].index_select(1, out_index)  # (rows, n)
        a = act[b0:b1].index_select(1, in_index)  # (rows, n)
        if out.dtype == d.dtype:
            torch.mul(d, a, out=out[b0:b1])
        else:
            out[b0:b1].copy_(d.mul_(a))


@jit
def _linear_gather_kernel(
    delta_ptr,
    act_ptr,
    oidx_ptr,
    iidx_ptr,
    out_ptr,
    batch,
    n,
    s_db,
    s_do,
    s_ab,
    s_ai,
    s_ob,
    s_on,
    COMPUTE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    offs_b = (pid_b * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)  # (BB,)
    mask_n = offs_n < n
    mask = (offs_b < batch)[:, None] & mask_n[None, :]  # (BB, BN)
    o = tl.load(oidx_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
    i = tl.load(iidx_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
    d = tl.load(delta_ptr + offs_b[:, None] * s_db + o[None, :] * s_do, mask=mask, other=0.0)
    a = tl.load(act_ptr + offs_b[:, None] * s_ab + i[None, :] * s_ai, mask=mask, other=0.0)
    g = d.to(COMPUTE) * a.to(COMPUTE)  # (BB, BN)
    out_ptrs = out_ptr + offs_b[:, None] * s_ob + offs_n[None, :].to(tl.int64) * s_on
    tl.store(out_ptrs, g.to(out_ptr.dtype.element_ty), mask=mask)


LINEAR_TILES = [
    {"BLOCK_B": 16, "BLOCK_N": 128, "num_warps": 4},  # the fixed tiles
    {"BLOCK_B": 8, "BLOCK_N": 256, "num_warps": 4},
    {"BLOCK_B": 32, "BLOCK_N": 64, "num_warps": 4},
    {"BLOCK_B": 4, "BLOCK_N": 512, "num_warps": 4},
    {"BLOCK_B": 32, "BLOCK_N": 128, "num_warps": 8},
    {"BLOCK_B": 64, "BLOCK_N": 64, "num_warps": 8},
]
"""The tile sizes ``triton.autotune`` tries (when :data:`triton_kernels._triton.AUTOTUNE`), per (n, B)."""

_linear_gather_tuned = autotune(LINEAR_TILES, key=["n", "batch"])(_linear_gather_kernel)


def linear_gather_triton(
    delta: Tensor, act: Tensor, out_index: Tensor, in_index: Tensor, *, out: Tensor | None = None
) -> Tensor:
    """Triton version of :func:`linear_gather_reference` (same signature and result)."""
    n = _check(delta, act, out_index, in_index)
    require_triton(delta, act, out_index, in_index)
    batch = delta.shape[0]
    out = check_out(out, batch, n, delta)
    if n == 0 or batch == 0:
        return out
    args = (
        delta,
        act,
        out_index,
        in_index,
        out,
        batch,
        n,
        delta.stride(0),
        delta.stride(1),
        act.stride(0),
        act.stride(1),
        out.stride(0),
        out.stride(1),
    )
    if _triton.AUTOTUNE and _linear_gather_tuned is not None:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(batch, meta["BLOCK_B"]))  # noqa: E731
        _linear_gather_tuned[grid](*args, COMPUTE=compute_dtype(delta))
        return out
    block_b, block_n = 16, 128
    grid = (triton.cdiv(n, block_n), triton.cdiv(batch, block_b))
    _linear_gather_kernel[grid](*args, COMPUTE=compute_dtype(delta), BLOCK_B=block_b, BLOCK_N=block_n)
    return out


def linear_gather(
    delta: Tensor, act: Tensor, out_index: Tensor, in_index: Tensor, *, out: Tensor | None = None
) -> Tensor:
    """Dispatch :func:`linear_gather_triton` on CUDA tensors, :func:`linear_gather_reference` elsewhere."""
    if use_triton(delta, act):
        return linear_gather_triton(delta, act, out_index, in_index, out=out)
    return linear_gather_reference(delta, act, out_index, in_index, out=out)
