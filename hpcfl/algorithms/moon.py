"""MOON (Li, He & Song, "Model-Contrastive Federated Learning", CVPR 2021).

FedAvg whose local loss adds a model-contrastive term on the representation z (the projection head's
output; the input of the classifier):

    ℓ = ℓ_sup + μ·ℓ_con,   ℓ_con = −log( exp(sim(z, z_glob)/τ) / (exp(sim(z, z_glob)/τ) + exp(sim(z, z_prev)/τ)) )

averaged over the batch, with sim the cosine similarity, z_glob the representation of this round's
global model and z_prev that of the client's local model of the previous round (its Eq. 3, buffer
of one previous model as in the reference code's default ``model_buffer_size=1``).

Defaults: τ = 0.5 and μ = 1, the reference implementation's defaults (github.com/QinbinLi/MOON,
``main.py``: ``--temperature 0.5``, ``--mu 1``); the paper tunes μ ∈ {0.1, 1, 5, 10} (as FedCKA
Sec. 4.2 repeats: "for MOON, we tune μ from [0.1, 1, 5, 10]", "we use τ = 0.5 as reported in their
work"), and the reference README runs CIFAR-10 with μ = 5.

Implementation: z of the local model is read by a forward pre-hook on ``model.classifier`` during
the task loss's own forward (for every :mod:`hpcfl.models` model that input is ``features(x)``, for
cnn-proj the 256-d projection); the global and previous models are frozen copies that run only
``features(x)`` (no classifier), in eval mode as in the reference code, without gradient, and
(E > 1) once per sample per round (:class:`~hpcfl.algorithms.reference.References`).

First round: no previous model exists. The reference code then has an empty model pool, i.e. a
contrastive term with no negative and no gradient; we equivalently take z_prev = z_glob (ℓ_con = log 2,
zero gradient) and run the round as plain FedAvg, reporting the loss plus μ·log 2.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hpcfl.algorithms.base import HyperParams
from hpcfl.algorithms.previous_model import PreviousModelAlgorithm, PreviousModelState
from hpcfl.algorithms.reference import References, Represent, split_indices
from hpcfl.errors import ConfigError
from hpcfl.training.sgd import LossFn

__all__ = ["Moon", "MoonClientState", "MoonParams", "moon_contrastive_loss"]


@dataclass(frozen=True)
class MoonParams(HyperParams):
    """MOON's hyper-parameters (Li et al. 2021, Sec. 3 and 4.1; reference-code defaults).

    mu: weight μ of the model-contrastive term (reference code default 1; tuned in {0.1, 1, 5, 10}).
    temperature: τ of the contrastive softmax (0.5, as in the paper and its code).
    cache_mb: MiB for caching the global and previous models' representations of the client's data
        for the round, used when the round visits samples more than once (E > 1); 0 disables.
    """

    mu: float = 1.0
    temperature: float = 0.5
    cache_mb: float = 1024.0

    def __post_init__(self) -> None:
        if not self.mu >= 0:
            raise ConfigError(f"config key 'moon.mu' must be >= 0, got {self.mu}")
        if not self.temperature > 0:
            raise ConfigError(f"config key 'moon.temperature' must be > 0, got {self.temperature}")
        if self.cache_mb < 0:
            raise ConfigError(f"config key 'moon.cache_mb' must be >= 0, got {self.cache_mb}")


@dataclass
class MoonClientState(PreviousModelState):
    """prev: the client's local model of the previous round (state vector); None before round 1."""


def moon_contrastive_loss(z: Tensor, z_glob: Tensor, z_prev: Tensor, temperature: float) -> Tensor:
    """ℓ_con of MOON's Eq. 3 averaged over the batch; z, z_glob, z_prev are (B, d)."""
    sims = torch.stack(
        [F.cosine_similarity(z, z_glob, dim=-1), F.cosine_similarity(z, z_prev, dim=-1)], dim=1
    )  # (B, 2)
    logits = sims / temperature
    return (torch.logsumexp(logits, dim=1) - logits[:, 0]).mean()  # cross-entropy with label 0


def _classifier(model: nn.Module) -> nn.Module:
    """``model.classifier``, whose input is ``model.features(x)`` in every :mod:`hpcfl.models` model."""
    head = getattr(model, "classifier", None)
    if not isinstance(head, nn.Module) or not callable(getattr(model, "features", None)):
        raise ConfigError(
            f"algorithm moon needs a model with .features() and .classifier (every hpcfl model "
            f"has them); {type(model).__name__} does not"
        )
    return head


class _ClassifierInput:
    """A forward pre-hook keeping the input of ``model.classifier`` (the representation z)."""

    def __init__(self, model: nn.Module) -> None:
        self.value: Tensor | None = None
        self._handle = _classifier(model).register_forward_pre_hook(self._hook)

    def _hook(self, module: nn.Module, inputs: Any) -> None:
        self.value = inputs[0]

    def take(self) -> Tensor:
        if self.value is None:
            raise ValueError("the task loss did not run the model's classifier")
        z, self.value = self.value, None
        return z

    def __enter__(self) -> _ClassifierInput:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._handle.remove()


def _features(frozen: nn.Module) -> Represent:
    return lambda x: [frozen.features(x)]  # (B, d): the representation only, no classifier


class Moon(PreviousModelAlgorithm[MoonParams, MoonClientState]):
    name = "moon"
    dp_refusal = "its contrastive loss reads previous local models outside the clipped update"
    legacy_sections = ("moon",)
    Params = MoonParams
    State = MoonClientState

    def check_model(self, model: nn.Module) -> None:
        _classifier(model)

    def represent(self, frozen: nn.Module) -> Represent:
        return _features(frozen)

    @contextmanager
    def local_loss(self, model: nn.Module, task_loss: LossFn, refs: References) -> Iterator[LossFn]:
        mu, tau = self.params.mu, self.params.temperature
        with _ClassifierInput(model) as rep:

            def loss_fn(model: nn.Module, xb: Tensor, target: Tensor) -> Tensor:
                y, idx = split_indices(target)
                sup = task_loss(model, xb, y)  # its forward passes z to the classifier
                z = rep.take()  # (B, d)
                (z_glob,), (z_prev,) = refs.batch(xb, idx)
                return sup + mu * moon_contrastive_loss(z, z_glob, z_prev, tau)

            yield loss_fn
