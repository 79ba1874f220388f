"""Per-sample clipping by book-keeping (Bu et al. 2023): ONE forward and ONE backward of the batch's
summed loss, no per-sample autograd and no second backward.

The forward records each layer's input A and output; one ``torch.autograd.grad`` of the summed loss
asks for the layers' OUTPUT gradients G only (the backward computes input gradients along the way,
never a weight gradient). From (A, G) every layer gives its part of each sample's squared gradient
norm, then, once the clip factors c_i = min(1, C/(‖g_i‖ + eps)) are known, the clipped sum Σ_i c_i·g_i
of its parameters as one weighted product:

- ``Linear`` (2-D input): the per-sample weight gradient is g_i a_iᵀ, so ‖·‖² = ‖g_i‖²‖a_i‖² (Li et
  al. 2022's ghost norm) and the clipped sum is (c∘G)ᵀA; the bias's is g_i.
- ``Conv2d`` (any stride, padding, dilation, groups and padding mode): with U_i (T×d) the unfolded
  input of sample i and G_i (T×p) its output gradient (per group), the weight gradient is G_iᵀU_i.
  Its squared norm is either the ghost one ⟨U_iU_iᵀ, G_iG_iᵀ⟩ (O(T²(d+p)); the clipped sum is then
  the conv's ordinary weight gradient of the rescaled output gradient c∘G, one convolution
  backward) or that of the materialised G_iᵀU_i (formed without unfolding, by ONE convolution
  backward with the batch folded into the groups; the clipped sum is then Σ_i c_i·(G_iᵀU_i)),
  chosen per layer by cost (:func:`conv_uses_ghost`: Bu et al. 2023's hybrid rule, its constant
  timed here). The bias's is Σ_t G_i.
- ``GroupNorm`` (affine): per-channel sums Σ_hw x̂·g (weight) and Σ_hw g (bias), x̂ recomputed.

Supported: models whose trainable parameters all belong to such modules, each called once per
forward and its output not modified in place, with the default cross-entropy loss. :func:`supported`
tells; anything else raises ``NotImplementedError`` before the backward and
:func:`hpcfl.privacy.sgd.clipped_grad_sum` falls back to ``vmap``. Equal to Opacus's
``GradSampleModule`` + clipping, and to ``vmap`` per-sample gradients, to 1e-10 in float64
(tests/test_privacy.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

_LAYERS = (nn.Linear, nn.Conv2d, nn.GroupNorm)

MATERIALISE_COST = 64.0
"""Cost of one element of a materialised per-sample weight gradient (the batch folded into the groups
of one convolution backward, then read for the norm and the weighted sum) in multiply-adds of the
ghost norm's Gram products, as timed on a CPU (1 thread, batch 256, Fashion-MNIST-sized maps: ~8 ns
per element against ~0.1 ns per Gram multiply-add). A Conv2d takes the ghost norm when
T²(d+p) < MATERIALISE_COST·d·p: simplecnn's 7×7 and 4×4 output maps and resnet8's last stage's 3×3
convolutions; the 28×28 and 14×14 maps, and 1×1 shortcuts, materialise."""

Finish = Callable[[torch.Tensor], dict[int, torch.Tensor]]
"""Given the clip factors (B,), a layer's clipped sums by ``id`` of its trainable parameters."""


def supported(model: nn.Module) -> bool:
    """Whether every trainable parameter is owned by a Linear, Conv2d or GroupNorm module."""
    owned = 0
    for m in model.modules():
        mine = [p for p in m.parameters(recurse=False) if p.requires_grad]
        if mine and not isinstance(m, _LAYERS):
            return False
        owned += len(mine)
    return owned == sum(1 for p in model.parameters() if p.requires_grad)


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_j a[i, ...]·b[i, ...] per row i, as a batched product (no elementwise temporary)."""
    B = a.shape[0]
    return torch.bmm(a.reshape(B, 1, -1), b.reshape(B, -1, 1)).view(B)


def _trainable_params(m: nn.Module) -> list[nn.Parameter]:
    """``m``'s own parameters that are trained."""
    return [p for p in m.parameters(recurse=False) if p.requires_grad]


def _trainable(m: nn.Module, name: str) -> torch.Tensor | None:
    """``m.<name>`` if it is a trained parameter, else None (absent bias, frozen weight)."""
    p = getattr(m, name, None)
    return p if isinstance(p, nn.Parameter) and p.requires_grad else None


def conv_uses_ghost(m: nn.Conv2d, positions: int) -> bool:
    """Bu et al.'s hybrid choice for one Conv2d with ``positions`` = T output positions: whether the
    ghost norm's Gram products, T²(d+p) per group, cost less than the materialised gradient's d·p
    entries at :data:`MATERIALISE_COST` each (d = in/groups·kh·kw, p = out/groups)."""
    d = m.weight[0].numel()  # (in/groups)·kh·kw
    p = m.out_channels // m.groups
    return positions * positions * (d + p) < MATERIALISE_COST * d * p


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


def _linear(m: nn.Linear, a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, Finish]:
    """A Linear layer's squared per-sample norms (B,) from input a (B, in) and output gradient g
    (B, out), ‖g_i‖²‖a_i‖² (+ ‖g_i‖² for the bias), and its clipped sums (c∘G)ᵀA and Σ_i c_i g_i."""
    if a.dim() != 2:
        raise NotImplementedError("Linear on more than 2-D input")
    w, b = _trainable(m, "weight"), _trainable(m, "bias")
    gg = _rowdot(g, g)  # (B,)
    sq = torch.zeros_like(gg)
    if w is not None:
        sq = sq + gg * _rowdot(a, a)
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


def _conv(m: nn.Conv2d, a: torch.Tensor, g: torch.Tensor, ghost: bool | None) -> tuple[torch.Tensor, Finish]:
    """A Conv2d's squared per-sample norms (B,) and clipped sums (module docstring); ``ghost`` forces
    the weight's norm form, None takes :func:`conv_uses_ghost`'s choice."""
    w, b = _trainable(m, "weight"), _trainable(m, "bias")
    B, groups = a.shape[0], m.groups
    T = g.shape[2] * g.shape[3]
    a, padding = _padded(m, a)
    sq = g.new_zeros(B)
    W: torch.Tensor | None = None  # materialised per-sample weight gradients (B, out·in/groups·kh·kw)
    if w is not None:
        if ghost if ghost is not None else conv_uses_ghost(m, T):
            U = F.unfold(a, m.kernel_size, dilation=m.dilation, padding=padding, stride=m.stride)
            Ug = U.view(B * groups, -1, T)  # (B·groups, d, T): unfold is channel-major
            Gg = g.reshape(B * groups, -1, T)  # (B·groups, out/groups, T)
            UU = torch.bmm(Ug.transpose(1, 2), Ug)  # (B·groups, T, T)
            GG = torch.bmm(Gg.transpose(1, 2), Gg)
            sq = sq + _rowdot(UU.view(B, -1), GG.view(B, -1))
        else:
            W = _weight_grad(m, a, g, padding, per_sample=True).view(B, -1)  # the weight's layout per sample
            sq = sq + _rowdot(W, W)
    Gb = g.sum((2, 3)) if b is not None else None  # (B, out)
    if Gb is not None:
        sq = sq + _rowdot(Gb, Gb)

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


def _group_norm(m: nn.GroupNorm, a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, Finish]:
    """An affine GroupNorm's per-sample gradients (B, C) are cheap per-channel sums: formed, then
    their squared norms and clipped sums."""
    w, b = _trainable(m, "weight"), _trainable(m, "bias")
    dims = tuple(range(2, g.dim()))
    per = {}
    if w is not None:
        xhat = F.group_norm(a, m.num_groups, None, None, m.eps)  # (B, C, H, W)
        B, C = g.shape[:2]
        per[id(w)] = torch.bmm(xhat.reshape(B * C, 1, -1), g.reshape(B * C, -1, 1)).view(B, C)  # Σ_hw x̂·g
    if b is not None:
        per[id(b)] = g.sum(dims)
    sq = sum((_rowdot(v, v) for v in per.values()), g.new_zeros(g.shape[0]))

    def finish(c: torch.Tensor) -> dict[int, torch.Tensor]:
        return {k: c @ v for k, v in per.items()}

    return sq, finish


def hooked_clipped_grad_sum(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    clip: float,
    out: torch.Tensor,
    eps: float,
    *,
    conv_ghost: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_i g_i·min(1, C/(‖g_i‖ + eps)) into ``out`` (flat layout) for the cross-entropy loss;
    returns (the batch's mean loss repeated per sample, per-sample norms (B,)). ``conv_ghost``
    forces every Conv2d's norm to the ghost (True) or materialised (False) form; None chooses per
    layer (:func:`conv_uses_ghost`)."""
    layers = [m for m in model.modules() if isinstance(m, _LAYERS) and _trainable_params(m)]
    seen: dict[nn.Module, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def capture(m: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if m in seen:
            raise NotImplementedError(f"{type(m).__name__} called twice in one forward")
        seen[m] = (inputs[0].detach(), output, output._version)

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
    outputs = [seen[m][1] for m in layers]
    grads = torch.autograd.grad(loss, outputs, allow_unused=True)  # output gradients only
    B = x.shape[0]
    sq = torch.zeros(B, dtype=out.dtype, device=out.device)
    finishes: list[Finish] = []
    for m, g in zip(layers, grads, strict=True):
        a = seen[m][0]
        g = torch.zeros_like(seen[m][1]) if g is None else g
        if isinstance(m, nn.Linear):
            part, finish = _linear(m, a, g)
        elif isinstance(m, nn.Conv2d):
            part, finish = _conv(m, a, g, conv_ghost)
        else:
            assert isinstance(m, nn.GroupNorm)
            part, finish = _group_norm(m, a, g)
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
    return (loss.detach() / B).expand(B), norms
