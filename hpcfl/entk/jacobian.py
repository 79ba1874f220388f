"""Per-sample Jacobians of ALL outputs w.r.t. ALL trainable parameters: J (n, C, P).

NTK-FL (Yue et al., ICML 2022, Section 4.1) uploads, for every local sample x_i, the Jacobian
J(x_i) = [∇f_1(x_i), …, ∇f_C(x_i)]ᵀ of the C logits w.r.t. the d = P trainable parameters, in the
order of :class:`~hpcfl.training.flat.FlatModel`'s vector (``model.parameters()`` order).

Two implementations behind one signature (:class:`JacobianMethod`), the simplest the reference
the other is tested against.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap

from hpcfl.entk._common import eval_mode
from hpcfl.errors import ConfigError, unknown


class JacobianMethod(StrEnum):
    """How :func:`per_sample_jacobian` computes J (config: NTK-FL's ``params.jacobian``).

    - ``VMAP``: ``torch.func.vmap(jacrev(...))`` over ``functional_call``. The reference: any
      model, but memory B·C·P per batch plus jacrev's intermediates, and per-sample autograd; wins
      only for a model ``FUSED`` does not take.
    - ``FUSED``: one batched forward and C backward passes of Σ_b f_c(x_b) to every Linear layer's
      output (in eval mode samples are independent, so the gradient restricted to sample b is the
      per-sample δ), then each Linear weight's block is the outer product δ_c(b) a(b)ᵀ and its bias
      block δ_c(b) — exact, no per-sample autograd. Wins whenever it applies: models whose
      parametrised layers are all ``nn.Linear`` on 2-d inputs (the ``mlp`` of the paper); refused
      for any other.
    - ``AUTO``: ``FUSED`` when the model takes it (:func:`fusable`), else ``VMAP`` (the default).
    """

    AUTO = "auto"
    FUSED = "fused"
    VMAP = "vmap"

    @classmethod
    def parse(cls, value: JacobianMethod | str, *, key: str = "Jacobian method") -> JacobianMethod:
        """``value`` as a member; a string from a config or the CLI that names none is one
        :class:`ConfigError` line naming ``key`` and the choices."""
        try:
            return cls(value)
        except ValueError:
            raise unknown(key, str(value), [m.value for m in cls]) from None


JACOBIAN_METHODS: tuple[str, ...] = tuple(m.value for m in JacobianMethod)
"""The values :class:`JacobianMethod` accepts (the config's strings)."""


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def fusable(model: nn.Module) -> bool:
    """Whether every parametrised module is an ``nn.Linear`` (the fused path's one layer type)."""
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)) and not isinstance(module, nn.Linear):
            return False
    return True


def resolve_method(model: nn.Module, method: JacobianMethod | str) -> JacobianMethod:
    """The implementation ``method`` runs on ``model``: ``FUSED`` or ``VMAP`` (``AUTO`` resolved).

    Raises:
        ConfigError: an unknown ``method``, or ``FUSED`` on a model with non-Linear parameters.
    """
    chosen = JacobianMethod.parse(method)
    if chosen is JacobianMethod.AUTO:
        return JacobianMethod.FUSED if fusable(model) else JacobianMethod.VMAP
    if chosen is JacobianMethod.FUSED and not fusable(model):
        raise ConfigError("the fused Jacobian path needs a model whose parametrised layers are all nn.Linear")
    return chosen


def per_sample_jacobian(
    model: nn.Module,
    x: Tensor,
    *,
    method: JacobianMethod | str = JacobianMethod.AUTO,
    batch_size: int = 256,
    out: Tensor | None = None,
) -> Tensor:
    """J[b, c, j] = ∂f_c(x_b)/∂θ_j for every sample, output and trainable parameter → (n, C, P).

    The model runs in eval mode (training flags restored after). Computed in the model's dtype on
    its device; ``out`` may be a preallocated (n, C, P) destination.

    Raises:
        ConfigError: an unknown ``method``, or ``"fused"`` on a model with non-Linear parameters.
    """
    use_fused = resolve_method(model, method) is JacobianMethod.FUSED
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
    """The dense Jacobian expanded from :func:`factored_jacobian`'s per-layer factors."""
    factored_jacobian(model, x, named=named).dense(out=out)


@dataclass
class LinearFactor:
    """One ``nn.Linear``'s part of every sample's Jacobian: J[b, c, weight] = δ[b, c] ⊗ a[b] and
    J[b, c, bias] = δ[b, c]; ``weight``/``bias`` are the blocks' offsets in the parameter vector
    (None: not trainable / no bias)."""

    a: Tensor  # (n, in) the layer's inputs
    delta: Tensor  # (n, C, out) ∂f_c/∂z of the layer's outputs z
    weight: int | None
    bias: int | None


@dataclass
class FactoredJacobian:
    """The per-sample Jacobian J (n, C, P) of a model made of ``nn.Linear`` layers, kept as the
    layers' factors (inputs a and output gradients δ): lossless, and n·(Σ in + C·Σ out) numbers
    instead of n·C·P (for the paper's MLP-100 on 784 inputs: 1,884 vs 795,100 per sample).

    Inner products and transposed products never expand it:
    ⟨J_i, J_j⟩ = Σ_layers (⟨a_i, a_j⟩ + [bias]) · Σ_c ⟨δ_ic, δ_jc⟩ and
    Σ_i Σ_c S_ic J_ic = per layer (Σ_c S_c δ_c)ᵀ a (weight) and Σ_i Σ_c S_ic δ_ic (bias).
    """

    layers: list[LinearFactor]
    num_params: int

    @property
    def n(self) -> int:
        return int(self.layers[0].a.shape[0])

    @property
    def shape(self) -> tuple[int, int, int]:
        """(n, C, P): the dense Jacobian's shape."""
        return (self.n, int(self.layers[0].delta.shape[1]), self.num_params)

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].a.dtype

    def dense(self, out: Tensor | None = None) -> Tensor:
        """The (n, C, P) Jacobian (zeros for parameters no layer factor covers)."""
        n, C, P = self.shape
        if out is None:
            out = torch.zeros(n, C, P, dtype=self.dtype, device=self.layers[0].a.device)
        for f in self.layers:
            o = f.delta.shape[2]
            if f.weight is not None:
                block = out[:, :, f.weight : f.weight + o * f.a.shape[1]].view(n, C, o, f.a.shape[1])
                torch.mul(f.delta.unsqueeze(3), f.a.unsqueeze(1).unsqueeze(2), out=block)
            if f.bias is not None:
                out[:, :, f.bias : f.bias + o].copy_(f.delta)
        return out

    def gram(self, other: FactoredJacobian) -> Tensor:
        """G (n, m) with G_ij = Σ_c ⟨J_ic, J'_jc⟩, in the factors' dtype."""
        G = torch.zeros(self.n, other.n, dtype=self.dtype, device=self.layers[0].a.device)
        for f, g in zip(self.layers, other.layers, strict=True):
            if f.weight is None and f.bias is None:
                continue
            dd = f.delta.reshape(f.delta.shape[0], -1) @ g.delta.reshape(g.delta.shape[0], -1).T
            aa = f.a @ g.a.T if f.weight is not None else torch.zeros_like(dd)
            G += dd * (aa + 1.0) if f.bias is not None else dd * aa
        return G

    def transposed_product(self, S: Tensor) -> Tensor:
        """Σ_i Σ_c S[ψ, i, c] J[i, c, :] for every ψ: S (Ψ, n, C) → (Ψ, P), in the factors' dtype."""
        out = torch.zeros(S.shape[0], self.num_params, dtype=self.dtype, device=S.device)
        S = S.to(self.dtype)
        for f in self.layers:
            e = torch.einsum("pnc,nco->pno", S, f.delta)  # (Ψ, n, out)
            o = f.delta.shape[2]
            if f.weight is not None:
                out[:, f.weight : f.weight + o * f.a.shape[1]] = torch.einsum("pno,ni->poi", e, f.a).flatten(
                    1
                )
            if f.bias is not None:
                out[:, f.bias : f.bias + o] = e.sum(1)
        return out

    def rows(self, index: Tensor) -> FactoredJacobian:
        """The Jacobian of the samples ``index`` (in that order)."""
        return FactoredJacobian(
            [LinearFactor(f.a[index], f.delta[index], f.weight, f.bias) for f in self.layers], self.num_params
        )

    @staticmethod
    def cat(parts: Sequence[FactoredJacobian]) -> FactoredJacobian:
        """The samples of ``parts`` stacked in order (they must come from the same model)."""
        first = parts[0]
        layers = [
            LinearFactor(
                torch.cat([p.layers[i].a for p in parts]),
                torch.cat([p.layers[i].delta for p in parts]),
                f.weight,
                f.bias,
            )
            for i, f in enumerate(first.layers)
        ]
        return FactoredJacobian(layers, first.num_params)

    def split(self, sizes: Sequence[int]) -> list[FactoredJacobian]:
        """Consecutive chunks of ``sizes`` samples."""
        out, start = [], 0
        for n in sizes:
            out.append(self.rows(torch.arange(start, start + n, device=self.layers[0].a.device)))
            start += n
        return out


def factored_jacobian(
    model: nn.Module, x: Tensor, *, named: list[tuple[str, nn.Parameter]] | None = None
) -> FactoredJacobian:
    """The per-sample Jacobian of a model whose parametrised layers are all ``nn.Linear`` on 2-d
    inputs, as layer factors: forward once recording each Linear's input a (B, in) and output z,
    then C backwards of Σ_b f_c(x_b) give δ_c = ∂f_c/∂z per sample (the model runs in eval mode, so
    samples are independent). Exact; no per-sample autograd and nothing of size n·C·P.

    Raises:
        ConfigError: the model has a non-Linear parametrised layer, or calls a Linear twice / on
            inputs that are not 2-d.
    """
    if not fusable(model):
        raise ConfigError("the fused Jacobian path needs a model whose parametrised layers are all nn.Linear")
    named = named if named is not None else _trainable(model)
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
        with eval_mode(model), torch.enable_grad():
            logits = model(x)  # (B, C)
    finally:
        for h in handles:
            h.remove()
    C = logits.shape[1]
    zs = [seen[m][1] for m in linears]
    deltas: list[list[Tensor]] = [[] for _ in linears]
    for c in range(C):
        grad = torch.zeros_like(logits)
        grad[:, c] = 1.0
        got = torch.autograd.grad(logits, zs, grad_outputs=grad, retain_graph=c + 1 < C, allow_unused=True)
        for i, (z, d) in enumerate(zip(zs, got, strict=True)):
            deltas[i].append(torch.zeros_like(z) if d is None else d.detach())
    layers = [
        LinearFactor(
            seen[m][0],
            torch.stack(deltas[i], dim=1),  # (B, C, out)
            offsets.get(id(m.weight)) if m.weight.requires_grad else None,
            offsets.get(id(m.bias)) if m.bias is not None and m.bias.requires_grad else None,
        )
        for i, m in enumerate(linears)
    ]
    return FactoredJacobian(layers, at)
