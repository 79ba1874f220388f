"""The algorithm contract: small objects with pure steps over flat state vectors.

A round is: every client turns the server state into a weighted upload (``client_update``), the
uploads are summed across clients and ranks (one allreduce, done by the runner), and every rank
applies the same ``server_update`` to the sum. Algorithms never see the communicator, the rank or
the file system; their state lives in dataclasses that the runner checkpoints as they are.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from hpcfl.training.flat import FlatModel
from hpcfl.training.sgd import Correction, LocalResult, LocalSchedule, LossFn, cross_entropy_loss, local_sgd


class NonFiniteLoss(Exception):
    """Raised by a client whose local training produced NaN/inf (the runner turns it into a
    collective, user-facing :class:`hpcfl.errors.DivergenceError`)."""


@dataclass
class ServerState:
    """The global model state vector every rank holds identically."""

    x: torch.Tensor


@dataclass
class ClientState:
    """Per-client memory carried across rounds (empty for stateless algorithms)."""


@dataclass(frozen=True)
class ClientData:
    """One client's local training set, already on the training device."""

    k: int
    x: torch.Tensor
    y: torch.Tensor

    @property
    def n(self) -> int:
        return int(self.y.shape[0])


@dataclass
class Upload:
    """A client's contribution to the round: ``weight * payload`` is what gets summed."""

    payload: torch.Tensor
    weight: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class HyperParams:
    """Base class of the per-algorithm hyper-parameter dataclasses (frozen, documented fields)."""


class Trainer:
    """Runs a client's local SGD on the shared working model: load x0, train, read the result."""

    def __init__(
        self, flat: FlatModel, schedule: LocalSchedule, loss_fn: LossFn = cross_entropy_loss
    ) -> None:
        self.flat = flat
        self.schedule = schedule
        self.loss_fn = loss_fn  # the task's loss; algorithms may wrap it (MOON, FedCKA)

    def train(
        self,
        x0: torch.Tensor,
        data: ClientData,
        generator: torch.Generator,
        *,
        loss_fn: LossFn | None = None,
        correction: Correction | None = None,
    ) -> tuple[torch.Tensor, LocalResult]:
        """Local training from state ``x0``; returns the new state vector (a fresh tensor)."""
        self.flat.load(x0)
        result = local_sgd(
            self.flat,
            data.x,
            data.y,
            self.schedule,
            generator,
            loss_fn=loss_fn or self.loss_fn,
            correction=correction,
        )
        if not result.finite:
            raise NonFiniteLoss(f"client {data.k}: non-finite loss after {result.steps} local steps")
        return self.flat.vector.clone(), result


class Algorithm(ABC):
    """Base class: subclasses set ``name`` and ``Params`` and implement the four steps."""

    name: ClassVar[str]
    Params: ClassVar[type[HyperParams]] = HyperParams

    def __init__(self, params: HyperParams, *, num_params: int, state_size: int) -> None:
        self.params = params
        self.num_params = num_params  # trainable entries at the front of the state vector
        self.state_size = state_size  # parameters + float buffers

    def payload_size(self) -> int:
        """Length of a client's payload vector (the allreduced buffer adds the weight)."""
        return self.state_size

    def init_server(self, x0: torch.Tensor) -> ServerState:
        return ServerState(x=x0.clone())

    def init_client(self, k: int, server: ServerState) -> ClientState:
        return ClientState()

    @abstractmethod
    def client_update(
        self,
        server: ServerState,
        client: ClientState,
        data: ClientData,
        trainer: Trainer,
        generator: torch.Generator,
    ) -> tuple[Upload, ClientState]:
        """Local work of one client in one round."""

    def server_update(self, server: ServerState, summed: torch.Tensor, total_weight: float) -> ServerState:
        """Default server step: the weighted average of the payloads is the new state."""
        return dataclasses.replace(server, x=summed / total_weight)


def state_to_dict(state: Any) -> dict[str, Any]:
    """A dataclass state as a plain dict (tensors kept), for ``torch.save(weights_only)``."""
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}


def state_from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Inverse of :func:`state_to_dict`."""
    return cls(**data)
