"""Fused linear CKA in Triton, beside the pure-torch reference it is tested against.

Linear CKA (Kornblith et al. 2019, "Similarity of Neural Network Representations Revisited", ICML)
compares two representations of the same ``n`` samples, X (n×d1) and Y (n×d2), through their Gram
matrices K = XXᵀ and L = YYᵀ::

    CKA(X, Y) = HSIC(K, L) / sqrt(HSIC(K, K) · HSIC(L, L)),      HSIC(K, L) = ⟨Kc, Lc⟩_F

with Kc = HKH the doubly centred Gram (H = I − 11ᵀ/n). FedCKA (Son et al., "Compare Where It
Matters") uses it as the similarity inside its contrastive regulariser, so the forward *and* the
gradient must be exact.

Two implementations share one signature, ``(x, y, *, debiased=False, eps=1e-8) -> Tensor``:

* :func:`linear_cka_reference` — pure torch, Gram form, O(n²d) time and O(n²) memory. The centred
  Gram is formed from row/column means (Kc = K − rowmean − colmean + mean), never from an n×n
  centring matrix. Differentiable by plain autograd. This is what runs on CPU and the ground truth.
* :func:`linear_cka_triton` — the kernel path. It uses the identity Kc = Xc·Xcᵀ with Xc = X − 1μᵀ
  (μ = column means of X; indeed Kc_ij = x_i·x_j − x_i·μ − μ·x_j + μ·μ = (x_i − μ)·(x_j − μ)), so
  it centres the *features* (O(nd), better conditioned than subtracting Gram means) and then one
  fused kernel computes the three Gram statistics

      s = (⟨K, L⟩_F, ‖K‖²_F, ‖L‖²_F)        of K = XXᵀ, L = YYᵀ for the (centred) inputs

  in a single pass over Gram tiles: each program builds one BLOCK×BLOCK tile of K (from two row
  blocks of X, looping over d1) and the same tile of L (looping over d2) in registers, reduces the
  three products and writes three partial sums. Only the upper triangle of tiles is visited (the
  Grams are symmetric; off-diagonal tiles count twice). No n×n matrix is ever stored in the forward.
  The partials are summed by torch (deterministic, no atomics).

  The debiased variant runs on the same kernel: the unbiased HSIC estimator is exactly invariant to
  translating the features (it is a U-statistic of (x_i − x_r)·(x_j − x_q) terms), and on centred
  features every correction term it needs is a function of the Gram *diagonal* kᵢ = ‖xc_i‖², which
  costs O(nd) in torch (see :func:`_hsic_debiased_centred`).

Backward of the statistics (derived for :class:`LinearCKATriton`, with K = XXᵀ, L = YYᵀ symmetric):

    ⟨K, L⟩ = tr(XXᵀL)       ⇒ ∂⟨K, L⟩/∂X = (L + Lᵀ)X = 2·L·X,      ∂⟨K, L⟩/∂Y = 2·K·Y
    ‖K‖²   = tr(XXᵀXXᵀ)     ⇒ ∂‖K‖²/∂X   = 2·(K + Kᵀ)X = 4·K·X,    ∂‖L‖²/∂Y   = 4·L·Y

so for an upstream gradient g = (g_xy, g_xx, g_yy)

    ∂/∂X = W_x·X,  W_x = 2·g_xy·L + 4·g_xx·K;        ∂/∂Y = W_y·Y,  W_y = 2·g_xy·K + 4·g_yy·L.

The backward kernel builds W_x and W_y (n×n each) in one fused pass over the same Gram tiles and
the two products W·X, W·Y go to cuBLAS. Storing the two n×n weights here is deliberate: n is the
batch (≤ a few hundred) while d is a flattened activation (thousands), and the store-free
alternative would rebuild every Gram tile once per output column block, O(n²d²/BLOCK) work.
The centring and the scalar formula (clamps, square roots, the ratio, the debiased corrections)
are torch ops outside the Function, so autograd chains them; for the biased statistics the
centring's own backward is the identity anyway, because 1ᵀLc = 0 makes Lc·Xc column-centred.

Dtypes: float32 and float64 are computed in their own precision (float32 ``tl.dot`` uses
``input_precision="ieee"``, not TF32, so it agrees with the reference to ~1e-6; TF32 would be faster
on tensor cores but is not measured here). float16/bfloat16 inputs are loaded as they are and
accumulated in float32; the statistics and the result are float32 (16-bit Gram sums overflow).

The Triton import is optional: without triton, on a CPU tensor outside ``TRITON_INTERPRET=1``, or
for bfloat16 under the interpreter (whose bf16 ``tl.dot`` is wrong, see :func:`_triton_usable`),
:func:`linear_cka_triton` falls back to the reference.

Known limit: the grid is one program per upper-triangle Gram tile, so a small batch launches few
programs (parallelism comes from n, not d); splitting the feature loop across programs would need a
second pass over partial tiles and is left for when there is a GPU to measure it on.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

try:  # optional: the module (and the reference) must import without triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

HAS_TRITON: bool = triton is not None

__all__ = [
    "HAS_TRITON",
    "LinearCKATriton",
    "linear_cka_reference",
    "linear_cka_triton",
]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ----------------------------------------------------------------------------------------------
# shared helpers (both paths)
# ----------------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else (16-bit floats, ints) is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _flatten_pair(x: Tensor, y: Tensor, *, debiased: bool) -> tuple[Tensor, Tensor]:
    """Check a pair of representations and flatten them to (n, d1), (n, d2); dtype unchanged."""
    if x.dim() == 0 or y.dim() == 0:
        raise ValueError("linear CKA needs batched inputs of shape (n, ...); got a scalar")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"linear CKA compares the same samples: x has {x.shape[0]} rows, y has {y.shape[0]}")
    if x.device != y.device:
        raise ValueError(f"x and y must be on the same device, got {x.device} and {y.device}")
    n = x.shape[0]
    if debiased and n < 4:
        raise ValueError(
            f"the debiased (unbiased-HSIC) CKA needs at least 4 samples, got n={n}; "
            "use debiased=False or a larger batch"
        )
    return x.reshape(n, -1), y.reshape(n, -1)  # (n, d1), (n, d2)


def _cka_from_hsic(hxy: Tensor, hxx: Tensor, hyy: Tensor, eps: float) -> Tensor:
    """CKA = hxy / (‖K‖·‖L‖) with each norm clamped below at ``eps``.

    The clamp is applied to the squared norm before the square root so that a constant
    representation (HSIC = 0) gives CKA = 0 with a finite (zero) gradient instead of 0/0.
    """
    eps2 = eps * eps
    return hxy / (hxx.clamp_min(eps2).sqrt() * hyy.clamp_min(eps2).sqrt())


def _centre_gram(k: Tensor) -> Tensor:
    """HKH without H: subtract row means and column means, add back the grand mean. (n, n)."""
    row = k.mean(dim=1, keepdim=True)  # (n, 1)
    col = k.mean(dim=0, keepdim=True)  # (1, n)
    return k - row - col + k.mean()


def _hsic_debiased_gram(k: Tensor, l: Tensor) -> Tensor:
    """Unbiased HSIC estimator (Song et al. 2012, eq. 5; Nguyen et al. 2021) from raw Grams.

    With K̃, L̃ the Grams with zeroed diagonals::

        HSIC₁ = [tr(K̃L̃) + (1ᵀK̃1)(1ᵀL̃1)/((n−1)(n−2)) − 2/(n−2)·1ᵀK̃L̃1] / (n(n−3))

    O(n²) given the Grams: 1ᵀK̃L̃1 = (K̃1)·(L̃1).
    """
    n = k.shape[0]
    kt = k - torch.diag(torch.diagonal(k))  # (n, n) zero diagonal
    lt = l - torch.diag(torch.diagonal(l))  # (n, n)
    trace = (kt * lt).sum()
    sums = kt.sum() * lt.sum() / ((n - 1) * (n - 2))
    cross = (kt.sum(dim=1) * lt.sum(dim=1)).sum() * (2.0 / (n - 2))
    return (trace + sums - cross) / (n * (n - 3))


def _hsic_debiased_centred(s_kl: Tensor, kd: Tensor, ld: Tensor, n: int) -> Tensor:
    """Unbiased HSIC from ⟨K, L⟩ and the Gram diagonals, for column-centred features.

    With Xᵀ1 = 0: K1 = 0, so K̃1 = −k (k = diag K), 1ᵀK̃1 = −Σk and tr(K̃L̃) = ⟨K, L⟩ − k·l; the
    formula of :func:`_hsic_debiased_gram` collapses to::

        HSIC₁ = [⟨K, L⟩ + (Σk)(Σl)/((n−1)(n−2)) − n/(n−2)·k·l] / (n(n−3))

    Centring first is legitimate because the estimator is exactly translation invariant.
    """
    sums = kd.sum() * ld.sum() / ((n - 1) * (n - 2))
    diag = (kd * ld).sum() * (n / (n - 2))
    return (s_kl + sums - diag) / (n * (n - 3))


# ----------------------------------------------------------------------------------------------
# reference
# ----------------------------------------------------------------------------------------------


def linear_cka_reference(x: Tensor, y: Tensor, *, debiased: bool = False, eps: float = 1e-8) -> Tensor:
    """Linear CKA of two representations of the same batch — pure torch, Gram form.

    Args:
        x: (n, ...) activations; flattened to (n, d1).
        y: (n, ...) activations of the same n samples; flattened to (n, d2).
        debiased: use the unbiased HSIC estimator (Song et al. 2012; the minibatch CKA of Nguyen
            et al. 2021) instead of the biased ⟨Kc, Lc⟩. Needs n ≥ 4.
        eps: lower clamp on each Frobenius norm in the denominator.

    Returns:
        A 0-dim tensor, float64 for float64 inputs and float32 otherwise; differentiable in x and y.

    Cost O(n²(d1 + d2)) time, O(n²) memory: preferable to the feature form ‖YᵀX‖²/(‖XᵀX‖‖YᵀY‖),
    which costs O(n·d1·d2), whenever the batch is smaller than the flattened activations.
    """
    x2, y2 = _flatten_pair(x, y, debiased=debiased)
    dtype = _compute_dtype(x2.dtype)
    x2 = x2.to(dtype)  # (n, d1)
    y2 = y2.to(dtype)  # (n, d2)
    k = x2 @ x2.T  # (n, n)
    l = y2 @ y2.T  # (n, n)
    if debiased:
        hxy = _hsic_debiased_gram(k, l)
        hxx = _hsic_debiased_gram(k, k)
        hyy = _hsic_debiased_gram(l, l)
    else:
        kc = _centre_gram(k)  # (n, n)
        lc = _centre_gram(l)  # (n, n)
        hxy = (kc * lc).sum()
        hxx = (kc * kc).sum()
        hyy = (lc * lc).sum()
    return _cka_from_hsic(hxy, hxx, hyy, eps)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _gram_tile(
        ptr,
        rows_i,
        rows_j,
        mask_i,
        mask_j,
        d,
        stride_n,
        stride_d,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
        ACC_DTYPE: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):
        """One (BLOCK_M, BLOCK_M) tile of A·Aᵀ for row blocks i and j, looping over d columns."""
        acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=ACC_DTYPE)
        cols = tl.arange(0, BLOCK_K)
        for k0 in range(0, d, BLOCK_K):
            c = k0 + cols  # (BLOCK_K,)
            cmask = c < d
            a = tl.load(
                ptr + rows_i[:, None] * stride_n + c[None, :] * stride_d,
                mask=mask_i[:, None] & cmask[None, :],
                other=0.0,
            )  # (BLOCK_M, BLOCK_K); padded rows/cols are 0 and add nothing
            b = tl.load(
                ptr + rows_j[:, None] * stride_n + c[None, :] * stride_d,
                mask=mask_j[:, None] & cmask[None, :],
                other=0.0,
            )  # (BLOCK_M, BLOCK_K)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=INPUT_PRECISION, out_dtype=ACC_DTYPE)
        return acc

    @triton.jit
    def _gram_stats_fwd_kernel(
        x_ptr,
        y_ptr,
        pairs_ptr,
        out_ptr,
        n,
        d1,
        d2,
        stride_xn,
        stride_xd,
        stride_yn,
        stride_yd,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
        ACC_DTYPE: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):
        """Partial (⟨K,L⟩, ‖K‖², ‖L‖²) of one upper-triangle Gram tile → out[pid, 0:3]."""
        pid = tl.program_id(0)
        ti = tl.load(pairs_ptr + 2 * pid)
        tj = tl.load(pairs_ptr + 2 * pid + 1)
        rows_i = ti * BLOCK_M + tl.arange(0, BLOCK_M)
        rows_j = tj * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_i = rows_i < n
        mask_j = rows_j < n
        k = _gram_tile(
            x_ptr, rows_i, rows_j, mask_i, mask_j, d1, stride_xn, stride_xd,
            BLOCK_M, BLOCK_K, ACC_DTYPE, INPUT_PRECISION,
        )  # fmt: skip
        l = _gram_tile(
            y_ptr, rows_i, rows_j, mask_i, mask_j, d2, stride_yn, stride_yd,
            BLOCK_M, BLOCK_K, ACC_DTYPE, INPUT_PRECISION,
        )  # fmt: skip
        # an off-diagonal tile stands for itself and its mirror image
        w = tl.where(ti == tj, 1.0, 2.0).to(ACC_DTYPE)
        tl.store(out_ptr + 3 * pid + 0, w * tl.sum(k * l))
        tl.store(out_ptr + 3 * pid + 1, w * tl.sum(k * k))
        tl.store(out_ptr + 3 * pid + 2, w * tl.sum(l * l))

    @triton.jit
    def _gram_stats_bwd_kernel(
        x_ptr,
        y_ptr,
        pairs_ptr,
        g_ptr,
        wx_ptr,
        wy_ptr,
        n,
        d1,
        d2,
        stride_xn,
        stride_xd,
        stride_yn,
        stride_yd,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
        ACC_DTYPE: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):
        """W_x = 2g_xy·L + 4g_xx·K and W_y = 2g_xy·K + 4g_yy·L on one tile and its mirror."""
        pid = tl.program_id(0)
        ti = tl.load(pairs_ptr + 2 * pid)
        tj = tl.load(pairs_ptr + 2 * pid + 1)
        rows_i = ti * BLOCK_M + tl.arange(0, BLOCK_M)
        rows_j = tj * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_i = rows_i < n
        mask_j = rows_j < n
        k = _gram_tile(
            x_ptr, rows_i, rows_j, mask_i, mask_j, d1, stride_xn, stride_xd,
            BLOCK_M, BLOCK_K, ACC_DTYPE, INPUT_PRECISION,
        )  # fmt: skip
        l = _gram_tile(
            y_ptr, rows_i, rows_j, mask_i, mask_j, d2, stride_yn, stride_yd,
            BLOCK_M, BLOCK_K, ACC_DTYPE, INPUT_PRECISION,
        )  # fmt: skip
        g_xy = tl.load(g_ptr + 0)
        g_xx = tl.load(g_ptr + 1)
        g_yy = tl.load(g_ptr + 2)
        wx = (2.0 * g_xy) * l + (4.0 * g_xx) * k  # (BLOCK_M, BLOCK_M)
        wy = (2.0 * g_xy) * k + (4.0 * g_yy) * l  # (BLOCK_M, BLOCK_M)
        mask = mask_i[:, None] & mask_j[None, :]
        ij = rows_i[:, None] * n + rows_j[None, :]  # W[i, j]
        ji = rows_j[None, :] * n + rows_i[:, None]  # W[j, i]: the mirror tile, same values
        tl.store(wx_ptr + ij, wx, mask=mask)
        # a diagonal tile is its own mirror; rows_i < tj·BLOCK_M ⇔ ti < tj (pairs have ti ≤ tj)
        mirror = mask & (rows_i[:, None] < tj * BLOCK_M)
        tl.store(wx_ptr + ji, wx, mask=mirror)
        tl.store(wy_ptr + ij, wy, mask=mask)
        tl.store(wy_ptr + ji, wy, mask=mirror)


def _launch_config(n: int, d: int, block_m: int | None, block_k: int | None) -> tuple[int, int]:
    """Square Gram tiles of BLOCK_M rows (tl.dot needs ≥ 16), BLOCK_K feature columns per step.

    Not tuned on a GPU (none was available when this was written). BLOCK_M is capped at 32 so a
    typical batch still gives a usable grid: n = 128 → 4×4 tiles → 10 upper-triangle programs.
    """
    bm = block_m or min(32, max(16, triton.next_power_of_2(n)))
    bk = block_k or min(64, max(16, triton.next_power_of_2(d)))
    if bm < 16 or bk < 16 or bm & (bm - 1) or bk & (bk - 1):
        raise ValueError(f"block sizes must be powers of two ≥ 16, got block_m={bm}, block_k={bk}")
    return bm, bk


def _tile_pairs(n: int, bm: int, device: torch.device) -> Tensor:
    """(T, 2) int32 (tile_i, tile_j) with tile_i ≤ tile_j: the upper triangle of Gram tiles."""
    nb = triton.cdiv(n, bm)
    return torch.triu_indices(nb, nb, device=device).T.contiguous().to(torch.int32)


def _kernel_args(x: Tensor, y: Tensor, block_m: int | None, block_k: int | None) -> dict[str, Any]:
    n, d1 = x.shape
    d2 = y.shape[1]
    bm, bk = _launch_config(n, max(d1, d2), block_m, block_k)
    acc = tl.float64 if x.dtype == torch.float64 else tl.float32
    return {
        "n": n,
        "d1": d1,
        "d2": d2,
        "stride_xn": x.stride(0),
        "stride_xd": x.stride(1),
        "stride_yn": y.stride(0),
        "stride_yd": y.stride(1),
        "BLOCK_M": bm,
        "BLOCK_K": bk,
        "ACC_DTYPE": acc,
        "INPUT_PRECISION": "ieee",
    }


class LinearCKATriton(torch.autograd.Function):
    """Autograd wrapper of the fused linear-CKA kernels.

    ``LinearCKATriton.apply(x, y, block_m=None, block_k=None) -> Tensor`` of shape (3,):
    (⟨K, L⟩_F, ‖K‖²_F, ‖L‖²_F) for K = x·xᵀ, L = y·yᵀ, x (n, d1), y (n, d2) of one float dtype.
    These are the HSIC statistics when x and y are column-centred (as :func:`linear_cka_triton`
    passes them); the scalar CKA is formed from them by torch ops, so the same Function serves the
    biased and the debiased estimator. ``block_m``/``block_k`` override the tile sizes (tests use
    them to force several tiles on tiny inputs). The backward is derived in the module docstring;
    it is not itself differentiable (no double backward).
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: Tensor,
        y: Tensor,
        block_m: int | None = None,
        block_k: int | None = None,
    ) -> Tensor:
        if not HAS_TRITON:
            raise RuntimeError("LinearCKATriton needs triton; use linear_cka_reference")
        if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
            raise ValueError(f"expected x (n, d1) and y (n, d2), got {tuple(x.shape)}, {tuple(y.shape)}")
        if x.dtype != y.dtype or x.dtype not in _KERNEL_DTYPES:
            raise ValueError(f"x and y need one float dtype of {_KERNEL_DTYPES}, got {x.dtype}, {y.dtype}")
        args = _kernel_args(x, y, block_m, block_k)
        pairs = _tile_pairs(x.shape[0], args["BLOCK_M"], x.device)  # (T, 2)
        acc_dtype = _compute_dtype(x.dtype)
        partial = torch.empty(pairs.shape[0], 3, device=x.device, dtype=acc_dtype)  # (T, 3)
        _gram_stats_fwd_kernel[(pairs.shape[0],)](x, y, pairs, partial, **args)
        ctx.save_for_backward(x, y)
        ctx.blocks = (block_m, block_k)
        return partial.sum(dim=0)  # (3,)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        x, y = ctx.saved_tensors
        n = x.shape[0]
        acc_dtype = _compute_dtype(x.dtype)
        args = _kernel_args(x, y, *ctx.blocks)
        pairs = _tile_pairs(n, args["BLOCK_M"], x.device)  # (T, 2)
        g = g.to(acc_dtype).contiguous()  # (3,)
        wx = torch.empty(n, n, device=x.device, dtype=acc_dtype)  # (n, n)
        wy = torch.empty(n, n, device=x.device, dtype=acc_dtype)  # (n, n)
        _gram_stats_bwd_kernel[(pairs.shape[0],)](x, y, pairs, g, wx, wy, **args)
        gx = (wx @ x.to(acc_dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None  # (n, d1)
        gy = (wy @ y.to(acc_dtype)).to(y.dtype) if ctx.needs_input_grad[1] else None  # (n, d2)
        return gx, gy, None, None


def _triton_usable(t: Tensor) -> bool:
    """The kernel runs on CUDA tensors, or on CPU tensors under the Triton interpreter.

    bfloat16 is kept off the interpreter: its ``tl.dot`` multiplies the raw bf16 bit patterns
    (observed with triton 3.9: a 16×16 Gram off by ~1e10), so it would test nothing.
    """
    if not HAS_TRITON or t.dtype not in _KERNEL_DTYPES:
        return False
    if t.is_cuda:
        return True
    return os.environ.get("TRITON_INTERPRET") == "1" and t.dtype != torch.bfloat16


def linear_cka_triton(x: Tensor, y: Tensor, *, debiased: bool = False, eps: float = 1e-8) -> Tensor:
    """Linear CKA through the fused Triton kernel; same signature and result as the reference.

    Args and return as :func:`linear_cka_reference`. Falls back to the reference when triton is
    missing, when the tensors are on CPU outside ``TRITON_INTERPRET=1``, or for non-float dtypes.
    Memory: O(n·d) forward (no n×n), two n×n weights in the backward.
    """
    x2, y2 = _flatten_pair(x, y, debiased=debiased)  # (n, d1), (n, d2)
    if not (_triton_usable(x2) and x2.dtype == y2.dtype):
        return linear_cka_reference(x, y, debiased=debiased, eps=eps)
    n = x2.shape[0]
    dtype = _compute_dtype(x2.dtype)
    # centre the features (Kc = Xc·Xcᵀ); the mean is taken in the compute dtype
    xc = x2 - x2.mean(dim=0, keepdim=True, dtype=dtype).to(x2.dtype)  # (n, d1)
    yc = y2 - y2.mean(dim=0, keepdim=True, dtype=dtype).to(y2.dtype)  # (n, d2)
    s = LinearCKATriton.apply(xc, yc)  # (3,): ⟨Kc, Lc⟩, ‖Kc‖², ‖Lc‖²
    if debiased:
        kd = xc.to(dtype).pow(2).sum(dim=1)  # (n,) diag of Kc
        ld = yc.to(dtype).pow(2).sum(dim=1)  # (n,) diag of Lc
        hxy = _hsic_debiased_centred(s[0], kd, ld, n)
        hxx = _hsic_debiased_centred(s[1], kd, kd, n)
        hyy = _hsic_debiased_centred(s[2], ld, ld, n)
    else:
        hxy, hxx, hyy = s.unbind()
    return _cka_from_hsic(hxy, hxx, hyy, eps)
