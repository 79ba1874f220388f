"""Per-layer pieces of the fused eNTK path: from a layer's input ``a`` and output gradient ``δ``
(both for a whole batch) to the kept coordinates of its per-sample parameter gradients.

Each plan is built once per (model, scope, p, seed, device) with its index vectors precomputed,
and writes straight into column slices of the (B, p) output. Its work comes as independent tasks
(column ranges of a Linear weight, sample tiles of a conv weight, a bias) that
:func:`hpcfl.entk.tasks.run_tasks` spreads over the CPU cores. For a weight whose kept coordinates
are all of it (``p = P``) the per-sample gradient is written without any gather; otherwise a cost
model picks, per layer, between

- **sparse**: the direct gathers of :mod:`triton_kernels` (Triton on CUDA, pure torch on CPU),
  work ∝ n·L per sample (n kept coordinates, L output positions), and
- **dense** (convolutions only): the layer's full per-sample weight gradient for a tile of
  samples (unfold + one bmm, work ∝ O·K·L), then a gather of the n kept entries.

Linear weights always use the gather: their dense per-sample gradient (B, O, I) costs O·I writes
per sample against 3n for the gather, and the gather wins unless n ≈ O·I, which is the "full" case.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hpcfl.entk.coords import ParamColumns
from triton_kernels import channel_sum_gather, conv2d_gather, linear_gather, norm_weight_gather

DENSE_TILE_ELEMS = 1 << 20
"""Elements of the per-tile temporaries of the dense conv path (unfolded input + per-sample
gradient, 4 MiB in float32): each tile is unfolded, multiplied and gathered while it is in cache
(simplecnn conv3, 256 samples, 1 thread: bmm + gather 17 ms in tiles of 8-32 samples, 25 ms in one
(256, 128, 576) block; unfolding the whole batch once instead of per tile was ~15% slower overall),
and a fresh 75 MB buffer per batch would cost more in page faults (~25 ms) than the bmm itself."""

# Cost model, in nanoseconds per sample for one layer. CPU constants fitted on the 2-core dev box
# (1 thread, MKL) over every conv layer of simplecnn, resnet8, resnet18 and vgg11 (p = 1e5 / 2e4):
# the dense path costs ~0.03 ns per bmm MAC plus ~0.3 ns per element of unfolded input and
# per-sample gradient streamed through cache, plus ~1 ns per gathered element; one term of the
# sparse gather-and-reduce costs ~1 ns (0.7-1.4 ns measured on vgg11/resnet-shaped layers, 1 thread,
# with its temporaries reused within a call; 2-3.4 ns before, when each chunk page-faulted in fresh
# ones). Examples (ms, dense vs sparse): simplecnn conv3, 28% of its weights kept, 256 samples:
# 18 vs 79; resnet8 layer3.0.conv2, 25% kept, 128 samples: 13 vs 53; a vgg11 512→512 conv at
# 4×4, 1% kept, 32 samples: sparse 16 ms. Where the model's two estimates are within ~20% the
# measured times were too.
# CUDA constants are estimates (no GPU in the dev environment): the Triton gather reads its
# operands from L2 at roughly memory speed, and a tensor-core bmm is far cheaper per MAC than a
# gathered load.
_COSTS = {
    "cpu": {"mac": 0.03, "mem": 0.3, "gather": 1.0, "sparse": 1.0},
    "cuda": {"mac": 0.001, "mem": 0.01, "gather": 0.02, "sparse": 0.02},
}


def conv_costs(
    *, n: int, out_channels: int, k: int, unfold_rows: int, length: int, device: torch.device
) -> tuple[float, float]:
    """(dense, sparse) estimated cost per sample of a conv weight with n kept coordinates.

    ``k`` = (C/G)·kh·kw columns of the weight, ``unfold_rows`` = C·kh·kw rows of the unfolded
    input, ``length`` = L output positions.
    """
    c = _COSTS["cuda" if device.type == "cuda" else "cpu"]
    dense = out_channels * k * length * c["mac"] + (unfold_rows * length + out_channels * k) * c["mem"]
    dense += n * c["gather"]
    sparse = n * length * c["sparse"]
    return dense, sparse


class Unsupported(Exception):
    """The fused path cannot handle this model; ``layer`` names the layer type, ``str`` the reason."""

    def __init__(self, layer: str, reason: str) -> None:
        super().__init__(reason)
        self.layer = layer


def _write(dst: Tensor, value: Tensor) -> None:
    dst.copy_(value)


Task = Callable[[], None]
"""One independent piece of a layer's work: it writes a part of the output no other task writes."""


@dataclass
class Workspace:
    """Reusable flat scratch buffers (page-faulting a fresh large buffer every batch is slow), one
    set per thread, so tasks running concurrently never share one."""

    buffers: dict[tuple[str, torch.dtype, torch.device, int], Tensor] = field(default_factory=dict)

    def get(self, key: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A 1-d buffer of at least ``numel`` elements for the calling thread (contents undefined)."""
        k = (key, dtype, device, threading.get_ident())
        buf = self.buffers.get(k)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.buffers[k] = buf
        return buf[:numel]


class LayerPlan:
    """Base of the per-layer plans: the parameter columns it fills."""

    columns: tuple[ParamColumns | None, ...] = ()

    def tasks(
        self, module: nn.Module, act: Tensor, delta: Tensor, out: Tensor, ws: Workspace, *, pieces: int
    ) -> list[Task]:
        """This layer's work as independent tasks (about ``pieces`` for the big parts of it) that
        together write its kept per-sample gradient coordinates into ``out`` (B, p)."""
        raise NotImplementedError

    def zero(self, out: Tensor) -> None:
        """Zero this layer's columns (the layer did not run, or its output does not reach the logit)."""
        for col in self.columns:
            if col is not None and col.n:
                out[:, col.col0 : col.col1].zero_()


def _on(t: Tensor | None, device: torch.device) -> Tensor | None:
    return None if t is None else t.to(device)


class LinearPlan(LayerPlan):
    """``nn.Linear`` on (B, I) inputs: weight g[b,j] = δ[b,o_j]·a[b,i_j]; bias g[b,j] = δ[b,o_j]."""

    def __init__(
        self, module: nn.Linear, weight: ParamColumns, bias: ParamColumns | None, device: torch.device
    ):
        self.columns = (weight, bias)
        self.shape = (module.out_features, module.in_features)
        width = module.in_features
        o = weight.local.div(width, rounding_mode="floor")
        self.o = o.to(device)  # (n,)
        self.i = weight.local.remainder(width).to(device)  # (n,)
        # where the output row o changes: the gather splits into pieces only at these positions
        self.row_starts = [0, *(torch.nonzero(o[1:] != o[:-1]).flatten() + 1).tolist()]
        self.bias_index = _on(bias.local, device) if bias is not None else None

    def _pieces(self, pieces: int) -> list[tuple[int, int]]:
        """≤ ``pieces`` column ranges of about equal size, cut at row boundaries."""
        weight = self.columns[0]
        assert weight is not None
        n, starts = weight.n, self.row_starts
        cuts = sorted({starts[min(len(starts) - 1, (len(starts) * k) // pieces)] for k in range(1, pieces)})
        bounds = [0, *(c for c in cuts if 0 < c < n), n]
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    def tasks(
        self, module: nn.Module, act: Tensor, delta: Tensor, out: Tensor, ws: Workspace, *, pieces: int
    ) -> list[Task]:
        if act.dim() != 2:
            raise Unsupported("Linear", f"Linear on {act.dim()}-d inputs (only (B, features) is fused)")
        weight, bias = self.columns
        work: list[Task] = []
        if weight is not None and weight.n:
            dst = out[:, weight.col0 : weight.col1]  # (B, n)
            if weight.full:  # p = P: the whole outer product, written in place, no gather
                work.append(lambda: self._outer(act, delta, dst))
            else:
                for j0, j1 in self._pieces(pieces):
                    work.append(
                        lambda j0=j0, j1=j1: linear_gather(
                            delta, act, self.o[j0:j1], self.i[j0:j1], out=dst[:, j0:j1]
                        )
                    )
        if bias is not None and bias.n:
            assert self.bias_index is not None
            dst_b = out[:, bias.col0 : bias.col1]
            index = None if bias.full else self.bias_index
            work.append(lambda: _write(dst_b, delta if index is None else delta.index_select(1, index)))
        return work

    def _outer(self, act: Tensor, delta: Tensor, dst: Tensor) -> None:
        view = dst.view(act.shape[0], *self.shape)  # (B, O, I)
        if view.dtype == act.dtype:
            torch.mul(delta[:, :, None], act[:, None, :], out=view)
        else:
            _write(view, delta[:, :, None] * act[:, None, :])


def _pair(v: int | tuple[int, ...]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def conv_padding(module: nn.Conv2d) -> tuple[int, int]:
    """Explicit symmetric zero padding of a Conv2d (``"same"`` only when symmetric)."""
    if module.padding_mode != "zeros":
        raise Unsupported("Conv2d", f"padding_mode={module.padding_mode!r} (only zero padding is fused)")
    if isinstance(module.padding, str):
        if module.padding == "valid":
            return (0, 0)
        total = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size, strict=True)]
        if any(t % 2 for t in total):
            raise Unsupported("Conv2d", "padding='same' with an even receptive field (asymmetric padding)")
        return (total[0] // 2, total[1] // 2)
    return _pair(module.padding)


def unfold(
    x: Tensor,
    kernel: tuple[int, int],
    dilation: tuple[int, int],
    padding: tuple[int, int],
    stride: tuple[int, int],
    out_hw: tuple[int, ...],
) -> Tensor:
    """``F.unfold`` as one strided copy of the padded input → (B, C·kh·kw, Ho·Wo).

    Same result as ``F.unfold``; 2-5× faster on CPU here (im2col runs one sample at a time,
    while the strided copy is one vectorised, multithreaded TensorIterator pass).
    """
    batch, channels = x.shape[:2]
    xp = F.pad(x, (padding[1], padding[1], padding[0], padding[0])) if any(padding) else x  # (B, C, Hp, Wp)
    sb, sc, sh, sw = xp.stride()
    h_out, w_out = int(out_hw[0]), int(out_hw[1])
    windows = xp.as_strided(
        (batch, channels, kernel[0], kernel[1], h_out, w_out),
        (sb, sc, sh * dilation[0], sw * dilation[1], sh * stride[0], sw * stride[1]),
    )  # (B, C, kh, kw, Ho, Wo) view
    return windows.reshape(batch, channels * kernel[0] * kernel[1], h_out * w_out)


def unfold_nhwc(
    x: Tensor,
    kernel: tuple[int, int],
    dilation: tuple[int, int],
    padding: tuple[int, int],
    stride: tuple[int, int],
    out_hw: tuple[int, ...],
) -> Tensor:
    """The unfolded input channels-last → (B, Ho·Wo, kh·kw·C), column (ky·kw + kx)·C + c."""
    batch, channels = x.shape[:2]
    xp = F.pad(x, (padding[1], padding[1], padding[0], padding[0])) if any(padding) else x
    xp = xp.permute(0, 2, 3, 1).contiguous()  # (B, Hp, Wp, C)
    sb, sh, sw, sc = xp.stride()
    h_out, w_out = int(out_hw[0]), int(out_hw[1])
    windows = xp.as_strided(
        (batch, h_out, w_out, kernel[0], kernel[1], channels),
        (sb, sh * stride[0], sw * stride[1], sh * dilation[0], sw * dilation[1], sc),
    )  # (B, Ho, Wo, kh, kw, C) view
    return windows.reshape(batch, h_out * w_out, kernel[0] * kernel[1] * channels)


class ConvPlan(LayerPlan):
    """``nn.Conv2d`` (any stride, padding, dilation, groups): weight by the dense or sparse path,
    bias g[b,j] = Σ_pos δ[b,o_j,pos]."""

    def __init__(
        self,
        module: nn.Conv2d,
        weight: ParamColumns,
        bias: ParamColumns | None,
        device: torch.device,
    ):
        self.columns = (weight, bias)
        self.stride, self.dilation = _pair(module.stride), _pair(module.dilation)
        self.padding = conv_padding(module)
        self.kernel = _pair(module.kernel_size)
        self.groups = module.groups
        out_c, cg, kh, kw = module.weight.shape
        self.out_channels, self.k = out_c, cg * kh * kw
        local = weight.local
        o = local.div(self.k, rounding_mode="floor")
        rem = local.remainder(self.k)
        c_local = rem.div(kh * kw, rounding_mode="floor")
        rem = rem.remainder(kh * kw)
        group = o.div(out_c // self.groups, rounding_mode="floor")
        self.o = o.to(device)  # (n,)
        self.chan = (group * cg + c_local).to(device)  # (n,) absolute input channel
        self.ky = rem.div(kw, rounding_mode="floor").to(device)  # (n,)
        self.kx = rem.remainder(kw).to(device)  # (n,)
        self.local = local.to(device)
        channels = cg * self.groups
        self.local_nhwc = (o * self.k + rem * channels + c_local).to(device)  # order (o, ky, kx, c)
        self.local_ko = (local.remainder(self.k) * out_c + o).to(device)  # order (c, ky, kx, o)
        self.bias_index = _on(bias.local, device) if bias is not None else None
        self.device = device
        self._mode: dict[int, str] = {}  # output positions L -> "dense" | "sparse"

    def mode(self, length: int, in_channels: int) -> str:
        """ "full", "dense" or "sparse" for this layer at L output positions (cost model)."""
        weight = self.columns[0]
        assert weight is not None
        if weight.full:
            return "full"
        if length not in self._mode:
            kh, kw = self.kernel
            dense, sparse = conv_costs(
                n=weight.n,
                out_channels=self.out_channels,
                k=self.k,
                unfold_rows=in_channels * kh * kw,
                length=length,
                device=self.device,
            )
            self._mode[length] = "dense" if dense < sparse else "sparse"
        return self._mode[length]

    def tasks(
        self, module: nn.Module, act: Tensor, delta: Tensor, out: Tensor, ws: Workspace, *, pieces: int
    ) -> list[Task]:
        weight, bias = self.columns
        batch, channels = act.shape[:2]
        length = delta.shape[2] * delta.shape[3]
        work: list[Task] = []
        if weight is not None and weight.n:
            dst = out[:, weight.col0 : weight.col1]  # (B, n)
            mode = self.mode(length, channels)
            if mode == "sparse":
                step = -(-batch // pieces)
                for b0 in range(0, batch, step):
                    work.append(
                        lambda b0=b0: self._sparse(
                            act[b0 : b0 + step], delta[b0 : b0 + step], dst[b0 : b0 + step]
                        )
                    )
            else:
                tile = self._tile(act, delta)
                for b0 in range(0, batch, tile):
                    b1 = min(batch, b0 + tile)
                    work.append(
                        lambda b0=b0, b1=b1: self._dense(act, delta, dst, ws, b0, b1, full=mode == "full")
                    )
        if bias is not None and bias.n:
            assert self.bias_index is not None
            dst_b = out[:, bias.col0 : bias.col1]
            work.append(
                lambda: channel_sum_gather(
                    delta.reshape(batch, self.out_channels, length), self.bias_index, out=dst_b
                )
            )
        return work

    def _sparse(self, act: Tensor, delta: Tensor, dst: Tensor) -> None:
        conv2d_gather(
            delta,
            act,
            self.o,
            self.chan,
            self.ky,
            self.kx,
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
            out=dst,
        )

    def _layout(self, channels: int, full: bool) -> str:
        """Operand layout of the dense bmm (all give the same numbers, in different orders).

        - ``"weight"``: δ (O, L) @ Uᵀ → (O, K), the weight's own order: for p = P (written with no
          gather) and grouped convolutions.
        - ``"nhwc"``: δ (O, L) @ U_nhwc (L, kh·kw·C) → order (o, ky, kx, c), from C ≥ 16 on: the
          channels-last unfold copies C contiguous values at a time (simplecnn conv3: 3.1 vs
          6.6 ms per 256 samples for the NCHW unfold).
        - ``"ko"``: U (K, L) @ δᵀ → order (c, ky, kx, o), for few input channels, where the NCHW
          unfold is 3-4× faster than the channels-last one and the bmm with the wide O as its
          last dimension 1.4-1.8× faster (simplecnn conv1: 1.2 vs 4.7 ms per 256 samples).
        """
        if full or self.groups != 1:
            return "weight"
        return "nhwc" if channels >= 16 else "ko"

    def _tile(self, act: Tensor, delta: Tensor) -> int:
        """Samples per tile of the dense path (its temporaries stay within ``DENSE_TILE_ELEMS``)."""
        channels = act.shape[1]
        length = delta.shape[2] * delta.shape[3]
        kh, kw = self.kernel
        per_sample = channels * kh * kw * length + self.out_channels * self.k  # unfolded input + gradient
        return max(1, min(act.shape[0], DENSE_TILE_ELEMS // per_sample))

    def _dense(
        self, act: Tensor, delta: Tensor, dst: Tensor, ws: Workspace, b0: int, b1: int, *, full: bool
    ) -> None:
        """Per-sample weight gradients of samples [b0, b1) by unfold + bmm, then gather."""
        channels = act.shape[1]
        groups, out_c, k = self.groups, self.out_channels, self.k
        out_hw = tuple(delta.shape[2:])
        length = out_hw[0] * out_hw[1]
        bt = b1 - b0
        scratch = ws.get("conv_dense", self._tile(act, delta) * out_c * k, act.dtype, act.device)
        layout = self._layout(channels, full)
        index = {"weight": self.local, "nhwc": self.local_nhwc, "ko": self.local_ko}[layout]
        geometry = (self.kernel, self.dilation, self.padding, self.stride, out_hw)
        unfold_fn = unfold_nhwc if layout == "nhwc" else unfold
        cols = unfold_fn(act[b0:b1], *geometry)  # (bt, L, kh·kw·C) or (bt, K, L)
        # (bt, L, O): a view for a channels-last δ, and (bt, O, L) transposed is one for NCHW
        d_lo = delta[b0:b1].permute(0, 2, 3, 1).reshape(bt, length, out_c)
        grads = scratch[: bt * out_c * k]
        if layout == "nhwc":  # cols (bt, L, kh·kw·C)
            torch.bmm(d_lo.transpose(1, 2), cols, out=grads.view(bt, out_c, k))  # (bt, O, kh·kw·C)
        elif layout == "ko":  # cols (bt, K, L)
            torch.bmm(cols, d_lo, out=grads.view(bt, k, out_c))  # (bt, K, O)
        else:
            cols = cols.reshape(bt * groups, k, length)  # (bt·G, K, L)
            d = delta[b0:b1].reshape(bt * groups, out_c // groups, length)  # (bt·G, O/G, L)
            torch.bmm(d, cols.transpose(1, 2), out=grads.view(bt * groups, out_c // groups, k))
        flat = grads.view(bt, out_c * k)  # (bt, O·K) in the layout's order
        _write(dst[b0:b1], flat if full else flat.index_select(1, index))


class NormPlan(LayerPlan):
    """BatchNorm1d/2d (eval, running statistics) and GroupNorm affine parameters:
    weight g[b,j] = Σ_pos δ·x̂ at channel c_j, bias g[b,j] = Σ_pos δ."""

    def __init__(
        self, module: nn.Module, weight: ParamColumns | None, bias: ParamColumns | None, device: torch.device
    ):
        self.columns = (weight, bias)
        self.weight_index = _on(weight.local, device) if weight is not None else None
        self.bias_index = _on(bias.local, device) if bias is not None else None

    @staticmethod
    def statistics(module: nn.Module, act: Tensor) -> tuple[Tensor, Tensor]:
        """(mean, rstd), each (B, C) (expanded views for BatchNorm), of the normalisation."""
        batch, channels = act.shape[:2]
        if isinstance(module, nn.GroupNorm):
            groups = module.num_groups
            var, mean = torch.var_mean(act.reshape(batch, groups, -1), dim=2, unbiased=False)  # (B, G)
            rstd = torch.rsqrt(var + module.eps)
            reps = channels // groups
            return mean.repeat_interleave(reps, dim=1), rstd.repeat_interleave(reps, dim=1)  # (B, C)
        assert isinstance(module, nn.modules.batchnorm._BatchNorm)
        assert module.running_mean is not None and module.running_var is not None
        mean = module.running_mean.to(act.dtype)
        rstd = torch.rsqrt(module.running_var.to(act.dtype) + module.eps)
        return mean.expand(batch, channels), rstd.expand(batch, channels)

    def tasks(
        self, module: nn.Module, act: Tensor, delta: Tensor, out: Tensor, ws: Workspace, *, pieces: int
    ) -> list[Task]:
        return [lambda: self._apply(module, act, delta, out)]

    def _apply(self, module: nn.Module, act: Tensor, delta: Tensor, out: Tensor) -> None:
        weight, bias = self.columns
        batch, channels = act.shape[:2]
        d3 = delta.reshape(batch, channels, -1)  # (B, C, L)
        if weight is not None and weight.n:
            assert self.weight_index is not None
            mean, rstd = self.statistics(module, act)
            x3 = act.reshape(batch, channels, -1)  # (B, C, L)
            norm_weight_gather(d3, x3, mean, rstd, self.weight_index, out=out[:, weight.col0 : weight.col1])
        if bias is not None and bias.n:
            assert self.bias_index is not None
            channel_sum_gather(d3, self.bias_index, out=out[:, bias.col0 : bias.col1])
