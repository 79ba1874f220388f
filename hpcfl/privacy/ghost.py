"""Per-sample clipping by book-keeping (Bu et al. 2023): ONE forward and ONE backward of the batch's
summed loss, no per-sample autograd and no second backward.

The forward records each layer's input A and output; one ``torch.autograd.grad`` of the summed loss
asks for the layers' OUTPUT gradients G only (the backward computes input gradients along the way,
never a weight gradient). From (A, G) every layer gives its part of each sample's squared gradient
norm, then, once the clip factors c_i = min(1, C/(‖g_i‖ + eps)) are known, the clipped sum Σ_i c_i·g_i
of its parameters as one weighted product:

- ``Linear`` (2-D input): the per-sample weight gradient is g_i a_iᵀ, so ‖·‖² = ‖g_i‖²‖a_i‖² (Li et
  al. 2022's ghost norm) and the clipped sum is (c∘G)ᵀA; the bias's is g_i.
- ``Conv2d`` (any stride, padding, dilation, groups and padding mode): with U_i (d×T) the unfolded
  input of sample i and G_i (p×T) its output gradient (per group), the weight gradient is G_iU_iᵀ.
  Its squared norm takes one of three forms (:data:`ConvForm`), chosen per layer by cost
  (:func:`choose_conv_form`, Bu et al. 2023's hybrid rule with a third form): the ghost norm
  ⟨U_iᵀU_i, G_iᵀG_i⟩ from the unfolded input (``ghost-unfold``, O(T²(d+p))) or, for a stride-1
  convolution, from the Gram of the padded input's positions without unfolding (``ghost-shift``,
  :func:`_ghost_shift_sq`) — the clipped sum is then the conv's ordinary weight gradient of the
  rescaled output gradient c∘G, one convolution backward — or the norm of the materialised G_iU_iᵀ
  (``materialise``: formed by ONE convolution backward with the batch folded into the groups, or,
  for a narrow ungrouped conv, one batched product with the unfolded input (:data:`UNFOLD_MAX_D`);
  the clipped sum is then Σ_i c_i·(G_iU_iᵀ), or, when they are too large to hold
  (:data:`HOLD_BYTES`), the ordinary weight gradient of c∘G). The bias's is Σ_t G_i.
- ``GroupNorm`` (affine): per-channel sums Σ_hw x̂·g (weight) and Σ_hw g (bias), the first as
  rstd·(Σ_hw a·g − mean·Σ_hw g) from the statistics the forward saved, x̂ never formed.

- ``Linear`` on sequences (B, L, in), ``Embedding`` and ``LayerNorm`` (last dimension): per-sample
  gradients summed over positions, materialised (B, ·) by one batched product each (a small
  Transformer's layers), then their norms and Σ_i c_i·g_i.

Supported: models whose trainable parameters all belong to such modules, each called once per
forward and its output not modified in place, with the default cross-entropy loss. :func:`supported`
tells; anything else raises ``NotImplementedError`` before the backward and
:func:`hpcfl.privacy.sgd.clipped_grad_sum` falls back to ``vmap``. Equal to Opacus's
``GradSampleModule`` + clipping, and to ``vmap`` per-sample gradients, to 1e-10 in float64
(tests/test_privacy.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

_LAYERS = (nn.Linear, nn.Conv2d, nn.GroupNorm, nn.Embedding, nn.LayerNorm)

MATERIALISE_COST = 40.0
"""Cost of one element of a materialised per-sample weight gradient (the batch folded into the groups
of one convolution backward, then read for the norm and the weighted sum) in multiply-adds of the
ghost norms' Gram products, as timed on this project's 2-core CPU (2 threads, batch 256 on 28×28,
malloc kept from returning memory so that page faults do not time the allocator). The one close
call is resnet8's and simplecnn's strided 32→64 convolution onto 7×7 maps, which 40 materialises
and the earlier 64 unfolded: alone 7.1 against 9.3 ms, and whole resnet8-GN DP steps, interleaved
in separate processes, 122.7 and 126.6 ms against 127.6 and 133.2 ms."""

HOLD_BYTES = 16 << 20
"""Materialised per-sample weight gradients larger than this (a batch's) are not held until the clip
factors are known: they are formed ``CHUNK_BYTES`` at a time, reduced to their norms and dropped, and
the layer's clipped sum is its ordinary weight gradient of c∘G instead of Σ_i c_i·W_i. Under glibc's
default malloc holding them (19 MB for a 32→64 3×3 convolution at batch 256) grew the step's heap
past the trim threshold, so each step faulted them in again: simplecnn's DP step 42-44 → 36-37 ms and
its page faults 14k → 7k a step with chunks, interleaved in separate processes; unchanged (27.5 against
27.9 ms) with malloc keeping freed memory, and resnet8-GN within its processes' ±15 % heap luck."""

CHUNK_BYTES = 4 << 20
"""The size of one chunk of materialised per-sample gradients (see :data:`HOLD_BYTES`)."""

UNFOLD_MAX_D = 64
"""An ungrouped Conv2d with at most this many inputs per output (d = in·kh·kw) materialises its
per-sample gradients as G_i·U_iᵀ from the unfolded input (small: d·T per sample) in one batched
product; wider ones by the batch-grouped convolution backward. Timed at batch 256 (2 threads):
d = 9, 16, 25, 32 (the 1-channel first layers of resnet8, simplecnn, cnn-proj; 1×1 shortcuts)
0.4-2.5× faster by the product (cnn-proj's 5×5 first layer 7.6 → 1.5 ms), d = 144 to 576
1.4-3.7× slower."""

ConvForm = Literal["ghost-unfold", "ghost-shift", "materialise"]
"""How a Conv2d's weight norms are computed (:func:`_conv`)."""

Finish = Callable[[torch.Tensor], dict[int, torch.Tensor]]
"""Given the clip factors (B,), a layer's clipped sums by ``id`` of its trainable parameters."""


def supported(model: nn.Module) -> bool:
    """Whether every trainable parameter is owned by a Linear, Conv2d, GroupNorm, Embedding or
    LayerNorm module."""
    return not unsupported_layers(model)


def unsupported_layers(model: nn.Module) -> list[str]:
    """The type names of the modules owning trainable parameters that this path does not cover
    (sorted, each once): what the fallback's note names."""
    names = {type(m).__name__ for m in model.modules() if _owns_trainable(m) and not isinstance(m, _LAYERS)}
    return sorted(names)


def _owns_trainable(m: nn.Module) -> bool:
    return any(p.requires_grad for p in m.parameters(recurse=False))


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_j a[i, ...]·b[i, ...] per row i (``linalg.vecdot``: a multiply-and-sum, 5× faster than the
    batched 1×N·N×1 product it replaced on (256, 16, 784) GroupNorm inputs)."""
    B = a.shape[0]
    return torch.linalg.vecdot(a.reshape(B, -1), b.reshape(B, -1))


def _rowsq(a: torch.Tensor) -> torch.Tensor:
    """Σ_j a[i, ...]² per row i, as the squared 2-norm: one fused reduction, no temporary (2× faster
    than :func:`_rowdot` of ``a`` with itself on materialised per-sample gradients)."""
    return torch.linalg.vector_norm(a.reshape(a.shape[0], -1), dim=1).square()


def _trainable_params(m: nn.Module) -> list[nn.Parameter]:
    """``m``'s own parameters that are trained."""
    return [p for p in m.parameters(recurse=False) if p.requires_grad]


def _trainable(m: nn.Module, name: str) -> torch.Tensor | None:
    """``m.<name>`` if it is a trained parameter, else None (absent bias, frozen weight)."""
    p = getattr(m, name, None)
    return p if isinstance(p, nn.Parameter) and p.requires_grad else None


def conv_form_costs(m: nn.Conv2d, positions: int, out_hw: tuple[int, ...]) -> dict[ConvForm, float]:
    """Each weight-norm form's per-sample cost for one Conv2d (see :func:`choose_conv_form`)."""
    d = m.weight[0].numel()
    p = m.out_channels // m.groups
    T = positions
    cost: dict[ConvForm, float] = {
        "materialise": MATERIALISE_COST * d * p,
        "ghost-unfold": float(T * T * (d + p)),
    }
    if tuple(m.stride) == (1, 1):
        (kh, kw), (dh, dw) = m.kernel_size, m.dilation
        Wp = out_hw[1] + dw * (kw - 1)
        Lp, L = (out_hw[0] + dh * (kh - 1) + 1) * Wp, out_hw[0] * Wp
        cost["ghost-shift"] = float(Lp * Lp * (m.in_channels // m.groups) + L * L * (p + kh * kw))
    return cost


def choose_conv_form(m: nn.Conv2d, positions: int, out_hw: tuple[int, ...]) -> ConvForm:
    """The cheapest weight-norm form of one Conv2d whose output map is ``out_hw`` (``positions`` =
    T = its area), by per-sample cost in Gram multiply-adds (d = in/groups·kh·kw, p = out/groups):
    ``materialise`` :data:`MATERIALISE_COST`·d·p; ``ghost-unfold`` T²(d+p); ``ghost-shift`` (stride
    1 only) L_p²·in/groups + L²·(p + kh·kw) over L_p ≈ (Ho + dh(kh−1) + 1)·Wp padded input and
    L = Ho·Wp output positions, Wp the padded width. Timed on this rule's choices (resnet8,
    simplecnn, cnn-proj on 28×28; ResNet-18 widths on 32×32): the 28×28 and 14×14 maps and 1×1
    shortcuts materialise and so do the strided 3×3 convolutions onto 7×7 maps (see
    :data:`MATERIALISE_COST`); simplecnn's strided 64→128 onto 4×4 takes ghost-unfold (5.7 ms
    against 78 ms materialised); the stride-1 3×3 convolutions of 64 to 512 channels on 7×7, 8×8
    and 4×4 maps take ghost-shift (1.1-2.0× faster there than ghost-unfold, which unfolds 9× the
    input). The one near-tie mis-chosen among 18 layers:
    128 channels on 16×16 materialise (55 ms) where ghost-shift takes 49 ms."""
    cost = conv_form_costs(m, positions, out_hw)
    return min(cost, key=cost.__getitem__)


def _padded(m: nn.Conv2d, a: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The conv's input and the zero padding still to apply: a non-zero padding mode or a 'same'
    padding is applied here, as the module applies it."""
    if m.padding_mode != "zeros" or isinstance(m.padding, str):
        mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
        return F.pad(a, m._reversed_padding_repeated_twice, mode=mode), (0, 0)
    return a, tuple(m.padding)  # type: ignore[arg-type]


def _weight_grad(
    m: nn.Conv2d, a: torch.Tensor, g: torch.Tensor, padding: tuple[int, ...], *, per_sample: bool
) -> torch.Tensor:
    """The conv's weight gradient from its (padded) input ``a`` (B, in, H, W) and output gradient
    ``g`` (B, out, H', W') by the backend's convolution backward (no unfold): summed over the batch,
    or per sample ((B·out, in/groups, kh, kw)) by folding the batch into the groups of ONE
    convolution (sample b's group j is group b·groups + j)."""
    weight = m.weight.detach()
    groups = m.groups
    if per_sample:
        B = a.shape[0]
        weight = weight.expand(B, *weight.shape).reshape(-1, *weight.shape[1:])  # (B·out, in/groups, k)
        a = a.reshape(1, -1, *a.shape[2:])  # (1, B·in, H, W)
        g = g.reshape(1, -1, *g.shape[2:])  # (1, B·out, H', W')
        groups *= B
    return torch.ops.aten.convolution_backward(
        g, a, weight, None, m.stride, padding, m.dilation, False, [0, 0], groups, [False, True, False]
    )[1]


def _unfold(
    m: nn.Conv2d, a: torch.Tensor, padding: tuple[int, ...], *, by_position: bool = False
) -> torch.Tensor:
    """``F.unfold``'s (B, in·kh·kw, T) of the conv's input (zero ``padding`` still to apply), as ONE
    strided copy of the padded input (``F.unfold`` loops over the batch: 1.2-2× slower here); or,
    ``by_position``, (B, T, kh·kw·in) from a channels-last copy — each row's entries in (tap, channel)
    order, not the weight's, which a Gram over positions does not see; its copies run along whole
    channel vectors (1.3-2.7× faster than the channel-major gather on 7×7 and 14×14 maps)."""
    ph, pw = padding
    ap = F.pad(a, (pw, pw, ph, ph)) if ph or pw else a
    B, C, H, W = ap.shape
    (kh, kw), (sh, sw), (dh, dw) = m.kernel_size, m.stride, m.dilation
    Ho, Wo = (H - dh * (kh - 1) - 1) // sh + 1, (W - dw * (kw - 1) - 1) // sw + 1
    if by_position:
        ap = ap.permute(0, 2, 3, 1).contiguous()  # (B, H, W, C)
        sB, sH, sW, sC = ap.stride()
        windows = ap.as_strided((B, Ho, Wo, kh, kw, C), (sB, sh * sH, sw * sW, dh * sH, dw * sW, sC))
        return windows.reshape(B, Ho * Wo, kh * kw * C)
    sB, sC, sH, sW = ap.stride()
    windows = ap.as_strided((B, C, kh, kw, Ho, Wo), (sB, sC, dh * sH, dw * sW, sh * sH, sw * sW))
    return windows.reshape(B, C * kh * kw, Ho * Wo)


def _per_sample_weight_grad(
    m: nn.Conv2d, a: torch.Tensor, g: torch.Tensor, padding: tuple[int, ...]
) -> torch.Tensor:
    """The conv's per-sample weight gradients (B, out·in/groups·kh·kw), each in the weight's layout:
    G_i·U_iᵀ by one batched product when the conv is ungrouped and narrow (:data:`UNFOLD_MAX_D`),
    else the batch-grouped convolution backward (:func:`_weight_grad`)."""
    B = a.shape[0]
    if m.groups == 1 and m.weight[0].numel() <= UNFOLD_MAX_D:
        U = _unfold(m, a, padding)  # (B, d, T)
        return torch.bmm(g.reshape(B, g.shape[1], -1), U.transpose(1, 2)).view(B, -1)
    return _weight_grad(m, a, g, padding, per_sample=True).view(B, -1)


def _linear(m: nn.Linear, a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, Finish]:
    """A Linear layer's squared per-sample norms (B,) from input a (B, in) and output gradient g
    (B, out), ‖g_i‖²‖a_i‖² (+ ‖g_i‖² for the bias), and its clipped sums (c∘G)ᵀA and Σ_i c_i g_i."""
    if a.dim() == 3:
        return _sequence_linear(m, a, g)
    if a.dim() != 2:
        raise NotImplementedError("Linear on more than 3-D input")
    w, b = _trainable(m, "weight"), _trainable(m, "bias")
    gg = _rowsq(g)  # (B,)
    sq = torch.zeros_like(gg)
    if w is not None:
        sq = sq + gg * _rowsq(a)
    if b is not None:
        sq = sq + gg

    def finish(c: torch.Tensor) -> dict[int, torch.Tensor]:
        cg = c[:, None] * g  # (B, out)
        out = {}
        if w is not None:
            out[id(w)] = cg.T @ a  # (out, in)
        if b is not None:
            out[id(b)] = cg.sum(0)
        return out

    return sq, finish


def _ghost_unfold_sq(
    m: nn.Conv2d, a: torch.Tensor, g: torch.Tensor, padding: tuple[int, ...]
) -> torch.Tensor:
    """The weight's squared per-sample norms ⟨U_iᵀU_i, G_iᵀG_i⟩ (B,) with U_i the unfolded input
    (d × T per group) and G_i the output gradient (p × T): O(T²(d+p)), any convolution."""
    B, groups = a.shape[0], m.groups
    T = g.shape[2] * g.shape[3]
    if groups == 1:
        Ut = _unfold(m, a, padding, by_position=True)  # (B, T, d)
        UU = torch.bmm(Ut, Ut.transpose(1, 2))  # (B, T, T)
    else:
        Ug = _unfold(m, a, padding).view(B * groups, -1, T)  # (B·groups, d, T): channel-major
        UU = torch.bmm(Ug.transpose(1, 2), Ug)  # (B·groups, T, T)
    Gg = g.reshape(B * groups, -1, T)  # (B·groups, out/groups, T)
    GG = torch.bmm(Gg.transpose(1, 2), Gg)
    return _rowdot(UU.view(B, -1), GG.view(B, -1))


def _ghost_shift_sq(m: nn.Conv2d, a: torch.Tensor, g: torch.Tensor, padding: tuple[int, ...]) -> torch.Tensor:
    """The same ghost norm for a stride-1 convolution without unfolding: UᵀU's entry (t, t') is
    Σ_k Q[t + o_k, t' + o_k], with Q = A_iᵀA_i the Gram of the zero-padded input's positions
    (flattened, Wp wide) and o_k the flat offset of kernel tap k. With the output gradient laid out
    on the same Wp-wide rows (zeros beyond its Wo columns), every tap's block of Q is one strided
    window, so the norm is ⟨Σ_k Q_k, G_iᵀG_i⟩: O(L_p²·c_in + L²·p) for L_p ≈ (H+2p)·Wp padded input
    positions and L = Ho·Wp output ones — against T²(d+p), d = c_in·k_h·k_w, of the unfolded form."""
    B, groups = a.shape[0], m.groups
    (ph, pw), (dh, dw) = padding, m.dilation
    kh, kw = m.kernel_size
    Wp = a.shape[3] + 2 * pw
    Ho, Wo = g.shape[2], g.shape[3]
    spill = -(-dw * (kw - 1) // Wp)  # rows of zeros so the last tap's window stays inside
    ap = F.pad(a, (pw, pw, ph, ph + spill))
    A = ap.reshape(B * groups, -1, ap.shape[2] * Wp)  # (B·groups, in/groups, L_p)
    L = Ho * Wp
    Gp = F.pad(g, (0, Wp - Wo)).reshape(B * groups, -1, L)  # (B·groups, out/groups, L)
    Q = torch.bmm(A.transpose(1, 2), A)  # (B·groups, L_p, L_p)
    GG = torch.bmm(Gp.transpose(1, 2), Gp)  # (B·groups, L, L)
    offsets = [i * dh * Wp + j * dw for i in range(kh) for j in range(kw)]
    S = Q[:, offsets[0] : offsets[0] + L, offsets[0] : offsets[0] + L].clone()
    for o in offsets[1:]:
        S += Q[:, o : o + L, o : o + L]
    return _rowdot(S.view(B, -1), GG.view(B, -1))


def _conv(
    m: nn.Conv2d, a: torch.Tensor, g: torch.Tensor, form: ConvForm | None
) -> tuple[torch.Tensor, Finish]:
    """A Conv2d's squared per-sample norms (B,) and clipped sums (module docstring); ``form`` forces
    the weight's norm form (``ghost-shift`` on a strided convolution takes ``ghost-unfold``), None
    takes :func:`choose_conv_form`'s choice."""
    w, b = _trainable(m, "weight"), _trainable(m, "bias")
    B = a.shape[0]
    T = g.shape[2] * g.shape[3]
    a, padding = _padded(m, a)
    sq = g.new_zeros(B)
    W: torch.Tensor | None = None  # materialised per-sample weight gradients (B, out·in/groups·kh·kw)
    if w is not None:
        chosen = form or choose_conv_form(m, T, tuple(g.shape[2:]))
        if chosen == "ghost-shift" and tuple(m.stride) == (1, 1):
            sq = sq + _ghost_shift_sq(m, a, g, padding)
        elif chosen != "materialise":
            sq = sq + _ghost_unfold_sq(m, a, g, padding)
        elif B * w.numel() * w.element_size() > HOLD_BYTES:
            k = max(1, CHUNK_BYTES // (w.numel() * w.element_size()))
            chunks = (_per_sample_weight_grad(m, a[i : i + k], g[i : i + k], padding) for i in range(0, B, k))
            sq = sq + torch.cat([_rowsq(W) for W in chunks])  # each chunk freed as it goes
        else:
            W = _per_sample_weight_grad(m, a, g, padding)
            sq = sq + _rowsq(W)
    Gb = g.sum((2, 3)) if b is not None else None  # (B, out)
    if Gb is not None:
        sq = sq + _rowsq(Gb)

    def finish(c: torch.Tensor) -> dict[int, torch.Tensor]:
        sums: dict[int, torch.Tensor] = {}
        if w is not None and W is not None:
            sums[id(w)] = (c @ W).view_as(w)
        elif w is not None:
            sums[id(w)] = _weight_grad(m, a, c.view(-1, 1, 1, 1) * g, padding, per_sample=False)
        if b is not None and Gb is not None:
            sums[id(b)] = c @ Gb
        return sums

    return sq, finish


def _group_stats(m: nn.GroupNorm, a: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The GroupNorm's per-(sample, group) mean and 1/std (B, groups): those its forward saved for its
    backward when the output came from ``native_group_norm``, else computed from its input ``a``."""
    node = output.grad_fn
    if type(node).__name__ == "NativeGroupNormBackward0":
        return node._saved_result1.detach(), node._saved_result2.detach()  # type: ignore[union-attr]
    var, mean = torch.var_mean(a.reshape(a.shape[0], m.num_groups, -1), dim=2, unbiased=False)
    return mean, (var + m.eps).rsqrt()


def _group_norm(
    m: nn.GroupNorm, a: torch.Tensor, g: torch.Tensor, stats: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, Finish]:
    """An affine GroupNorm's per-sample gradients (B, C) are per-channel sums, formed, then their
    squared norms and clipped sums: the bias's Σ_hw g, the weight's Σ_hw x̂·g =
    rstd·(Σ_hw a·g − mean·Σ_hw g) with the group's ``stats`` (mean, rstd), so x̂ is never formed."""
    w, b = _trainable(m, "weight"), _trainable(m, "bias")
    B, C = g.shape[:2]
    per = {}
    gsum = g.sum(tuple(range(2, g.dim())))  # (B, C)
    if w is not None:
        ag = torch.linalg.vecdot(a.reshape(B, C, -1), g.reshape(B, C, -1))  # Σ_hw a·g, (B, C)
        mean, rstd = (t.reshape(B, m.num_groups, 1).expand(B, m.num_groups, C // m.num_groups) for t in stats)
        per[id(w)] = (ag - mean.reshape(B, C) * gsum) * rstd.reshape(B, C)
    if b is not None:
        per[id(b)] = gsum
    sq = sum((_rowsq(v) for v in per.values()), g.new_zeros(B))

    def finish(c: torch.Tensor) -> dict[int, torch.Tensor]:
        return {k: c @ v for k, v in per.items()}

    return sq, finish


def _materialised(per: dict[int, torch.Tensor], B: int, g: torch.Tensor) -> tuple[torch.Tensor, Finish]:
    """Squared norms and clipped sums of per-sample gradients held whole (``per``: id → (B, ...))."""
    sq = sum((_rowsq(v) for v in per.values()), g.new_zeros(B))

    def finish(c: torch.Tensor) -> dict[int, torch.Tensor]:
        return {k: torch.tensordot(c, v, dims=1) for k, v in per.items()}

    return sq, finish


def _sequence_linear(m: nn.Linear, a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, Finish]:
    """A Linear on sequences, a (B, L, in) and g (B, L, out) (attention's projections, a
    Transformer's MLP): per-sample gradients summed over positions, the weight's G_iᵀA_i by one
    batched product (B, out, in), the bias's Σ_pos g_i."""
    w, b = _trainable(m, "weight"), _trainable(m, "bias")
    per = {}
    if w is not None:
        per[id(w)] = torch.bmm(g.transpose(1, 2), a)  # (B, out, in)
    if b is not None:
        per[id(b)] = g.sum(1)  # (B, out)
    return _materialised(per, a.shape[0], g)


def _embedding(m: nn.Embedding, a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, Finish]:
    """An Embedding's per-sample weight gradient Σ_pos onehot(a_i,pos) ⊗ g_i,pos (B, V, D), by one
    batched product of the one-hot rows with g."""
    if m.max_norm is not None or m.sparse:
        raise NotImplementedError("Embedding with max_norm or sparse gradients")
    w = _trainable(m, "weight")
    B = a.shape[0]
    idx = a.reshape(B, -1).long()  # (B, L)
    onehot = F.one_hot(idx, m.num_embeddings).to(g.dtype)  # (B, L, V)
    if m.padding_idx is not None:
        onehot[..., m.padding_idx] = 0
    per = {} if w is None else {id(w): torch.bmm(onehot.transpose(1, 2), g.reshape(B, idx.shape[1], -1))}
    return _materialised(per, B, g)


def _layer_norm(m: nn.LayerNorm, a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, Finish]:
    """An affine LayerNorm over the last dimension: per-sample Σ_pos x̂·g (weight) and Σ_pos g (bias)."""
    if len(m.normalized_shape) != 1:
        raise NotImplementedError("LayerNorm over more than the last dimension")
    w, b = _trainable(m, "weight"), _trainable(m, "bias")
    B, D = a.shape[0], a.shape[-1]
    g3 = g.reshape(B, -1, D)
    per = {}
    if w is not None:
        x = a.reshape(B, -1, D)
        var, mean = torch.var_mean(x, dim=-1, keepdim=True, unbiased=False)
        per[id(w)] = (g3 * (x - mean) * torch.rsqrt(var + m.eps)).sum(1)  # (B, D)
    if b is not None:
        per[id(b)] = g3.sum(1)
    return _materialised(per, B, g)


@dataclass(frozen=True)
class LayerGrad:
    """One trained layer after the book-keeping backward: its input, its output's gradient and, for a
    GroupNorm, the forward's (mean, rstd) per (sample, group)."""

    module: nn.Module
    input: torch.Tensor
    grad: torch.Tensor
    stats: tuple[torch.Tensor, torch.Tensor] | None = None


def output_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[LayerGrad]]:
    """The batch's summed cross-entropy loss and, for every trained layer in module order, its
    :class:`LayerGrad` from ONE forward (hooks record inputs and outputs) and ONE backward that asks
    for the layers' output gradients only. Raises ``NotImplementedError`` for a layer called twice,
    not called, or whose output was modified in place."""
    layers = [m for m in model.modules() if isinstance(m, _LAYERS) and _trainable_params(m)]
    seen: dict[nn.Module, tuple[torch.Tensor, torch.Tensor, int]] = {}
    stats: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}

    def capture(m: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if m in seen:
            raise NotImplementedError(f"{type(m).__name__} called twice in one forward")
        seen[m] = (inputs[0].detach(), output, output._version)
        if isinstance(m, nn.GroupNorm):
            stats[m] = _group_stats(m, inputs[0].detach(), output)

    handles = [m.register_forward_hook(capture) for m in layers]
    try:
        with torch.enable_grad():
            logits = model(x.detach())
            loss = F.cross_entropy(logits, y, reduction="sum")
    finally:
        for h in handles:
            h.remove()
    if any(m not in seen for m in layers) or any(o._version != v for _, o, v in seen.values()):
        raise NotImplementedError("a layer not called, or its output modified in place")
    grads = torch.autograd.grad(loss, [seen[m][1] for m in layers], allow_unused=True)
    return loss.detach(), [
        LayerGrad(m, seen[m][0], torch.zeros_like(seen[m][1]) if g is None else g, stats.get(m))
        for m, g in zip(layers, grads, strict=True)
    ]


def layer_part(layer: LayerGrad, conv_form: ConvForm | None = None) -> tuple[torch.Tensor, Finish]:
    """One layer's squared per-sample norms (B,) and its clipped sums' :data:`Finish` (module
    docstring); ``conv_form`` forces a Conv2d's form, None chooses (:func:`choose_conv_form`)."""
    m, a, g = layer.module, layer.input, layer.grad
    if isinstance(m, nn.Linear):
        return _linear(m, a, g)
    if isinstance(m, nn.Conv2d):
        return _conv(m, a, g, conv_form)
    if isinstance(m, nn.Embedding):
        return _embedding(m, a, g)
    if isinstance(m, nn.LayerNorm):
        return _layer_norm(m, a, g)
    assert isinstance(m, nn.GroupNorm) and layer.stats is not None
    return _group_norm(m, a, g, layer.stats)


def hooked_clipped_grad_sum(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    clip: float,
    out: torch.Tensor,
    eps: float,
    *,
    conv_form: ConvForm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_i g_i·min(1, C/(‖g_i‖ + eps)) into ``out`` (flat layout) for the cross-entropy loss;
    returns (the batch's mean loss repeated per sample, per-sample norms (B,)). ``conv_form``
    forces every Conv2d's norm form; None chooses per layer (:func:`choose_conv_form`).

    The layers' parts are computed after the backward, from all output gradients at once. Computing
    each in a hook on its output as the backward reached it (less memory held) measured ~10-25 %
    slower per step on a 2-core CPU (resnet8-GN, batch 256): glibc's malloc then handed the freed
    buffers back to the kernel and faulted them in again within the step."""
    loss, layers = output_grads(model, x, y)
    B = x.shape[0]
    sq = torch.zeros(B, dtype=out.dtype, device=out.device)
    finishes: list[Finish] = []
    for layer in layers:
        part, finish = layer_part(layer, conv_form)
        sq += part
        finishes.append(finish)
    norms = sq.sqrt()
    factor = (clip / (norms + eps)).clamp(max=1.0)  # (B,)
    sums: dict[int, torch.Tensor] = {}
    for finish in finishes:
        sums.update(finish(factor))
    offset = 0
    for p in model.parameters():
        if p.requires_grad:
            out[offset : offset + p.numel()] = sums[id(p)].reshape(-1)
            offset += p.numel()
    return (loss / B).expand(B), norms
