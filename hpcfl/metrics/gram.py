"""Linear CKA from shared centred Grams: each Gram is formed once however many pairs use it.

:func:`hpcfl.metrics.linear_cka` takes two activations and forms both Grams. FedCKA's loss (Son et
al., Eq. 2) compares the local activation of a layer with two references (global and previous
model), so calling it twice per layer forms the local Gram, its centring and its norm twice, and
the per-client layer-similarity metric compares K client models with one global model. Here the
centred Gram Kc = HXXᵀH of every activation is built once and CKA(X, Y) = ⟨Kc, Lc⟩ / (‖Kc‖·‖Lc‖)
is an O(n²) dot product of two of them (Kornblith et al. 2019, Eq. 3 in the Gram form, the same
estimator and the same ``eps`` clamp as :func:`triton_kernels.cka.linear_cka_reference`).

Cost per layer and batch of n: one n×n×d product per activation instead of two per pair, and the
Gram's backward is one product, dX = (G + Gᵀ)·X, where autograd's ``x @ x.T`` makes two (one per
operand). For the FedCKA step that is 4 n×n×d products per layer instead of 8.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["CentredGram", "cka_from_grams", "fedcka_loss_gram", "gram"]


class _Gram(torch.autograd.Function):
    """K = X·Xᵀ with the one-product backward dX = (dK + dKᵀ)·X."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x @ x.T  # (n, n)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return (grad + grad.T) @ x  # (n, d)


def gram(x: Tensor) -> Tensor:
    """X·Xᵀ of an (n, d) matrix, differentiable with a single-product backward."""
    return _Gram.apply(x) if x.requires_grad else x @ x.T


class CentredGram:
    """The doubly centred Gram Kc = HXXᵀH of one (n, ...) activation and its Frobenius norm."""

    def __init__(self, x: Tensor, *, eps: float = 1e-8) -> None:
        n = x.shape[0]
        x2 = x.reshape(n, -1)  # (n, d)
        if x2.dtype != torch.float64:
            x2 = x2.float()
        k = gram(x2)  # (n, n)
        self.kc = k - k.mean(dim=1, keepdim=True) - k.mean(dim=0, keepdim=True) + k.mean()  # (n, n)
        self.norm = self.kc.square().sum().clamp_min(eps * eps).sqrt()  # ()


def cka_from_grams(a: CentredGram, b: CentredGram) -> Tensor:
    """Linear CKA of the two activations behind ``a`` and ``b`` (differentiable through both)."""
    return (a.kc * b.kc).sum() / (a.norm * b.norm)


def fedcka_loss_gram(
    local_acts: Sequence[Tensor], global_grams: Sequence[CentredGram], prev_grams: Sequence[CentredGram]
) -> Tensor:
    """FedCKA's ℓ_cka (Son et al., Eq. 2) with the references' centred Grams given.

    Equal to ``fedcka_loss(local_acts, global_acts, prev_acts)`` (biased estimator) up to float
    rounding; the local Gram of each layer is formed once for both of its CKA terms. The reference
    Grams carry no gradient (build them under ``torch.no_grad()``).
    """
    losses = []
    for a_local, g, p in zip(local_acts, global_grams, prev_grams, strict=True):
        k = CentredGram(a_local)
        logits = torch.stack([cka_from_grams(k, g), cka_from_grams(k, p)])  # (2,)
        losses.append(torch.logsumexp(logits, dim=0) - logits[0])  # −log softmax(logits)[0]
    return torch.stack(losses).mean()
