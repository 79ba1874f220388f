"""Chunk checksums of hpcfl's Zarr stores: one scheme for the eNTK feature store and the client-state store.

Zarr reads a missing chunk file as the array's fill value (zeros) and a damaged one as whatever
its bytes say, so neither store trusts a chunk on its own: each records, at write time, the CRC-32
of every chunk's bytes (uncompressed, C order, little-endian: exactly the bytes of the chunk file,
as neither store compresses) and checks a chunk against it before its data is used. A stat per
chunk (:func:`chunk_file_problem`) finds a deleted or truncated file without reading it; the CRC
(:func:`crc32`) finds flipped bits. The feature store keeps its CRCs in the array's attributes;
the client-state store beside each chunk and in the run's checkpoint
(:mod:`hpcfl.runner.client_states`).
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np


def crc32(data: np.ndarray | bytes, running: int = 0) -> int:
    """CRC-32 of an array's bytes in C order (``running``: the CRC of the bytes before them)."""
    raw = data if isinstance(data, bytes) else np.ascontiguousarray(data).tobytes()
    return zlib.crc32(raw, running)


def chunk_file_problem(path: Path, size: int) -> str | None:
    """What is wrong with a chunk file that must hold ``size`` bytes ("is missing", "has N bytes,
    not M"), or None when it is there at its full size. A stat, no read."""
    try:
        actual = Path(path).stat().st_size
    except FileNotFoundError:
        return "is missing"
    if actual != size:
        return f"has {actual} bytes, not {size}"
    return None
