"""General parsers of config values, each reporting the config key it was given.

They know no algorithm: the caller names the key (``client_state_memory``, NTK-FL's
``params.memory_budget``), so a bad value is one line naming the key the user wrote.
"""

from __future__ import annotations

import math
from typing import Any

from hpcfl.errors import ConfigError

#: byte multipliers of the sizes a memory budget may be given in
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def as_integer(value: Any) -> int | None:
    """An integral value as an int in any spelling a config gives it (``2000``, ``2e3``, ``"2e3"``:
    YAML 1.1 reads ``2e3`` as a string), or None for anything else (booleans, fractions, text,
    inf, NaN)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return int(number) if math.isfinite(number) and number.is_integer() else None


def parse_memory_budget(value: Any, key: str = "client_state_memory") -> int | str:
    """``auto`` | ``memory`` | ``disk`` | a byte count such as ``512MB`` or ``2GiB`` (→ int bytes)."""
    text = str(value).strip().lower()
    if text in ("auto", "memory", "disk"):
        return text
    num = text.rstrip("kmgib")
    unit = text[len(num) :]
    try:
        if unit not in SIZE_UNITS:
            raise ValueError
        out = int(float(num) * SIZE_UNITS[unit])
        if out < 0:
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"config key {key!r} must be auto, memory, disk or a size such as 2GB, got {value!r}"
        ) from None
    return out


def parse_client_batch(value: Any, key: str = "client_batch") -> int | str:
    """``auto`` or a positive group size, in any spelling :func:`as_integer` reads (``2e3``)."""
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    n = as_integer(text)
    if n is None or n < 1:
        raise ConfigError(f"config key {key!r} must be auto or a positive integer, got {value!r}")
    return n


def format_bytes(n: float) -> str:
    """``n`` bytes in decimal units to three significant digits ("1 MB", "7.35 TB", "512 B"), so
    a message never says "0.0 GB" of a size that is not zero."""
    n = max(float(n), 0.0)
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"
