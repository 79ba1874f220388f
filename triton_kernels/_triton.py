"""Optional Triton import, shared by every kernel module.

The package must import without Triton (CPU-only installs): ``triton`` and ``tl`` are ``None``
then, and the dispatchers use the pure-torch references. ``TRITON_INTERPRET=1`` must be set before
the first ``import triton`` for the interpreter to run kernels on CPU tensors (the tests do that).
"""

from __future__ import annotations

import os
from typing import Any

import torch

try:  # pragma: no cover - exercised by whichever environment runs the tests
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    triton: Any = None  # type: ignore[no-redef]
    tl: Any = None  # type: ignore[no-redef]
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
"""True when Triton runs kernels in its CPU interpreter (tests without a GPU)."""

AUTOTUNE = os.environ.get("HPCFL_TRITON_AUTOTUNE", "0").strip().lower() not in ("", "0", "false", "no", "off")
"""Whether the eNTK gathers launch their ``triton.autotune`` variant (tile sizes chosen per shape
by timing every config once, on the first call of each shape) instead of their fixed tiles. Off by
default until a GPU session has measured it (``benchmarks/entk_layer_costs.py --autotune``); set
``HPCFL_TRITON_AUTOTUNE=1`` before importing the kernels to turn it on. A run sets it from its
``entk.triton_autotune`` (overridden by the variable) for its duration (:mod:`hpcfl.entk.settings`)."""

AUTOTUNE_WARMUP_MS, AUTOTUNE_REP_MS = 5.0, 20.0
"""``triton.testing.do_bench``'s windows per config while autotuning (short: a model's first batch
tunes every layer's shape)."""


def bench_config(fn: Any, quantiles: Any = None) -> Any:
    """How ``triton.autotune`` times one config: ``triton.testing.do_bench`` on a GPU; under the
    interpreter one untimed run (every config is still launched once, and the first one is kept).

    Refuses to time anything while a CUDA graph is being captured (the timing syncs and would
    record every config's launches into the graph): the fused eNTK path captures a shape only after
    an eager batch of it has been tuned, so this fires only if that order is broken, and the
    capture then fails with this reason and the batch runs eagerly."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "Triton autotune would time kernels during CUDA-graph capture (HPCFL_TRITON_AUTOTUNE=1): "
            "run one eager batch of this shape first"
        )
    if INTERPRET:
        fn()
        return [1.0, 1.0, 1.0] if quantiles is not None else 1.0
    from triton.testing import do_bench

    return do_bench(fn, warmup=AUTOTUNE_WARMUP_MS, rep=AUTOTUNE_REP_MS, quantiles=quantiles)


def autotune(configs: list[dict[str, int]], key: list[str]) -> Any:
    """``triton.autotune`` over tile sizes (``num_warps`` given in each config dict), timed by
    :func:`bench_config`; None when Triton is missing or its ``autotune`` takes no ``do_bench``
    (the gathers then keep their fixed tiles)."""

    def wrap(kernel: Any) -> Any:
        if not HAS_TRITON:
            return None
        tiles = [
            triton.Config({k: v for k, v in c.items() if k != "num_warps"}, num_warps=c.get("num_warps", 4))
            for c in configs
        ]
        try:  # bench_config looked up on each call, so a test can watch every config's run
            return triton.autotune(
                configs=tiles, key=key, do_bench=lambda fn, quantiles: bench_config(fn, quantiles)
            )(kernel)
        except TypeError:  # pragma: no cover - a Triton older than autotune's do_bench argument
            return None

    return wrap


def jit(fn: Any) -> Any:
    """``triton.jit`` when Triton is installed; otherwise the plain function (never launched)."""
    return triton.jit(fn) if HAS_TRITON else fn


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether a dispatcher should launch the Triton kernel for these tensors (all on CUDA)."""
    return HAS_TRITON and all(t.is_cuda for t in tensors)


def require_triton(*tensors: torch.Tensor) -> None:
    """Raise when a ``*_triton`` function cannot run here (no Triton, or CPU tensors without the interpreter)."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use the *_reference function or the dispatcher")
    if not INTERPRET and not all(t.is_cuda for t in tensors):
        raise RuntimeError(
            "Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before importing triton)"
        )


def check_out(out: torch.Tensor | None, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    """Validate a caller's ``out`` (rows, cols) with unit column stride, or allocate one like ``like``."""
    if out is None:
        return torch.empty(rows, cols, dtype=like.dtype, device=like.device)
    if out.shape != (rows, cols):
        raise ValueError(f"out must have shape {(rows, cols)}, got {tuple(out.shape)}")
    if out.device != like.device:
        raise ValueError(f"out is on {out.device}, inputs on {like.device}")
    return out


def check_index(name: str, index: torch.Tensor, n: int, bound: int) -> None:
    """Shape/dtype sanity of one index vector (values are the caller's responsibility: no sync)."""
    if index.dim() != 1 or index.numel() != n:
        raise ValueError(f"{name} must be a vector of length {n}, got shape {tuple(index.shape)}")
    if index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {index.dtype}")
    del bound  # documented range; checking it would force a device sync


def compute_dtype(t: torch.Tensor) -> Any:
    """Triton accumulation dtype for inputs like ``t``: float64 for float64, float32 otherwise."""
    return tl.float64 if t.dtype == torch.float64 else tl.float32
