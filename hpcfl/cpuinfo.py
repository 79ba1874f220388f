"""Which CPU this is: its model and the vector extensions that change which kernels run.

Read from /proc/cpuinfo once per process. Benchmarks record it beside their figures
(:mod:`hpcfl.bench.machine`), and the native eNTK kernel's build is keyed by it
(:mod:`hpcfl.entk.native`: nodes of different CPUs sharing a home directory each get their own).
"""

from __future__ import annotations

import platform
from functools import cache

VECTOR_EXTENSIONS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "sve2",
)
"""The /proc/cpuinfo flags that change which kernels torch and oneDNN run (x86 and Arm)."""


@cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (host work: read once per process)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The CPU's model name, with family/model/stepping where the name alone is ambiguous."""
    info = _cpuinfo()
    name = info.get("model name") or info.get("Model") or platform.processor() or platform.machine()
    ids = [f"{key} {info[key]}" for key in ("cpu family", "model", "stepping") if key in info]
    return f"{name} ({', '.join(ids)})" if ids else name


def vector_extensions() -> list[str]:
    """The :data:`VECTOR_EXTENSIONS` this CPU reports, in that order."""
    info = _cpuinfo()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    return [flag for flag in VECTOR_EXTENSIONS if flag in flags]
