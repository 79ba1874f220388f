"""CUDA-graph replay of the fused eNTK batch (opt-in: ``cuda_graph=True``, ``entk.cuda_graph``, ``HPCFL_ENTK_CUDA_GRAPH=1``).

On small models the fused batch is bound by host-side Python and kernel launches, not by the GPU
(simplecnn, B = 256, p = 1e5, H200: the batch's device time is about plain training's, its wall
time 2-3×; ``benchmarks/results/entk_profile_cuda.csv``). A CUDA graph records one full batch's
kernels — forward, ``autograd.grad`` to the layer outputs, every gather — once, and replays them
with one launch per batch (PyTorch's "whole-network capture", ``torch.cuda.graph``).

Per (plan, batch key) — the key is the input shape and dtype, the output dtype and the logit —
:meth:`BatchGraphs.action` decides what a batch does:

1. ``eager``: the first full batch of a key (it compiles the Triton kernels and, with
   ``HPCFL_TRITON_AUTOTUNE=1``, tunes them for this shape), every partial batch (the last one of a
   call), and every batch once capturing has failed for the plan;
2. ``capture``: the second full batch of a key. Static input and (B, p) output buffers are
   allocated; the batch runs eagerly on them on a side stream (the warm-up PyTorch's docs ask
   for; the same stream then captures, so per-stream library handles exist before capture, and the
   kernels see the same pointers, so Triton needs no new specialisation); its result is the batch's
   output. The same work is then captured and replayed once, and the replay is compared with
   the eager result ON the device (one read-back per capture); a mismatch or any exception while
   capturing logs one warning naming the reason and turns the graph off for the plan (the
   batch keeps its eager result: never a wrong result, never a crash);
3. ``replay``: later full batches: copy the batch into the static input, ``graph.replay()``, copy
   the static output into the caller's rows. No Python runs per layer.

What a graph bakes in, and how it stays right: it reads the model's parameters and buffers at the
addresses they had when captured — in-place updates (an optimiser step, ``load_state_dict``) are
seen, a replaced tensor (``p.data = ...``, ``model.to``) is not, so the addresses are checked
before every replay and a change recaptures. Each graph has its own scratch workspace and private
memory pool (no pool is shared between graphs, so replay order does not matter), held as long as
the plan is. A model whose forward syncs with the host (``.item()``, a branch on a tensor's value)
cannot be captured (the warning names it); one whose forward takes host-side decisions that change
from batch to batch without a sync (Python randomness) must not use this option: the check sees
only the first replay.

Triton autotuning never runs under capture: a shape is captured only after an eager batch of the
same shape has tuned it, and :func:`triton_kernels._triton.bench_config` refuses to benchmark while
a stream is capturing (the capture then fails, with that reason, and the plan runs eagerly).

On the CPU the option does nothing (one INFO line per process): the same config runs on a CPU node.
Without Triton the torch gathers sync with the host (``unique``, ``tolist``), so the option is
refused with one warning per plan there too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from hpcfl.entk.settings import CUDA_GRAPH_ENV as CUDA_GRAPH_ENV  # named here for callers
from hpcfl.entk.settings import active

log = logging.getLogger("hpcfl.entk")

Action = Literal["eager", "capture", "replay"]

_CPU_NOTED = False


def cuda_graph_wanted(cuda_graph: bool | None) -> bool:
    """The caller's choice, or, when it made none, the setting in force (read on every call): the
    run's ``entk.cuda_graph`` / :data:`CUDA_GRAPH_ENV` (:func:`hpcfl.entk.settings.active`)."""
    if cuda_graph is not None:
        return bool(cuda_graph)
    return active().cuda_graph


def cuda_graph_applies(device: torch.device) -> bool:
    """Whether replay can run on ``device``; on any other device it is a no-op, said once per process."""
    global _CPU_NOTED
    if device.type == "cuda":
        return True
    if not _CPU_NOTED:
        _CPU_NOTED = True
        log.info("eNTK: CUDA-graph replay is a no-op on %s; the fused path runs as usual", device.type)
    return False


def tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of the replay-vs-eager check: float32 rounding (1e-5), wider for half types.

    The replay runs the eager batch's own kernels on the same inputs; only a non-deterministic
    kernel (atomics) can move a value, by a few ulps. A stale address or a wrong kernel is O(1)."""
    return max(1e-5, 8 * torch.finfo(dtype).eps)


def bindings(model: nn.Module) -> tuple[int, ...]:
    """Addresses of the model's parameters and buffers: what a captured graph reads."""
    return tuple(t.data_ptr() for t in model.parameters()) + tuple(t.data_ptr() for t in model.buffers())


@dataclass
class CapturedBatch:
    """One captured batch: the graph, its static buffers, its own scratch workspace, and the
    parameter/buffer addresses it was captured with."""

    graph: Any
    static_in: Tensor
    static_out: Tensor
    workspace: Any
    bindings: tuple[int, ...]

    def replay(self, x: Tensor, rows: Tensor) -> None:
        """Fill ``rows`` (B, p) with the features of ``x`` (B, ...) by one graph launch."""
        with torch.no_grad():  # the static input is a leaf that requires grad
            self.static_in.copy_(x)
        self.graph.replay()
        rows.copy_(self.static_out)


@dataclass
class BatchGraphs:
    """The CUDA graphs of one fused plan, by batch key, and whether capturing failed for it.

    :meth:`action` is the whole decision (pure: no CUDA), :meth:`warmed`, :meth:`captured` and
    :meth:`fail` the transitions."""

    failed: str | None = None
    warm: set[tuple] = field(default_factory=set)
    graphs: dict[tuple, Any] = field(default_factory=dict)
    stream: Any = None
    """The side stream of warm-ups and captures (created on first use)."""

    def action(self, key: tuple, *, full: bool, current: Callable[[], tuple[int, ...]]) -> Action:
        """What a batch of ``key`` does: ``"replay"`` its graph, ``"capture"`` one, or run ``"eager"``.

        ``full``: the batch has ``batch_size`` rows (partial batches are never captured: the last
        batch of each call would add a graph per size). ``current()`` gives the model's parameter
        and buffer addresses (only called when a graph exists); a graph captured with others is
        dropped and the batch captures again."""
        if self.failed is not None or not full:
            return "eager"
        entry = self.graphs.get(key)
        if entry is not None:
            if entry.bindings == current():
                return "replay"
            del self.graphs[key]  # a parameter or buffer was replaced: the graph reads freed memory
            return "capture"
        return "capture" if key in self.warm else "eager"

    def warmed(self, key: tuple) -> None:
        """A full batch of ``key`` ran eagerly (kernels compiled and tuned for its shapes)."""
        self.warm.add(key)

    def captured(self, key: tuple, entry: Any) -> None:
        """``entry`` (a :class:`CapturedBatch`) passed its check: later batches of ``key`` replay it."""
        self.graphs[key] = entry

    def fail(self, reason: str) -> None:
        """Turn replay off for this plan for the rest of the process; one warning naming ``reason``."""
        if self.failed is None:
            log.warning(
                "eNTK: CUDA-graph replay is off for this model (%s); running the fused path eagerly", reason
            )
        self.failed = reason
        self.graphs.clear()


def batch_key(x: Tensor, rows: Tensor, logit: int) -> tuple:
    """What one graph is valid for besides the plan: input shape and dtype, output dtype, logit."""
    return (tuple(x.shape), x.dtype, rows.dtype, logit)


def capture_batch(
    graphs: BatchGraphs,
    key: tuple,
    x: Tensor,
    rows: Tensor,
    *,
    run: Callable[[Tensor, Tensor, Any], None],
    workspace: Any,
    input_dtype: torch.dtype,
    current: tuple[int, ...],
) -> bool:
    """Run the batch eagerly on fresh static buffers (on the side stream) and write its result into
    ``rows``, then capture the same work, replay it once and keep the graph if the replay equals
    the eager result. ``run(x, out, workspace)`` is one fused batch.

    Returns whether ``rows`` holds the batch's features (False: the warm-up failed for a reason the
    eager path may not share, replay is off, and the caller runs the batch eagerly).

    Raises:
        Unsupported: from the eager warm-up (the model is not fusable; the caller falls back).
    """
    from hpcfl.entk.layers import Unsupported

    device = rows.device
    current_stream = torch.cuda.current_stream(device)
    try:
        if graphs.stream is None:
            graphs.stream = torch.cuda.Stream(device=device)
        stream = graphs.stream
        static_in = torch.empty(x.shape, dtype=input_dtype, device=device)
        if static_in.is_floating_point():
            static_in.requires_grad_(True)
        static_out = torch.empty(rows.shape, dtype=rows.dtype, device=device)
        with torch.no_grad():
            static_in.copy_(x)
        stream.wait_stream(current_stream)
        with torch.cuda.stream(stream):  # warm-up on the stream that captures
            run(static_in, static_out, workspace)
        current_stream.wait_stream(stream)
    except Unsupported:
        raise
    except Exception as err:  # noqa: BLE001 - replay off, the batch runs eagerly
        graphs.fail(f"the warm-up batch failed: {_reason(err)}")
        _recover(device)
        return False
    reference = static_out.clone()  # (B, p), on the caller's stream
    rows.copy_(reference)
    try:
        graph = torch.cuda.CUDAGraph()
        # the outer context restores the caller's stream even when capture_end raises
        # (torch.cuda.graph then skips its own stream exit)
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            run(static_in, static_out, workspace)
        graph.replay()
        rtol = tolerance(rows.dtype)
        atol = rtol * reference.abs().amax()
        close = (static_out - reference).abs() <= atol + rtol * reference.abs()
        close |= static_out.isnan() & reference.isnan()
        mismatched = int((~close).sum())  # host: the one read-back per capture
    except Exception as err:  # noqa: BLE001 - any capture failure means eager, never a crash
        graphs.fail(f"capture failed: {_reason(err)}")
        _recover(device)
        return True
    if mismatched:
        graphs.fail(
            f"the first replay differs from the eager batch in {mismatched} of {close.numel()} values"
        )
        return True
    graphs.captured(key, CapturedBatch(graph, static_in, static_out, workspace, current))
    return True


def _reason(err: BaseException) -> str:
    """``Type: first line of the message`` (CUDA errors span many lines)."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _recover(device: torch.device) -> None:
    """After a failed capture: wait for the device so a pending error surfaces here, not later."""
    try:
        torch.cuda.synchronize(device)
    except Exception as err:  # noqa: BLE001 - reported, the caller continues eagerly
        log.warning("eNTK: after the failed CUDA-graph capture, synchronize raised %s", err)
