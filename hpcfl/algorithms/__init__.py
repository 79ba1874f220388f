"""The algorithm contract (public), and the built-in algorithms by name.

Everything an algorithm author needs is exported here: the base class and its typed states
(:class:`Algorithm`, :class:`HyperParams`, :class:`ServerState`, :class:`ClientState`), what a round
exchanges (:class:`Exchange`, :class:`SumSpec`, :class:`Upload`, :class:`Aggregate`), the steps'
contexts (:class:`ClientContext`, :class:`ServerContext`), declared local work (:class:`LocalTask`,
:func:`local_training`, :func:`model_upload`, :class:`Trainer`), stages (:class:`Stage`, and the
stage contract of :mod:`hpcfl.algorithms.stage_types`: :class:`StageInput`, :class:`FederationView`,
:class:`StagePlan`, :class:`RoundPlan`, round :class:`Observer` and its event types), the state
layout and participation rule, the shared server optimisers (:mod:`hpcfl.algorithms.server_opt`) and
:func:`register_algorithm`, and :class:`ConfigError` (:mod:`hpcfl.errors`' one-line error for a
bad hyper-parameter). A plugin's algorithm imports only from here.

Stability: these names and their documented fields and signatures are public. Within a 0.x release
series they change only additively (new optional fields and keyword arguments with defaults); a
change that can break an algorithm written against them is named in the release notes. Modules
below this package not re-exported here are internal.

The registry :data:`ALGORITHMS` (name → class, built-ins and plugins) lives in :mod:`hpcfl.registry`
and imports an algorithm's module only when its name is used; the built-in classes are reachable
here by their class names (``from hpcfl.algorithms import Scaffold``) the same lazy way.
"""

from __future__ import annotations

from typing import Any

from hpcfl.algorithms.base import (
    Aggregate,
    Algorithm,
    Arrival,
    ClientContext,
    ClientData,
    ClientState,
    Exchange,
    HyperParams,
    LocalTask,
    NonFiniteLoss,
    Reducer,
    ServerContext,
    ServerState,
    Stage,
    SumSpec,
    Trainer,
    Upload,
    model_upload,
    state_from_dict,
    state_to_dict,
)
from hpcfl.algorithms.fedavg import local_training
from hpcfl.algorithms.participation import Participation, Population
from hpcfl.algorithms.stage_types import (
    Channel,
    Evaluator,
    FederationView,
    GeneratorFn,
    LocalWork,
    Observer,
    RoundEnd,
    RoundPlan,
    RoundStart,
    StageInput,
    StagePlan,
)
from hpcfl.errors import ConfigError
from hpcfl.registry import ALGORITHMS, register_algorithm
from hpcfl.training.layout import StateLayout


def __getattr__(attr: str) -> Any:
    """A built-in algorithm class by its class name (``from hpcfl.algorithms import Scaffold``):
    the built-ins are imported in registry order until one has that class name."""
    for name in ALGORITHMS.builtin_names():
        cls = ALGORITHMS[name]
        if cls.__name__ == attr:
            return cls
    raise AttributeError(f"module 'hpcfl.algorithms' has no attribute {attr!r}")


__all__ = [
    "ALGORITHMS",
    "Aggregate",
    "Algorithm",
    "Arrival",
    "Channel",
    "ClientContext",
    "ClientData",
    "ClientState",
    "ConfigError",
    "Evaluator",
    "Exchange",
    "FederationView",
    "GeneratorFn",
    "HyperParams",
    "LocalTask",
    "LocalWork",
    "NonFiniteLoss",
    "Observer",
    "Participation",
    "Population",
    "Reducer",
    "RoundEnd",
    "RoundPlan",
    "RoundStart",
    "ServerContext",
    "ServerState",
    "Stage",
    "StageInput",
    "StagePlan",
    "StateLayout",
    "SumSpec",
    "Trainer",
    "Upload",
    "local_training",
    "model_upload",
    "register_algorithm",
    "state_from_dict",
    "state_to_dict",
]
