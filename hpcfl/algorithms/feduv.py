"""FedUV (Son, Kim, Chung, Huang & Liu, "FedUV: Uniformity and Variance for Heterogeneous Federated
Learning", CVPR 2024; by FedCKA's authors).

FedAvg whose local objective adds two regularisers that make a client's training behave as if its
data were IID (no global model or previous model is needed, unlike FedProx, MOON or FedCKA):

    ℓ = ℓ_task + λ·ℓ_V + μ·ℓ_U

- ℓ_V, classifier variance: with p = softmax(logits) over a mini-batch of B samples (B, C), the
  standard deviation of each class dimension over the batch, s_j = std_b(p_{b,j}) (unbiased, as
  ``Tensor.std``), is pushed up to a target γ by a hinge, ℓ_V = (1/C) Σ_j max(0, γ − s_j). The
  target is the IID value of the authors' code, γ = mean_j std(I_C[:, j]) = 1/√C (each column of the
  C×C identity, a confident classifier's outputs on a batch holding every class once, has one 1
  and C − 1 zeros); a client that sees few classes has columns of near-zero spread, which ℓ_V
  penalises.
- ℓ_U, uniformity of the encoder's representation z (the classifier's input, here
  ``model.classifier``'s input; the authors' models return it beside the logits):
  ℓ_U = mean_{i<j} exp(−‖z_i − z_j‖²/σ), σ the median of the batch's nonzero squared distances
  (a Gaussian potential whose bandwidth follows the batch; the median's gradient flows to the pair
  it picks, as ``torch.median``'s does).

Forms and defaults follow the authors' code, sonhamin/FedUV: ``algs/feduv.py`` (``UVReg``: the
softmax's ``std(dim=0)``, ``relu(batch_gamma − std).mean()``, ``batch_gamma =
torch.eye(C).std(dim=0).mean()``; ``torch.pdist(z).pow(2)``, σ = ``torch.median`` of the nonzero
distances, ``exp(−d/σ).mean()``, no normalisation of z and no log) and ``train_fl.py``
(``--std_coeff`` 2.5, "the lambda parameter", on ℓ_V; ``--unif_coeff`` 0.5, "the mu parameter",
on ℓ_U). The paper's own equations were not at hand (only its abstract in the searched corpora),
so they are not checked here; an earlier version of this file used a VICReg-style ε = 1e-4 under
the square root, a normalised z with a log and t = 2, and μ = λ = 1, none of which the code has.
Where the code gives NaN this implementation gives a constant term without gradient instead: a batch
of one sample (no spread, no pairs), a column whose spread is below 1e-6 (``std``'s gradient at 0; it counts as 1e-6),
a batch whose representations all coincide (no nonzero distance: σ = ∞, ℓ_U = 1).

With both weights 0 the local objective is the task loss alone and FedUV is FedAvg bit for bit. The
regularised loss runs hooks on the working model, so participants train one by one under
``client_batch`` (a loss of its own does not vectorise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hpcfl.algorithms.base import (
    Algorithm,
    ClientContext,
    ClientData,
    ClientState,
    HyperParams,
    LocalTask,
    ServerState,
    check_weighting,
    model_upload,
)
from hpcfl.errors import ConfigError
from hpcfl.training.sgd import LossFn

#: below this variance (a spread under 1e-6) a column's std has no gradient (``std``'s is NaN at 0)
MIN_VARIANCE = 1e-12


@dataclass(frozen=True)
class FedUVParams(HyperParams):
    """``variance_weight`` λ (default 2.5) and ``uniformity_weight`` μ (default 0.5), >= 0, the
    authors' code's ``std_coeff`` and ``unif_coeff``; ``variance_target`` γ (None: the code's IID
    value 1/√C for C classes); ``weighting``: the server's model mean (``samples`` default,
    FedAvg's)."""

    variance_weight: float = 2.5
    uniformity_weight: float = 0.5
    variance_target: float | None = None
    weighting: str = "samples"

    def __post_init__(self) -> None:
        check_weighting(self.weighting)
        for key in ("variance_weight", "uniformity_weight"):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"config key 'params.{key}' must be >= 0, got {getattr(self, key)}")
        if self.variance_target is not None and not self.variance_target > 0:
            raise ConfigError(f"config key 'params.variance_target' must be > 0, got {self.variance_target}")


def iid_variance_target(num_classes: int) -> float:
    """γ of the authors' code, ``torch.eye(C).std(dim=0).mean()``: each column of the identity has
    one 1 and C − 1 zeros, whose unbiased variance is 1/C."""
    return 1.0 / math.sqrt(num_classes)


def variance_loss(probs: Tensor, target: float) -> Tensor:
    """ℓ_V of a (B, C) batch of probabilities: mean over classes of max(0, γ − std over the batch),
    the std unbiased; 0 (no gradient) for a batch of one sample."""
    if probs.shape[0] < 2:
        return probs.sum() * 0.0
    std = probs.var(dim=0).clamp_min(MIN_VARIANCE).sqrt()  # (C,), = probs.std(dim=0) above 1e-6
    return F.relu(target - std).mean()


def uniformity_loss(z: Tensor) -> Tensor:
    """ℓ_U of a (B, d) batch of representations: mean_{i<j} exp(−‖z_i − z_j‖²/σ), σ the lower median
    of the nonzero squared distances (``torch.median``'s choice); 1 with no nonzero distance and 0
    for a batch of one sample (constant, no gradient). The median is taken without a host sync: the
    zero distances sort last as +∞ and the count of the others picks the index."""
    B = z.shape[0]
    if B < 2:
        return z.sum() * 0.0
    flat = z.flatten(1)
    i, j = torch.triu_indices(B, B, offset=1, device=z.device)
    sq = (flat[i] - flat[j]).pow(2).sum(dim=1)  # torch.pdist(z).pow(2), pairs in the same order
    nonzero = sq > 0
    ordered = torch.where(nonzero, sq, torch.full_like(sq, math.inf)).sort().values
    sigma = ordered.gather(0, ((nonzero.sum() - 1).clamp_min(0) // 2).view(1))
    return torch.exp(-sq / sigma).mean()


def _classifier(model: nn.Module) -> nn.Module:
    head = getattr(model, "classifier", None)
    if not isinstance(head, nn.Module):
        raise ConfigError(
            f"algorithm feduv needs a model with .classifier (every hpcfl model has one); {type(model).__name__} does not"
        )
    return head


class FedUV(Algorithm[FedUVParams, ServerState, ClientState]):
    name = "feduv"
    dp_refusal = "its regularised local objective is not the one DP-FedAvg/DP-SGD analyse"
    Params = FedUVParams
    divergence_params = ("variance_weight", "uniformity_weight")  # scale the local loss
    unbatched_reason = "its local loss reads the classifier's input and output through hooks"

    def __init__(self, params: FedUVParams, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self._loss: tuple[nn.Module, LossFn, LossFn] | None = None  # (model, task loss, regularised)

    def regularised(self, model: nn.Module, task_loss: LossFn) -> LossFn:
        """ℓ_task + λℓ_V + μℓ_U on ``model`` (a hook on its classifier keeps z and the logits); built
        once per working model."""
        if self._loss is not None and self._loss[0] is model and self._loss[1] is task_loss:
            return self._loss[2]
        lam, mu, gamma = (
            self.params.variance_weight,
            self.params.uniformity_weight,
            self.params.variance_target,
        )
        seen: dict[str, Tensor] = {}

        def keep(module: nn.Module, inputs: Any, output: Tensor) -> None:
            if module.training:  # local training only; evaluation's forwards keep nothing
                seen["z"], seen["logits"] = inputs[0], output

        _classifier(model).register_forward_hook(keep)

        def loss_fn(m: nn.Module, xb: Tensor, yb: Tensor) -> Tensor:
            seen.clear()
            loss = task_loss(m, xb, yb)
            if "logits" not in seen:  # the hook is the working model's own; a copy has none
                raise ValueError("feduv: the task loss did not run the model's classifier")
            logits, z = seen.pop("logits"), seen.pop("z")
            target = gamma if gamma is not None else iid_variance_target(logits.shape[-1])
            if lam:
                loss = loss + lam * variance_loss(logits.softmax(dim=-1), target)
            if mu:
                loss = loss + mu * uniformity_loss(z)
            return loss

        self._loss = (model, task_loss, loss_fn)
        return loss_fn

    def local_task(
        self, server: ServerState, client: ClientState, data: ClientData, ctx: ClientContext
    ) -> LocalTask[ClientState]:
        weighting = self.params.weighting
        loss_fn = None
        if self.params.variance_weight or self.params.uniformity_weight:
            assert ctx.trainer is not None
            loss_fn = self.regularised(ctx.trainer.flat.model, ctx.trainer.loss_fn)
        return LocalTask(
            server.x,
            lambda y, result: (model_upload(y, data, result, weighting=weighting), client),
            loss_fn=loss_fn,
        )
