"""Federated algorithms, one module each, behind one registry.

Adding an algorithm is adding a module with an :class:`Algorithm` subclass and one line here.
"""

from __future__ import annotations

from hpcfl.algorithms.base import (
    Algorithm,
    ClientData,
    ClientState,
    HyperParams,
    LocalTask,
    NonFiniteLoss,
    ServerState,
    Trainer,
    Upload,
)
from hpcfl.algorithms.cp_ntkfl import CPNTKFL
from hpcfl.algorithms.fedadam import FedAdam
from hpcfl.algorithms.fedavg import FedAvg
from hpcfl.algorithms.fedcka import FedCKA
from hpcfl.algorithms.feddyn import FedDyn
from hpcfl.algorithms.fednova import FedNova
from hpcfl.algorithms.fedprox import FedProx
from hpcfl.algorithms.fedpvr import FedPVR
from hpcfl.algorithms.moon import Moon
from hpcfl.algorithms.ntkfl import NTKFL
from hpcfl.algorithms.scaffold import Scaffold
from hpcfl.algorithms.tct import TCT

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls
    for cls in (
        FedAvg,
        FedProx,
        Scaffold,
        TCT,
        Moon,
        FedCKA,
        FedPVR,
        FedDyn,
        FedNova,
        FedAdam,
        NTKFL,
        CPNTKFL,
    )
}

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "ClientData",
    "ClientState",
    "CPNTKFL",
    "FedAdam",
    "FedAvg",
    "FedCKA",
    "FedDyn",
    "FedNova",
    "FedProx",
    "FedPVR",
    "HyperParams",
    "LocalTask",
    "Moon",
    "NTKFL",
    "NonFiniteLoss",
    "Scaffold",
    "TCT",
    "ServerState",
    "Trainer",
    "Upload",
]
