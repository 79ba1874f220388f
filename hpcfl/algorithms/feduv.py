"""FedUV (Son, Kim, Chung, Huang & Liu, "FedUV: Uniformity and Variance for Heterogeneous Federated
Learning", CVPR 2024; by FedCKA's authors).

FedAvg whose local objective adds two regularisers that make a client's training behave as if its
data were IID (no global model or previous model is needed, unlike FedProx, MOON or FedCKA):

    ℓ = ℓ_task + μ·ℓ_V + λ·ℓ_U

- ℓ_V, classifier variance: with p = softmax(logits) over a mini-batch of B samples (B, C), the
  standard deviation of each class dimension over the batch, s_j = sqrt(Var_b(p_{b,j}) + ε), is
  pushed up to a target γ by a hinge, ℓ_V = (1/C) Σ_j max(0, γ − s_j) (the VICReg-style variance
  term the paper applies to the classifier's probabilities). Under IID data a batch holds every
  class and a confident classifier's p_{·,j} is a Bernoulli(1/C) column, so the default target is
  its standard deviation γ = sqrt((1/C)(1 − 1/C)); a client that sees few classes has columns of
  near-zero spread, which ℓ_V penalises.
- ℓ_U, hyperspherical uniformity of the encoder's representation z (the classifier's input, here
  ``model.classifier``'s input), normalised to the unit sphere: ℓ_U = log mean_{i<j}
  exp(−t‖z_i − z_j‖²) with t = 2 (the Gaussian-potential uniformity of Wang & Isola, ICML 2020,
  that the paper adopts).

Population variance (ddof 0) is used, so a batch of one sample has zero spread and no pairs (both
terms constant, no gradient) instead of NaN. ε = 1e-4.

Defaults: μ = 1 and λ = 1 (``variance_weight``, ``uniformity_weight``): NOT the paper's values,
which were not at hand (no copy of the paper or its code here); tune them on validation. The exact
forms above (ε, t, γ, ddof) are this implementation's reading of the paper's two terms and should
be checked against its Eqs. before a comparison is published. With both weights 0 the local objective is
the task loss alone and FedUV is FedAvg bit for bit. The regularised loss runs hooks on the working
model, so participants train one by one under ``client_batch`` (a loss of its own does not vectorise).
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

EPS = 1e-4
T_UNIFORMITY = 2.0


@dataclass(frozen=True)
class FedUVParams(HyperParams):
    """``variance_weight`` μ and ``uniformity_weight`` λ (default 1 each, >= 0);
    ``variance_target`` γ (None: the IID value sqrt((1/C)(1 − 1/C)) for C classes);
    ``weighting``: the server's model mean (``samples`` default, FedAvg's)."""

    variance_weight: float = 1.0
    uniformity_weight: float = 1.0
    variance_target: float | None = None
    weighting: str = "samples"

    def __post_init__(self) -> None:
        check_weighting(self.weighting)
        for key in ("variance_weight", "uniformity_weight"):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"config key 'params.{key}' must be >= 0, got {getattr(self, key)}")
        if self.variance_target is not None and not self.variance_target > 0:
            raise ConfigError(f"config key 'params.variance_target' must be > 0, got {self.variance_target}")


def variance_loss(probs: Tensor, target: float) -> Tensor:
    """ℓ_V of a (B, C) batch of probabilities: mean over classes of max(0, γ − std over the batch)."""
    std = torch.sqrt(probs.var(dim=0, correction=0) + EPS)  # (C,)
    return F.relu(target - std).mean()


def uniformity_loss(z: Tensor) -> Tensor:
    """ℓ_U of a (B, d) batch of representations: log mean_{i<j} exp(−t‖ẑ_i − ẑ_j‖²), ẑ = z/‖z‖."""
    B = z.shape[0]
    if B < 2:
        return z.sum() * 0.0  # no pairs: constant, no gradient
    u = F.normalize(z.flatten(1), dim=1)
    i, j = torch.triu_indices(B, B, offset=1, device=z.device)
    sq = (2.0 - 2.0 * (u @ u.T))[i, j].clamp_min(0.0)  # squared distances on the sphere, (B(B−1)/2,)
    return torch.logsumexp(-T_UNIFORMITY * sq, dim=0) - math.log(sq.numel())


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
    unbatched_reason = "its local loss reads the classifier's input and output through hooks"

    def __init__(self, params: FedUVParams, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self._loss: tuple[nn.Module, LossFn, LossFn] | None = None  # (model, task loss, regularised)

    def regularised(self, model: nn.Module, task_loss: LossFn) -> LossFn:
        """ℓ_task + μℓ_V + λℓ_U on ``model`` (a hook on its classifier keeps z and the logits); built
        once per working model."""
        if self._loss is not None and self._loss[0] is model and self._loss[1] is task_loss:
            return self._loss[2]
        mu, lam, gamma = (
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
            C = logits.shape[-1]
            target = gamma if gamma is not None else math.sqrt((1.0 / C) * (1.0 - 1.0 / C))
            if mu:
                loss = loss + mu * variance_loss(logits.softmax(dim=-1), target)
            if lam:
                loss = loss + lam * uniformity_loss(z)
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
