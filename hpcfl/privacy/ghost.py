"""Per-sample clipping from layer activations and output gradients ("book-keeping", Bu et al. 2023):
ONE forward and ONE backward of the batch's summed loss, no per-sample autograd.

For a Linear layer the per-sample weight gradient is g_i a_iᵀ, so its norm is ‖g_i‖·‖a_i‖ (Li et al.
2022's ghost norm) and the clipped sum is the single product (c∘G)ᵀA: nothing of size B × P is
formed. Conv2d's per-sample gradient G_i U_iᵀ (U the unfolded input) and GroupNorm's affine ones
(Σ_hw x̂·g, Σ_hw g) are formed per layer (small next to the Linear layers here). Supported: models whose
parameters all belong to Linear (2-D input), Conv2d and affine GroupNorm modules, each called once per
forward, with the default cross-entropy loss; :func:`supported` says so and
:func:`hpcfl.privacy.sgd.clipped_grad_sum` falls back to ``vmap`` otherwise. Equal to Opacus's
``GradSampleModule`` + clipping to 1e-10 in float64 (tests/test_privacy.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_LAYERS = (nn.Linear, nn.Conv2d, nn.GroupNorm)


def supported(model: nn.Module) -> bool:
    """Whether every trainable parameter is owned by a Linear, Conv2d or GroupNorm module."""
    owned = 0
    for m in model.modules():
        mine = [p for p in m.parameters(recurse=False) if p.requires_grad]
        if mine and not isinstance(m, _LAYERS):
            return False
        owned += len(mine)
    return owned == sum(1 for p in model.parameters() if p.requires_grad)


def _per_sample(m: nn.Module, a: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-sample gradients of ``m``'s parameters that are cheaper to form than to avoid, by name;
    a Linear weight comes back as the pair (g, a) under ``"weight_factors"``."""
    if isinstance(m, nn.Linear):
        if a.dim() != 2:
            raise NotImplementedError("Linear on more than 2-D input")
        out = {"weight_factors": (g, a)}
        if m.bias is not None:
            out["bias"] = g  # (B, out)
        return out  # type: ignore[return-value]
    if isinstance(m, nn.Conv2d):
        if m.groups != 1 or m.padding_mode != "zeros" or isinstance(m.padding, str):
            raise NotImplementedError("grouped, non-zero-padded or 'same'-padded Conv2d")
        U = F.unfold(
            a, m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride
        )  # (B, in·k², L)
        G = g.flatten(2)  # (B, out, L)
        out = {"weight": torch.bmm(G, U.transpose(1, 2)).view(a.shape[0], *m.weight.shape)}
        if m.bias is not None:
            out["bias"] = G.sum(2)  # (B, out)
        return out
    assert isinstance(m, nn.GroupNorm)
    xhat = F.group_norm(a, m.num_groups, None, None, m.eps)  # (B, C, H, W)
    dims = tuple(range(2, g.dim()))
    return {"weight": (xhat * g).sum(dims), "bias": g.sum(dims)}


def hooked_clipped_grad_sum(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float, out: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_i g_i·min(1, C/(‖g_i‖ + eps)) into ``out`` (flat layout) for the cross-entropy loss;
    returns (the batch's mean loss repeated per sample, per-sample norms (B,))."""
    seen: dict[nn.Module, list[torch.Tensor]] = {}
    handles = []

    def capture(m: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if m in seen:
            raise NotImplementedError(f"{type(m).__name__} called twice in one forward")
        seen[m] = [inputs[0].detach()]
        output.register_hook(lambda grad: seen[m].append(grad.detach()))

    layers = [
        m
        for m in model.modules()
        if isinstance(m, _LAYERS) and any(True for _ in m.parameters(recurse=False))
    ]
    params = [p for p in model.parameters() if p.requires_grad]
    for m in layers:
        handles.append(m.register_forward_hook(capture))
    for p in params:
        p.requires_grad_(False)  # the backward needs only the layers' output gradients
    try:
        with torch.enable_grad():
            xin = x.detach().requires_grad_(True)
            logits = model(xin)
            loss = F.cross_entropy(logits, y, reduction="sum")
            loss.backward()
    finally:
        for p in params:
            p.requires_grad_(True)
        for h in handles:
            h.remove()
    B = x.shape[0]
    grads: dict[int, object] = {}
    sq = torch.zeros(B, dtype=out.dtype, device=out.device)
    for m in layers:
        a, g = seen[m]
        for name, value in _per_sample(m, a, g).items():
            if name == "weight_factors":
                ga, aa = value  # type: ignore[misc]
                sq += ga.pow(2).sum(1) * aa.pow(2).sum(1)
                grads[id(m.weight)] = value
            else:
                sq += value.flatten(1).pow(2).sum(1)  # type: ignore[union-attr]
                grads[id(getattr(m, name))] = value
    norms = sq.sqrt()
    factor = (clip / (norms + eps)).clamp(max=1.0)  # (B,)
    offset = 0
    for p in params:
        value = grads[id(p)]
        if isinstance(value, tuple):
            ga, aa = value
            summed = (factor[:, None] * ga).T @ aa  # (out, in)
        else:
            summed = torch.einsum("b,bp->p", factor, value.flatten(1))
        out[offset : offset + p.numel()] = summed.reshape(-1)
        offset += p.numel()
    return (loss.detach() / B).expand(B), norms
