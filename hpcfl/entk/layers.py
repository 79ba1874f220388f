"""Per-layer pieces of the fused eNTK path: from a layer's input ``a`` and output gradient ``δ``
(both for a whole batch) to the kept coordinates of its per-sample parameter gradients.

Each plan is built once per (model, scope, p, seed, device) with its index vectors precomputed,
and writes straight into column slices of the (B, p) output. Its work comes as independent tasks
(column ranges of a Linear weight, sample tiles of a conv weight, a bias) that
:func:`hpcfl.entk.tasks.run_tasks` spreads over the CPU cores. For a weight whose kept coordinates
are all of it (``p = P``) the per-sample gradient is written without any gather (``"full"``);
otherwise a cost model (:func:`choose_layer_form`) picks, per Linear or Conv2d weight, one of the
two :data:`Form`\\ s

- ``"gather"``: the direct gathers of :mod:`triton_kernels` (Triton on CUDA, pure torch on CPU),
  work ∝ n·L per sample (n kept coordinates, L output positions; L = 1 for a Linear), and
- ``"materialise"``: the layer's whole per-sample weight gradient for a tile of samples by ONE
  batched matrix product (Linear: δ_b a_bᵀ, (B, O, I); Conv2d: δ_b·unfold(x_b)ᵀ, work ∝ O·K·L),
  then one ``index_select`` of the n kept entries.

On the CPU the model's constants make every Linear gather (its materialised gradient costs O·I
writes per sample against n gathered products) and a conv materialise where its unfolded products
are cheaper than n·L gathered terms. The CUDA constants are estimates until
``benchmarks/entk_layer_costs.py --device cuda`` fits them; a plan's ``form=`` forces one form.

On a CPU where the compiled kernel of :mod:`hpcfl.entk.native` is usable (AVX-512 and a C compiler,
``entk.native`` on), float32 Linear and Conv2d (groups 1) weights have a third form, ``"native"``:
one pass per sample range that forms the per-sample gradient in registers and stores only the kept
entries. Its cost (:func:`hpcfl.entk.costs.native_cost`) grows with the whole weight, not with n, so
the cost model takes it where many coordinates of a layer are kept.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hpcfl.entk import native
from hpcfl.entk.coords import ParamColumns
from hpcfl.entk.costs import (
    FORCEABLE,
    NATIVE,
    Form,
    choose_layer_form,
    choose_whole_form,
    materialise_tile,
)
from triton_kernels import channel_sum_gather, conv2d_gather, linear_gather, norm_weight_gather


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
    matrix: tuple[int, int] = (0, 0)
    """The weight as an (O, K) matrix (Linear and Conv2d plans): the native kernel's rows and columns."""
    _kept: native.KeptMasks | None = None

    @property
    def kept(self) -> native.KeptMasks:
        """The weight's kept coordinates as the native kernel's row masks (built on first use)."""
        if self._kept is None:
            weight = self.columns[0]
            assert weight is not None
            self._kept = native.KeptMasks.of(weight.local, *self.matrix)
        return self._kept

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


def _check_form(form: str | None) -> Form | None:
    if form is not None and form not in FORCEABLE:
        raise ValueError(f"unknown eNTK layer form {form!r} (one of {FORCEABLE})")
    return form  # type: ignore[return-value]


def _sample_ranges(batch: int, pieces: int) -> list[tuple[int, int]]:
    """≤ ``pieces`` ranges of about equal size covering [0, batch)."""
    step = -(-batch // max(1, pieces))
    return [(b0, min(batch, b0 + step)) for b0 in range(0, batch, step)]


class LinearPlan(LayerPlan):
    """``nn.Linear`` on (B, I) inputs: weight g[b,j] = δ[b,o_j]·a[b,i_j] by the gather, or by picking
    the kept entries of the materialised δ_b a_bᵀ (B, O, I); bias g[b,j] = δ[b,o_j].

    ``form`` forces ``"gather"`` or ``"materialise"`` for a weight not kept whole (tests, the cost
    fit); None lets :func:`choose_layer_form` decide."""

    def __init__(
        self,
        module: nn.Linear,
        weight: ParamColumns,
        bias: ParamColumns | None,
        device: torch.device,
        *,
        form: Form | None = None,
    ):
        self.columns = (weight, bias)
        self.shape = self.matrix = (module.out_features, module.in_features)
        width = module.in_features
        o = weight.local.div(width, rounding_mode="floor")
        self.o = o.to(device)  # (n,)
        self.i = weight.local.remainder(width).to(device)  # (n,)
        self.local = weight.local.to(device)  # (n,) into the flat (O·I) per-sample gradient
        # where the output row o changes: the gather splits into pieces only at these positions
        self.row_starts = [0, *(torch.nonzero(o[1:] != o[:-1]).flatten() + 1).tolist()]
        self.bias_index = _on(bias.local, device) if bias is not None else None
        self.device = device
        self.forced = _check_form(form)
        self._form: dict[tuple[int, int, bool], Form] = {}  # (B, L, native usable) -> chosen form

    def form(self, batch: int, *, dtype: torch.dtype = torch.float32, length: int = 1) -> Form:
        """``"full"``, ``"gather"``, ``"materialise"`` or ``"native"`` for this weight at ``batch``
        samples of ``dtype`` (``length`` > 1: positions of a sequence, where the torch path is one
        batched product and a pick, and the choice is between it and ``"native"``)."""
        weight = self.columns[0]
        assert weight is not None
        if weight.full:
            return "full"
        if self.forced is not None:
            return self.forced
        usable = dtype == torch.float32 and native.usable(self.device)
        key = (batch, length, usable)
        if key not in self._form:
            out_features, in_features = self.shape
            self._form[key] = choose_layer_form(
                batch=batch,
                n=weight.n,
                out_channels=out_features,
                k=in_features,
                unfold_rows=0,
                length=length,
                device_type=self.device.type,
                native=usable,
            )
        return self._form[key]

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
        if act.dim() == 3:  # (B, L, I): a sequence, per-sample gradients summed over positions
            return self._sequence_tasks(act, delta, out, pieces)
        if act.dim() != 2:
            raise Unsupported(
                "Linear", f"Linear on {act.dim()}-d inputs (only (B, I) and (B, L, I) are fused)"
            )
        weight, bias = self.columns
        work: list[Task] = []
        if weight is not None and weight.n:
            dst = out[:, weight.col0 : weight.col1]  # (B, n)
            form = self.form(act.shape[0], dtype=act.dtype)
            if form == "full":  # p = P: the whole outer product, written in place, no gather
                work.append(lambda: self._outer(act, delta, dst))
            elif form == NATIVE:
                d, u, kept = delta[:, :, None], act[:, None, :], self.kept  # (B, O, 1), (B, 1, I)
                for b0, b1 in _sample_ranges(act.shape[0], pieces):
                    work.append(
                        lambda b0=b0, b1=b1: native.masked_product(d[b0:b1], u[b0:b1], kept, dst[b0:b1])
                    )
            elif form == "materialise":
                batch = act.shape[0]
                tile = materialise_tile(batch, self.shape[0] * self.shape[1], self.device.type)
                for b0 in range(0, batch, tile):
                    work.append(
                        lambda b0=b0: self._materialise(act, delta, dst, ws, b0, min(batch, b0 + tile), tile)
                    )
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

    def _sequence_tasks(self, act: Tensor, delta: Tensor, out: Tensor, pieces: int) -> list[Task]:
        weight, bias = self.columns
        batch = act.shape[0]
        if weight is None or weight.full or self.form(batch, dtype=act.dtype, length=act.shape[1]) != NATIVE:
            return [lambda: _sequence_linear(self, act, delta, out)]
        dst = out[:, weight.col0 : weight.col1]
        d, kept = delta.transpose(1, 2), self.kept  # (B, O, L); the masks built here, not in the tasks
        work: list[Task] = [
            lambda b0=b0, b1=b1: native.masked_product(d[b0:b1], act[b0:b1], kept, dst[b0:b1])
            for b0, b1 in _sample_ranges(batch, pieces)
        ]
        if bias is not None and bias.n:
            work.append(lambda: _sequence_linear_bias(self, delta, out))
        return work

    def _outer(self, act: Tensor, delta: Tensor, dst: Tensor) -> None:
        view = dst.view(act.shape[0], *self.shape)  # (B, O, I)
        if view.dtype == act.dtype:
            torch.mul(delta[:, :, None], act[:, None, :], out=view)
        else:
            _write(view, delta[:, :, None] * act[:, None, :])

    def _materialise(
        self, act: Tensor, delta: Tensor, dst: Tensor, ws: Workspace, b0: int, b1: int, tile: int
    ) -> None:
        """Per-sample weight gradients of samples [b0, b1) as ONE batched product δ_b a_bᵀ, then
        one pick of the kept entries."""
        out_features, in_features = self.shape
        bt = b1 - b0
        scratch = ws.get("linear_materialise", tile * out_features * in_features, act.dtype, act.device)
        grads = scratch[: bt * out_features * in_features].view(bt, out_features, in_features)
        torch.bmm(delta[b0:b1, :, None], act[b0:b1, None, :], out=grads)  # (bt, O, I)
        _write(dst[b0:b1], grads.view(bt, -1).index_select(1, self.local))  # (bt, n)


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
    """``nn.Conv2d`` (any stride, padding, dilation, groups): weight by the gather or the
    materialise form, bias g[b,j] = Σ_pos δ[b,o_j,pos].

    ``form`` forces ``"gather"`` or ``"materialise"`` for a weight not kept whole (tests, the cost
    fit); None lets :func:`choose_layer_form` decide."""

    def __init__(
        self,
        module: nn.Conv2d,
        weight: ParamColumns,
        bias: ParamColumns | None,
        device: torch.device,
        *,
        form: Form | None = None,
    ):
        self.columns = (weight, bias)
        self.stride, self.dilation = _pair(module.stride), _pair(module.dilation)
        self.padding = conv_padding(module)
        self.kernel = _pair(module.kernel_size)
        self.groups = module.groups
        out_c, cg, kh, kw = module.weight.shape
        self.out_channels, self.k = out_c, cg * kh * kw
        self.matrix = (out_c, self.k)
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
        self.forced = _check_form(form)
        self._form: dict[tuple[int, int, int, bool], Form] = {}  # (B, L, C, native usable) -> form
        self.geometry = native.ConvGeometry(self.kernel, self.stride, self.padding, self.dilation)

    def form(self, batch: int, length: int, in_channels: int, *, dtype: torch.dtype = torch.float32) -> Form:
        """``"full"``, ``"gather"``, ``"materialise"`` or ``"native"`` for this weight at ``batch``
        samples of ``dtype`` and L output positions (the cost model, with the native form among the
        candidates where the kernel is usable: float32, groups 1, whole weights included; unless
        ``form=`` forced a form for a weight not kept whole)."""
        weight = self.columns[0]
        assert weight is not None
        if self.forced is not None:  # a whole weight stays whole unless the kernel is forced
            return "full" if weight.full and self.forced != NATIVE else self.forced
        usable = self.groups == 1 and dtype == torch.float32 and native.usable(self.device)
        key = (batch, length, in_channels, usable)
        if key not in self._form:
            kh, kw = self.kernel
            dims = dict(
                batch=batch,
                out_channels=self.out_channels,
                k=self.k,
                unfold_rows=in_channels * kh * kw,
                length=length,
                device_type=self.device.type,
                native=usable,
            )
            self._form[key] = (
                choose_whole_form(**dims) if weight.full else choose_layer_form(n=weight.n, **dims)
            )
        return self._form[key]

    def tasks(
        self, module: nn.Module, act: Tensor, delta: Tensor, out: Tensor, ws: Workspace, *, pieces: int
    ) -> list[Task]:
        weight, bias = self.columns
        batch, channels = act.shape[:2]
        length = delta.shape[2] * delta.shape[3]
        work: list[Task] = []
        if weight is not None and weight.n:
            dst = out[:, weight.col0 : weight.col1]  # (B, n)
            form = self.form(batch, length, channels, dtype=act.dtype)
            if form == NATIVE:
                kept = self.kept  # built here, not in the tasks
                for b0, b1 in _sample_ranges(batch, pieces):
                    work.append(
                        lambda b0=b0, b1=b1: self._native(act[b0:b1], delta[b0:b1], dst[b0:b1], ws, kept)
                    )
            elif form == "gather":
                step = -(-batch // pieces)
                for b0 in range(0, batch, step):
                    work.append(
                        lambda b0=b0: self._gather(
                            act[b0 : b0 + step], delta[b0 : b0 + step], dst[b0 : b0 + step]
                        )
                    )
            else:
                tile = self._tile(act, delta)
                for b0 in range(0, batch, tile):
                    b1 = min(batch, b0 + tile)
                    work.append(
                        lambda b0=b0, b1=b1: self._materialise(
                            act, delta, dst, ws, b0, b1, full=form == "full"
                        )
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

    def _native(self, act: Tensor, delta: Tensor, dst: Tensor, ws: Workspace, kept: native.KeptMasks) -> None:
        scratch = ws.get("conv_native", delta.shape[2] * delta.shape[3] * self.k, torch.float32, act.device)
        native.conv_masked_product(act, delta, self.geometry, kept, dst, scratch)

    def _gather(self, act: Tensor, delta: Tensor, dst: Tensor) -> None:
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
        """Operand layout of the materialise bmm (all give the same numbers, in different orders).

        - ``"weight"``: δ (O, L) @ Uᵀ → (O, K), the weight's own order: for p = P (written with no
          gather), grouped convolutions, and off the CPU (the two below are CPU measurements; on a
          GPU the activations are NCHW and the NCHW unfold is one strided copy; unmeasured there).
        - ``"nhwc"``: δ (O, L) @ U_nhwc (L, kh·kw·C) → order (o, ky, kx, c), from C ≥ 16 on: the
          channels-last unfold copies C contiguous values at a time (simplecnn conv3: 3.1 vs
          6.6 ms per 256 samples for the NCHW unfold).
        - ``"ko"``: U (K, L) @ δᵀ → order (c, ky, kx, o), for few input channels, where the NCHW
          unfold is 3-4× faster than the channels-last one and the bmm with the wide O as its
          last dimension 1.4-1.8× faster (simplecnn conv1: 1.2 vs 4.7 ms per 256 samples).
        """
        if full or self.groups != 1 or self.device.type != "cpu":
            return "weight"
        return "nhwc" if channels >= 16 else "ko"

    def _tile(self, act: Tensor, delta: Tensor) -> int:
        """Samples per tile of the materialise path (:func:`materialise_tile`)."""
        channels = act.shape[1]
        length = delta.shape[2] * delta.shape[3]
        kh, kw = self.kernel
        per_sample = channels * kh * kw * length + self.out_channels * self.k  # unfolded input + gradient
        return materialise_tile(act.shape[0], per_sample, self.device.type)

    def _materialise(
        self, act: Tensor, delta: Tensor, dst: Tensor, ws: Workspace, b0: int, b1: int, *, full: bool
    ) -> None:
        """Per-sample weight gradients of samples [b0, b1) by unfold + ONE bmm, then one pick of the
        kept entries (all of them, in place, for p = P)."""
        channels = act.shape[1]
        groups, out_c, k = self.groups, self.out_channels, self.k
        out_hw = tuple(delta.shape[2:])
        length = out_hw[0] * out_hw[1]
        bt = b1 - b0
        scratch = ws.get("conv_materialise", self._tile(act, delta) * out_c * k, act.dtype, act.device)
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
            # each group's value for its C/G channels by an explicit expand: sync-free in any PyTorch
            # (repeat_interleave's tensor-repeats form reads its output size back to the host, which
            # a CUDA-graph capture cannot do)
            return (
                mean[:, :, None].expand(batch, groups, reps).reshape(batch, channels),
                rstd[:, :, None].expand(batch, groups, reps).reshape(batch, channels),
            )  # (B, C)
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


def _pick(full: Tensor, col: ParamColumns, index: Tensor | None, out: Tensor) -> None:
    """Write the kept columns of a per-sample gradient ``full`` (B, numel) into ``out``."""
    dst = out[:, col.col0 : col.col1]
    _write(dst, full if col.full or index is None else full.index_select(1, index))


def _sequence_linear(plan: LinearPlan, act: Tensor, delta: Tensor, out: Tensor) -> None:
    """``nn.Linear`` on (B, L, I): weight g_b = Σ_pos δ_b,posᵀ a_b,pos = (δ_bᵀ a_b), one batched
    product (B, O, I) then the kept entries; bias g_b = Σ_pos δ_b,pos. (Attention's projections and
    a Transformer's MLP are Linears on sequences.)"""
    weight, bias = plan.columns
    if weight is not None and weight.n:
        full = torch.bmm(delta.transpose(1, 2), act).reshape(act.shape[0], -1)  # (B, O·I)
        _pick(full, weight, plan.local, out)
    _sequence_linear_bias(plan, delta, out)


def _sequence_linear_bias(plan: LinearPlan, delta: Tensor, out: Tensor) -> None:
    """The bias part of :func:`_sequence_linear`: g_b = Σ_pos δ_b,pos."""
    bias = plan.columns[1]
    if bias is not None and bias.n:
        _pick(delta.sum(1), bias, plan.bias_index, out)


class EmbeddingPlan(LayerPlan):
    """``nn.Embedding`` (no max_norm, no sparse gradients): the per-sample weight gradient of
    sample b is Σ_pos onehot(x_b,pos) ⊗ δ_b,pos, (V, D), by one batched product of the one-hot
    rows with δ; then the kept entries. Inputs (B,) or (B, L) of indices."""

    def __init__(self, module: nn.Embedding, weight: ParamColumns, device: torch.device):
        if module.max_norm is not None or module.sparse:
            raise Unsupported("Embedding", "an Embedding with max_norm or sparse gradients")
        self.columns = (weight,)
        self.vocab = module.num_embeddings
        self.padding_idx = module.padding_idx
        self.index = weight.local.to(device)

    def tasks(
        self, module: nn.Module, act: Tensor, delta: Tensor, out: Tensor, ws: Workspace, *, pieces: int
    ) -> list[Task]:
        return [lambda: self._apply(act, delta, out)]

    def _apply(self, act: Tensor, delta: Tensor, out: Tensor) -> None:
        (weight,) = self.columns
        if not weight.n:
            return
        batch = act.shape[0]
        idx = act.reshape(batch, -1).long()  # (B, L)
        d = delta.reshape(batch, idx.shape[1], -1)  # (B, L, D)
        onehot = F.one_hot(idx, self.vocab).to(d.dtype)  # (B, L, V)
        if self.padding_idx is not None:  # the padding row gets no gradient
            onehot[..., self.padding_idx] = 0
        full = torch.bmm(onehot.transpose(1, 2), d).reshape(batch, -1)  # (B, V·D)
        _pick(full, weight, self.index, out)


class LayerNormPlan(LayerPlan):
    """``nn.LayerNorm`` over the last dimension (elementwise affine): weight g[b,j] = Σ_pos δ·x̂ and
    bias g[b,j] = Σ_pos δ, at feature j (x̂ recomputed from the recorded input)."""

    def __init__(
        self,
        module: nn.LayerNorm,
        weight: ParamColumns | None,
        bias: ParamColumns | None,
        device: torch.device,
    ):
        if len(module.normalized_shape) != 1:
            raise Unsupported("LayerNorm", "a LayerNorm over more than the last dimension")
        self.columns = (weight, bias)
        self.weight_index = _on(weight.local, device) if weight is not None else None
        self.bias_index = _on(bias.local, device) if bias is not None else None

    def tasks(
        self, module: nn.Module, act: Tensor, delta: Tensor, out: Tensor, ws: Workspace, *, pieces: int
    ) -> list[Task]:
        return [lambda: self._apply(module, act, delta, out)]

    def _apply(self, module: nn.Module, act: Tensor, delta: Tensor, out: Tensor) -> None:
        assert isinstance(module, nn.LayerNorm)
        weight, bias = self.columns
        batch, features = act.shape[0], act.shape[-1]
        d = delta.reshape(batch, -1, features)  # (B, L, D)
        if weight is not None and weight.n:
            # x̂ by the LayerNorm kernel itself without the affine part: one fused pass, and the
            # same statistics the forward used (var_mean + sub + mul + rsqrt cost ~8× as much on CPU)
            x_hat = F.layer_norm(act.reshape(batch, -1, features), (features,), eps=module.eps)
            _pick((d * x_hat).sum(1), weight, self.weight_index, out)
        if bias is not None and bias.n:
            _pick(d.sum(1), bias, self.bias_index, out)
