"""The shared shape of FedCKA and MOON: FedAvg whose local loss compares the local model's
representations with those of this round's global model and of the client's previous local model.

The client state is the previous local model. In a client's first round there is none: both
methods then take w_prev = w_g, the comparison term is a constant (log 2) with zero gradient, and
the round is run as plain FedAvg, reporting loss + μ·log 2. Otherwise the two frozen reference
models (:class:`~hpcfl.algorithms.reference.References`, built once per working model) represent
each batch, and the subclass's :meth:`PreviousModelAlgorithm.local_loss` adds its term.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from hpcfl.algorithms.base import (
    Algorithm,
    ClientContext,
    ClientData,
    ClientState,
    HyperParams,
    ServerState,
    Trainer,
    Upload,
)
from hpcfl.algorithms.reference import References, Represent, sample_visits, with_indices
from hpcfl.training.sgd import LocalResult, LossFn


@dataclass
class PreviousModelState(ClientState):
    """prev: the client's local model of the previous round (state vector); None before round 1."""

    prev: Tensor | None = None


P = TypeVar("P", bound=HyperParams)
S = TypeVar("S", bound=PreviousModelState)


class PreviousModelAlgorithm(Algorithm[P, ServerState, S]):
    """Base of FedCKA and MOON; ``Params`` must have ``mu`` and ``cache_mb``."""

    State: type[PreviousModelState] = PreviousModelState
    unbatched_reason = "its local loss runs the previous and the global model beside each client's"

    def __init__(self, params: P, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self._model: nn.Module | None = None  # the working model the references were built from
        self._refs: References | None = None

    def init_client(self, k: int, server: ServerState) -> S:
        return self.State()  # type: ignore[return-value]

    def check_model(self, model: nn.Module) -> None:
        """Fail in round 1 when the model does not suit the method (a ConfigError naming why)."""

    @abstractmethod
    def represent(self, frozen: nn.Module) -> Represent:
        """What a frozen reference model computes of a batch (the compared representations)."""

    @abstractmethod
    def local_loss(
        self, model: nn.Module, task_loss: LossFn, refs: References
    ) -> AbstractContextManager[LossFn]:
        """A context giving the regularised loss of the working ``model`` (hooks are removed on exit)."""

    def references(self, trainer: Trainer) -> References:
        """The two frozen copies, built once per working model (not per client, never per batch)."""
        model = trainer.flat.model
        if self._refs is None or self._model is not model:
            self.check_model(model)
            cache = self.params.cache_mb * 2**20  # type: ignore[attr-defined]
            self._refs = References(model, self.state_size, self.represent, cache_bytes=cache)
            self._model = model
        return self._refs

    def client_update(
        self, server: ServerState, client: S, data: ClientData, ctx: ClientContext
    ) -> tuple[Upload, S]:
        trainer = ctx.trainer
        assert trainer is not None
        self.check_model(trainer.flat.model)
        mu = self.params.mu  # type: ignore[attr-defined]
        if mu == 0 or client.prev is None:
            x, result = trainer.train(server.x, data, ctx.generator)
            loss = result.loss + mu * math.log(2.0)  # the comparison term is log 2 when w_prev = w_g
        else:
            x, result = self._train_regularised(server.x, client.prev, data, trainer, ctx.generator)
            loss = result.loss
        return Upload(sums={"x": x}, weight=float(data.n), metrics={"loss": loss}), self.State(prev=x)  # type: ignore[return-value]

    def _train_regularised(
        self, x0: Tensor, prev: Tensor, data: ClientData, trainer: Trainer, generator: torch.Generator
    ) -> tuple[Tensor, LocalResult]:
        refs = self.references(trainer)
        sched = trainer.schedule
        visits = sample_visits(sched.steps, sched.epochs, sched.batch_size, data.n)
        refs.begin(x0, prev, data.x, visits, chunk=sched.batch_size)
        try:
            with self.local_loss(trainer.flat.model, trainer.loss_fn, refs) as loss_fn:
                indexed = ClientData(k=data.k, x=data.x, y=with_indices(data.y))
                return trainer.train(x0, indexed, generator, loss_fn=loss_fn)
        finally:
            refs.end()
