"""The round's one allreduced buffer: named segments packed end to end.

Every declared sum of the algorithm's exchange and the runner's own channels (total weight,
participant count, non-finite flags, client metrics, CKA slots) live in one contiguous tensor, so a
round costs ONE allreduce whatever the algorithm. The benchmarks size their buffers with the same
object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BufferLayout:
    """Segments ``(name, length)`` in order; :meth:`view` gives a segment of a packed buffer."""

    segments: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, segments: Sequence[tuple[str, int]]) -> BufferLayout:
        names = [n for n, _ in segments]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate buffer segments: {names}")
        return cls(tuple((n, int(length)) for n, length in segments))

    @property
    def size(self) -> int:
        return sum(length for _, length in self.segments)

    def offset(self, name: str) -> tuple[int, int]:
        start = 0
        for n, length in self.segments:
            if n == name:
                return start, start + length
            start += length
        raise KeyError(name)

    def view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        a, b = self.offset(name)
        return buf[a:b]

    def allocate(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.zeros(self.size, dtype=dtype, device=device)

    def nbytes(self, dtype: torch.dtype) -> int:
        return self.size * dtype.itemsize
