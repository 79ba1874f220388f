"""Per-sample Jacobians of ALL outputs w.r.t. ALL trainable parameters: J (n, C, P).

NTK-FL (Yue et al., ICML 2022, Section 4.1) uploads, for every local sample x_i, the Jacobian
J(x_i) = [∇f_1(x_i), …, ∇f_C(x_i)]ᵀ of the C logits w.r.t. the d = P trainable parameters, in the
order of :class:`~hpcfl.training.flat.FlatModel`'s vector (``model.parameters()`` order).

Two implementations behind one signature, the simplest the reference the other is tested against:

- ``"vmap"``: ``torch.func.vmap(jacrev(...))`` over ``functional_call`` — any model, memory
  B·C·P per batch plus jacrev's intermediates;
- ``"fused"``: one batched forward and C backward passes of Σ_b f_c(x_b) to every Linear layer's
  output (in eval mode samples are independent, so the gradient restricted to sample b is the
  per-sample δ), then each Linear weight's block is the outer product δ_c(b) a(b)ᵀ and its bias
  block δ_c(b) — exact, no per-sample autograd. Models whose parametrised layers are all
  ``nn.Linear`` on 2-d inputs (the ``mlp`` of the paper) take it; ``"auto"`` falls back to vmap for
  anything else.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap

from hpcfl.entk._common import eval_mode
from hpcfl.errors import ConfigError

JACOBIAN_METHODS = ("auto", "fused", "vmap")


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def fusable(model: nn.Module) -> bool:
    """Whether every parametrised module is an ``nn.Linear`` (the fused path's one layer type)."""
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)) and not isinstance(module, nn.Linear):
            return False
    return True


def per_sample_jacobian(
    model: nn.Module,
    x: Tensor,
    *,
    method: str = "auto",
    batch_size: int = 256,
    out: Tensor | None = None,
) -> Tensor:
    """J[b, c, j] = ∂f_c(x_b)/∂θ_j for every sample, output and trainable parameter → (n, C, P).

    The model runs in eval mode (training flags restored after). Computed in the model's dtype on
    its device; ``out`` may be a preallocated (n, C, P) destination.

    Raises:
        ConfigError: an unknown ``method``, or ``"fused"`` on a model with non-Linear parameters.
    """
    if method not in JACOBIAN_METHODS:
        raise ConfigError(f"unknown Jacobian method {method!r}; choose one of: {', '.join(JACOBIAN_METHODS)}")
    if method == "fused" and not fusable(model):
        raise ConfigError("the fused Jacobian path needs a model whose parametrised layers are all nn.Linear")
    use_fused = method == "fused" or (method == "auto" and fusable(model))
    named = _trainable(model)
    P = sum(p.numel() for _, p in named)
    n = x.shape[0]
    with eval_mode(model):
        first = x[: min(n, 1)]
        with torch.no_grad():
            C = model(first).shape[1]
        if out is None:
            out = torch.empty(n, C, P, dtype=named[0][1].dtype, device=named[0][1].device)
        run: Callable[[Tensor, Tensor], None] = (
            (lambda xb, dst: _fused(model, named, xb, dst))
            if use_fused
            else (lambda xb, dst: _vmap(model, named, xb, dst))
        )
        for s in range(0, n, batch_size):
            run(x[s : s + batch_size], out[s : s + batch_size])
    return out


def _vmap(model: nn.Module, named: list[tuple[str, nn.Parameter]], x: Tensor, out: Tensor) -> None:
    """The baseline: ``vmap(jacrev(single-sample forward))`` over ``functional_call``."""
    params = {n: p.detach() for n, p in named}

    def single(prm: dict[str, Tensor], xi: Tensor) -> Tensor:
        return functional_call(model, prm, (xi.unsqueeze(0),)).squeeze(0)  # (C,)

    jac = vmap(jacrev(single), in_dims=(None, 0))(params, x)  # name -> (B, C, *shape)
    B, C = out.shape[0], out.shape[1]
    torch.cat([jac[n].reshape(B, C, -1) for n, _ in named], dim=2, out=out)


def _fused(model: nn.Module, named: list[tuple[str, nn.Parameter]], x: Tensor, out: Tensor) -> None:
    """Forward once recording each Linear's input a (B, in) and output z (B, out); C backwards give
    δ_c = ∂Σ_b f_c(x_b)/∂z (B, out); weight block = δ_c ⊗ a, bias block = δ_c."""
    offsets: dict[int, int] = {}
    at = 0
    for _, p in named:
        offsets[id(p)] = at
        at += p.numel()
    seen: dict[nn.Linear, tuple[Tensor, Tensor]] = {}

    def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        if module in seen or inputs[0].dim() != 2:
            raise ConfigError("the fused Jacobian path needs each Linear called once on 2-d inputs")
        seen[module] = (inputs[0].detach(), output)  # type: ignore[index]

    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    handles = [m.register_forward_hook(hook) for m in linears]
    try:
        with torch.enable_grad():
            logits = model(x)  # (B, C)
    finally:
        for h in handles:
            h.remove()
    B, C = logits.shape
    zs = [seen[m][1] for m in linears]
    for c in range(C):
        grad = torch.zeros_like(logits)
        grad[:, c] = 1.0
        deltas = torch.autograd.grad(logits, zs, grad_outputs=grad, retain_graph=c + 1 < C, allow_unused=True)
        for m, delta in zip(linears, deltas, strict=True):
            a = seen[m][0]  # (B, in)
            if delta is None:
                delta = torch.zeros_like(seen[m][1])
            if m.weight.requires_grad:
                o = offsets[id(m.weight)]
                block = out[:, c, o : o + m.weight.numel()].view(B, m.out_features, m.in_features)
                torch.mul(delta.unsqueeze(2), a.unsqueeze(1), out=block)  # (B, out, in)
            if m.bias is not None and m.bias.requires_grad:
                o = offsets[id(m.bias)]
                out[:, c, o : o + m.bias.numel()].copy_(delta)
