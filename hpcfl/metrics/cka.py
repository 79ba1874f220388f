"""Linear CKA and the FedCKA regulariser.

Linear centred kernel alignment (Kornblith et al. 2019, "Similarity of Neural Network
Representations Revisited", ICML) measures how alike two representations of the same batch are,
invariant to orthogonal transforms and isotropic scaling. FedCKA (Son, Kim & Chung, "Compare Where
It Matters: Using Layer-Wise Regularization To Improve Federated Learning on Heterogeneous Data")
adds to the FedAvg local loss μ·ℓ_cka, a SimCLR-style contrastive term without temperature over the
first M (= 2) naturally similar layers (Eq. 2)::

    ℓ_cka = (1/M) Σₙ −log( e^{CKA(aₙ^local, aₙ^global)} / (e^{CKA(aₙ^local, aₙ^global)}
                                                          + e^{CKA(aₙ^local, aₙ^prev)}) )

which pulls the local model's early activations towards the global model's and away from the
client's previous local model's.

Dispatch: CUDA tensors go to the fused Triton kernel (:mod:`triton_kernels.cka`) when triton is
importable; everything else to the pure-torch Gram-form reference. Both share one signature and
are tested against each other.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from triton_kernels.cka import HAS_TRITON, linear_cka_reference, linear_cka_triton

__all__ = ["cka_per_layer", "fedcka_loss", "linear_cka"]


def linear_cka(x: Tensor, y: Tensor, *, debiased: bool = False, eps: float = 1e-8) -> Tensor:
    """Linear CKA of two representations of the same n samples (Kornblith et al. 2019).

    Args:
        x: (n, ...) activations, flattened to (n, d1).
        y: (n, ...) activations of the same samples, flattened to (n, d2).
        debiased: use the unbiased HSIC estimator (Song et al. 2012; Nguyen et al. 2021), which
            removes the small-batch bias of the plain estimator; needs n ≥ 4 (ValueError otherwise).
        eps: lower clamp on each norm of the denominator (a constant representation gives 0).

    Returns:
        A differentiable 0-dim tensor (float64 for float64 inputs, float32 otherwise). Cost
        O(n²(d1 + d2)): the Gram form, cheaper than the feature form whenever n < d.

    CUDA tensors use the fused Triton kernel (O(nd) memory in the forward); CPU tensors use the
    torch reference.
    """
    if x.is_cuda and HAS_TRITON:
        return linear_cka_triton(x, y, debiased=debiased, eps=eps)
    return linear_cka_reference(x, y, debiased=debiased, eps=eps)


def _check_layers(
    local_acts: Sequence[Tensor], global_acts: Sequence[Tensor], prev_acts: Sequence[Tensor]
) -> None:
    if not (len(local_acts) == len(global_acts) == len(prev_acts)):
        raise ValueError(
            "fedcka_loss needs one activation per regularised layer from each model, got "
            f"{len(local_acts)} local, {len(global_acts)} global, {len(prev_acts)} previous"
        )
    if len(local_acts) == 0:
        raise ValueError("fedcka_loss needs at least one layer (the paper uses the first M = 2)")


def fedcka_loss(
    local_acts: Sequence[Tensor],
    global_acts: Sequence[Tensor],
    prev_acts: Sequence[Tensor],
    *,
    debiased: bool = False,
) -> Tensor:
    """FedCKA's ℓ_cka (Son et al., Eq. 2): the per-layer contrastive CKA loss averaged over layers.

    Args:
        local_acts: activations (n, ...) of the regularised layers of the model being trained.
        global_acts: the same layers of the current global model on the same batch.
        prev_acts: the same layers of this client's previous-round local model on the same batch.
        debiased: use the debiased CKA (needs n ≥ 4); the paper uses the plain estimator.

    Returns:
        A 0-dim tensor; gradient flows into ``local_acts`` only. The global and previous models are
        fixed reference points (Alg. 1 updates only the local weights), so their activations are
        detached here even if the caller forgot ``torch.no_grad()``.

    Per layer the loss is logsumexp(c_g, c_p) − c_g = −log_softmax([c_g, c_p])[0] with
    c_g = CKA(local, global), c_p = CKA(local, prev), computed with torch ops so that it stays on
    the autograd graph (a public implementation built it with ``math.exp`` on Python floats, which
    silently cut the gradient and left plain FedAvg).
    """
    _check_layers(local_acts, global_acts, prev_acts)
    losses = []
    for a_local, a_global, a_prev in zip(local_acts, global_acts, prev_acts, strict=True):
        c_g = linear_cka(a_local, a_global.detach(), debiased=debiased)  # ()
        c_p = linear_cka(a_local, a_prev.detach(), debiased=debiased)  # ()
        logits = torch.stack([c_g, c_p])  # (2,)
        losses.append(-torch.log_softmax(logits, dim=0)[0])
    return torch.stack(losses).mean()


@torch.no_grad()
def cka_per_layer(
    acts_a: Sequence[Tensor], acts_b: Sequence[Tensor], *, debiased: bool = False
) -> list[float]:
    """Linear CKA of each pair of layers, as Python floats for metrics (no gradient).

    Args:
        acts_a: activations (n, ...) of some layers of one model.
        acts_b: the same layers of another model on the same batch.
        debiased: use the debiased estimator (n ≥ 4).

    Returns:
        ``[CKA(acts_a[i], acts_b[i]) for i]`` — one device-to-host copy for all layers.
    """
    if len(acts_a) != len(acts_b):
        raise ValueError(f"cka_per_layer needs paired layers, got {len(acts_a)} and {len(acts_b)}")
    if len(acts_a) == 0:
        return []
    values = [linear_cka(a, b, debiased=debiased).double() for a, b in zip(acts_a, acts_b, strict=True)]
    return [float(v) for v in torch.stack(values).cpu().tolist()]
