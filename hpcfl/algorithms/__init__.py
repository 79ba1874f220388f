"""Federated algorithms, one module each, behind one registry.

Adding an algorithm is adding a module with an :class:`Algorithm` subclass and one line here.
"""

from __future__ import annotations

from hpcfl.algorithms.base import (
    Algorithm,
    ClientData,
    ClientState,
    HyperParams,
    NonFiniteLoss,
    ServerState,
    Trainer,
    Upload,
)
from hpcfl.algorithms.fedavg import FedAvg
from hpcfl.algorithms.fedprox import FedProx
from hpcfl.algorithms.scaffold import Scaffold

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (FedAvg, FedProx, Scaffold)}

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "ClientData",
    "ClientState",
    "FedAvg",
    "FedProx",
    "HyperParams",
    "NonFiniteLoss",
    "Scaffold",
    "ServerState",
    "Trainer",
    "Upload",
]
