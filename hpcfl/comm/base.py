"""The communicator interface every part of hpcfl talks through.

Only this package knows whether it runs in one process or under MPI; algorithms and the round
loop see ``rank``, ``size`` and four collectives. Tensors are summed in place so a round's whole
upload travels as one contiguous buffer in one call.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Communicator(Protocol):
    """Collectives over the ranks of one run (sum is the only reduction hpcfl needs)."""

    rank: int
    size: int
    local_rank: int
    local_size: int  # ranks on this node

    def allreduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place and return it (contiguous tensors only)."""
        ...

    def allgather(self, obj: Any) -> list[Any]:
        """Gather one picklable object (tensors included) from every rank, ordered by rank."""
        ...

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """Broadcast a picklable object from ``root``; every rank returns it."""
        ...

    def barrier(self) -> None:
        """Block until every rank has reached this point."""
        ...

    def abort(self, code: int = 1) -> None:
        """Stop every rank (used when one rank fails alone and the others would hang)."""
        ...
