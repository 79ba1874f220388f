"""FedCKA (Son, Kim & Chung, "Compare Where It Matters: Using Layer-Wise Regularization To Improve
Federated Learning on Heterogeneous Data"): FedAvg with a layer-wise contrastive CKA regulariser.

Local loss (Eq. 1): ℓ = ℓ_sup(w) + μ·ℓ_cka(w; w_g; w_prev) with (Eq. 2)

    ℓ_cka = (1/M) Σₙ −log( e^{CKA(aₙ, aₙ^g)} / (e^{CKA(aₙ, aₙ^g)} + e^{CKA(aₙ, aₙ^prev)}) )

over the first M = 2 "naturally similar" layers (Sec. 3.1), no temperature, linear CKA (Eq. 3) of
the batch's flattened activations a (local model), a^g (this round's global model) and a^prev (this
client's local model of the previous round). The server step is FedAvg's weighted average (Alg. 1).

Which activations (decided here, see :mod:`hpcfl.metrics.layers`): the output of each of the
first M layers, i.e. of the conv *block*: post-ReLU and, where the block pools, post-pool (what the
next layer consumes); for ResNets the stem's post-ReLU output and the first residual block's
output. cnn-proj: ``pool1``, ``pool2``; simplecnn: ``relu1``, ``relu2``; resnet: ``relu1``,
``layer1.0``. Any modules can be named instead (``layers``).

Implementation:

- The local activations are read by forward hooks during the task loss's own forward (no second
  forward of the working model); the global and previous models are frozen copies that run only up
  to the last regularised layer (:class:`~hpcfl.metrics.layers.LayerTap` with ``truncate``), in
  eval mode, without gradient, and (E > 1) once per sample per round
  (:class:`~hpcfl.algorithms.reference.References`).
- CKA in Gram form with every centred Gram formed once (:mod:`hpcfl.metrics.gram`); the debiased
  estimator, and CUDA tensors (the Triton kernel), go through :func:`hpcfl.metrics.fedcka_loss`.
- First round: the paper leaves w_prev undefined before a client has trained. We take w_prev =
  w_g: both CKA terms are then equal, ℓ_cka = log 2 is a constant with zero gradient, and the round
  is plain FedAvg (run as such, without the extra forwards; the reported loss adds μ·log 2). MOON's
  reference code, whose experimental setup FedCKA follows (Sec. 4.1), likewise has no previous
  model in its first round and hence no regularisation gradient.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hpcfl.algorithms.base import HyperParams
from hpcfl.algorithms.previous_model import PreviousModelAlgorithm, PreviousModelState
from hpcfl.algorithms.reference import References, Represent, split_indices
from hpcfl.errors import ConfigError
from hpcfl.metrics.cka import fedcka_loss
from hpcfl.metrics.gram import CentredGram, fedcka_loss_gram
from hpcfl.metrics.layers import LayerTap, check_layers, first_layers
from hpcfl.training.sgd import LossFn

__all__ = ["FedCKA", "FedCKAClientState", "FedCKAParams", "cka_regulariser"]


@dataclass(frozen=True)
class FedCKAParams(HyperParams):
    """FedCKA's hyper-parameters (Son et al., Sec. 3.3 and 4.2).

    mu: weight μ of ℓ_cka. The paper tunes μ ∈ {3, 5, 10}; the best on CIFAR-10 was 3 in three of
        the four settings it reports (Table 1; Table 2 α = 0.5, 0.1) and 5 in one (Table 2, α = 5).
    num_layers: M, how many layers from the input are regularised (Sec. 3.3 and Fig. 5: M = 2).
    layers: module names whose outputs are the regularised activations (see
        :func:`hpcfl.metrics.layers.block_outputs`); ``None`` picks the first ``num_layers`` layers.
    debiased: use the debiased CKA estimator (not in the paper; needs batches of ≥ 4).
    cache_mb: MiB for caching the global and previous models' activations on the client's data for
        the round, used when the round visits samples more than once (E > 1); 0 disables.
    """

    mu: float = 3.0
    num_layers: int = 2
    layers: list[str] | None = None
    debiased: bool = False
    cache_mb: float = 1024.0

    def __post_init__(self) -> None:
        if not self.mu >= 0:
            raise ConfigError(f"config key 'fedcka.mu' must be >= 0, got {self.mu}")
        if self.num_layers < 1:
            raise ConfigError(f"config key 'fedcka.num_layers' must be >= 1, got {self.num_layers}")
        if self.layers is not None and (
            not isinstance(self.layers, (list, tuple))
            or not self.layers
            or not all(isinstance(n, str) for n in self.layers)
        ):
            raise ConfigError(
                f"config key 'fedcka.layers' must be a non-empty list of module names, got {self.layers!r}"
            )
        if self.cache_mb < 0:
            raise ConfigError(f"config key 'fedcka.cache_mb' must be >= 0, got {self.cache_mb}")


@dataclass
class FedCKAClientState(PreviousModelState):
    """prev: the client's local model of the previous round (state vector); None before round 1."""


def cka_regulariser(
    local_acts: Sequence[Tensor],
    global_acts: Sequence[Tensor],
    prev_acts: Sequence[Tensor],
    *,
    debiased: bool,
) -> Tensor:
    """ℓ_cka of Eq. 2. CPU, biased estimator: shared Gram form; otherwise :func:`fedcka_loss`.

    The debiased estimator needs n ≥ 4 samples: a smaller batch (an epoch's last one) is not
    regularised, its ℓ_cka is the constant log 2 of two equal similarities.
    """
    if debiased and local_acts[0].shape[0] < 4:
        return local_acts[0].new_tensor(math.log(2.0))
    if debiased or local_acts[0].is_cuda:
        return fedcka_loss(local_acts, global_acts, prev_acts, debiased=debiased)
    with torch.no_grad():
        global_grams = [CentredGram(a) for a in global_acts]
        prev_grams = [CentredGram(a) for a in prev_acts]
    return fedcka_loss_gram(local_acts, global_grams, prev_grams)


class FedCKA(PreviousModelAlgorithm[FedCKAParams, FedCKAClientState]):
    name = "fedcka"
    dp_refusal = "its loss reads previous local models outside the clipped update"
    legacy_sections = ("fedcka",)
    Params = FedCKAParams
    State = FedCKAClientState

    def __init__(self, params: FedCKAParams, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self._layers: list[str] = []
        self._layers_model: nn.Module | None = None  # the model ``_layers`` were checked against

    def layer_names(self, model: nn.Module) -> list[str]:
        """The regularised layers of ``model`` (``params.layers`` or the first ``num_layers``)."""
        p = self.params
        return list(p.layers) if p.layers is not None else first_layers(model, p.num_layers)

    def check_model(self, model: nn.Module) -> None:
        """:meth:`layer_names`, checked against the model once (a bad name fails in round 1)."""
        if self._layers_model is not model:
            names = self.layer_names(model)
            check_layers(model, names)
            self._layers, self._layers_model = names, model

    def represent(self, frozen: nn.Module) -> Represent:
        tap = LayerTap(frozen, self._layers, truncate=True)
        return lambda x: tap.forward(x)[1]

    @contextmanager
    def local_loss(self, model: nn.Module, task_loss: LossFn, refs: References) -> Iterator[LossFn]:
        mu, debiased = self.params.mu, self.params.debiased
        with LayerTap(model, self._layers) as tap:

            def loss_fn(model: nn.Module, xb: Tensor, target: Tensor) -> Tensor:
                y, idx = split_indices(target)
                tap.reset()
                sup = task_loss(model, xb, y)  # its forward fills the tap
                acts = tap.collect()
                global_acts, prev_acts = refs.batch(xb, idx)
                return sup + mu * cka_regulariser(acts, global_acts, prev_acts, debiased=debiased)

            yield loss_fn
