"""Whether a checkpoint that passed its zip check is this run's, before anything trusts it.

A ``server.pt`` or ``client_k.pt`` can be intact and still not be this run's: a pickle of objects
``torch.load(weights_only=True)`` refuses, another file layout (no ``extra``), or the states of
another algorithm or model. :func:`load_checkpoint <hpcfl.runner.checkpoint.load_checkpoint>`
treats each such file like a damaged one: it names the file and the mismatch and falls back to the
older complete checkpoint. Reading a file here costs what the loader pays again after it.
"""

from __future__ import annotations

import dataclasses
import pickle
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hpcfl.files import read_torch

if TYPE_CHECKING:
    from hpcfl.algorithms.base import Stage
    from hpcfl.runner.federation import Federation

_HEAD_KEYS = ("round", "server", "extra")


@dataclass(frozen=True)
class ExpectedStates:
    """What this run's checkpoints hold: its stage names and, for the stages that train the
    configured model (their states are known before the stage is entered), the field names of the
    server and client states and the shape of the model vector ``x``."""

    stages: tuple[str, ...]
    server_fields: dict[str, frozenset[str]]
    client_fields: dict[str, frozenset[str]]
    x_shape: tuple[int, ...]


def expected_states(fed: Federation, stages: Sequence[Stage]) -> ExpectedStates:
    """The :class:`ExpectedStates` of this run (fresh states of its algorithm: a copy of ``x``)."""
    server = fed.algorithm.init_server(fed.flat.vector)
    client = fed.algorithm.init_client(0, server)
    trained = [s.name for s in stages if s.enter is None]
    server_fields = frozenset(f.name for f in dataclasses.fields(server))
    client_fields = frozenset(f.name for f in dataclasses.fields(client))
    return ExpectedStates(
        stages=tuple(s.name for s in stages),
        server_fields=dict.fromkeys(trained, server_fields),
        client_fields=dict.fromkeys(trained, client_fields),
        x_shape=tuple(server.x.shape),
    )


def read_saved(path: Path) -> tuple[Any, str | None]:
    """``(content, None)`` of one ``torch.save`` file loaded ``weights_only``, or ``(None, why
    not)``: a file of pickled objects is refused there (PyTorch's multi-line advice is no help to a
    user who did not write it)."""
    try:
        data = read_torch(path, device="cpu")  # read to be checked: the host
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
        what = f" ({found.group(1)})" if found else ""
        return (
            None,
            f"it holds pickled objects{what} that a checkpoint never holds and weights_only loading refuses",
        )
    except (RuntimeError, EOFError, ValueError, AttributeError, KeyError) as err:
        return None, f"torch cannot read it ({type(err).__name__})"
    if not isinstance(data, dict):
        return None, f"it holds a {type(data).__name__}, not a checkpoint's dict"
    return data, None


def head_problem(head: dict[str, Any], expected: ExpectedStates | None) -> str | None:
    """Why a loaded ``server.pt`` is not one of this run's checkpoints, or None."""
    missing = [k for k in _HEAD_KEYS if k not in head]
    if missing:
        return f"it has no {', '.join(repr(k) for k in missing)}: another file layout"
    if isinstance(head["round"], bool) or not isinstance(head["round"], int):
        return f"its round is {head['round']!r}"
    if not isinstance(head["server"], dict) or not isinstance(head["extra"], dict):
        return "its server state or extra is not a mapping"
    if expected is None:
        return None
    stage = head["extra"].get("stage", expected.stages[0])
    if stage not in expected.stages:
        return f"it is of stage {stage!r}; this run's stages are {', '.join(expected.stages)}"
    return _fields_problem("server", head["server"], expected.server_fields.get(stage), expected.x_shape)


def client_problem(state: dict[str, Any], stage: str | None, expected: ExpectedStates | None) -> str | None:
    """Why a loaded ``client_k.pt`` is not a client state of this run's ``stage``, or None."""
    if expected is None:
        return None
    return _fields_problem("client", state, expected.client_fields.get(stage or expected.stages[0]), None)


def _fields_problem(
    kind: str, state: dict[str, Any], fields: frozenset[str] | None, x_shape: tuple[int, ...] | None
) -> str | None:
    if fields is None:  # a stage whose states are only known once it is entered
        return None
    if set(state) != fields:
        return (
            f"its {kind} state has fields {', '.join(sorted(map(str, state))) or 'none'}; this run's "
            f"algorithm has {', '.join(sorted(fields)) or 'none'}"
        )
    x = state.get("x")
    if x_shape is not None and isinstance(x, torch.Tensor) and tuple(x.shape) != x_shape:
        return f"its model vector has shape {tuple(x.shape)}; this run's model has {x_shape}"
    return None
