"""The single-process communicator: the embedded default, and the reference for MPI runs."""

from __future__ import annotations

import sys
from typing import Any

import torch

from hpcfl.comm.deadline import CommDeadline


class LocalComm:
    """One rank that owns every client; every collective is the identity."""

    rank = 0
    size = 1
    local_rank = 0
    local_size = 1

    def __init__(self, deadline: CommDeadline | None = None) -> None:
        # never waited on with one rank; carried so the run record states the setting in force
        self.deadline = deadline if deadline is not None else CommDeadline()

    def allreduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        return None

    def abort(self, code: int = 1) -> None:
        sys.exit(code)

    def __repr__(self) -> str:
        return "LocalComm()"
