"""The two reference implementations: the paper's per-sample loop and ``vmap(grad(...))``.

Both write ``out[rows, :]`` for the sorted coordinate set; both are exact (no approximation beyond
floating point) and serve as ground truth for the fused path.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from hpcfl.entk._common import batches, logit_of, model_device_dtype
from hpcfl.entk.coords import ParamColumns

VMAP_BUDGET_ELEMS = 1 << 26
"""Per-sample gradient elements held at once by ``vmap`` (chunk × P ≤ 2**26, 256 MiB in float32)."""

VMAP_BLOCK_BYTES = 30 << 20
"""Largest single per-sample gradient block of a chunk (chunk × the largest parameter's bytes).
glibc serves blocks below its largest dynamic mmap threshold (32 MiB) from the heap and reuses them
chunk after chunk; larger ones are mapped fresh and page-faulted in every time (~1.5 µs per 4 KiB
page here); within that bound, larger chunks are faster (fewer ops). Measured on the 2-core dev box
(2 threads, p = 1e5, 256 samples), ms for block bounds of 8 / 16 / 24 / 30 MiB: simplecnn 216 /
170 / 137 / 124 (265 in the earlier chunks of 188, 49 MiB blocks); mlp 42 / 31 / 27 / 27 (79 in one
chunk of 256)."""


VMAP_GPU_FREE_FRACTION = 0.5
"""Share of a GPU's free memory (the driver's free memory plus what PyTorch's allocator holds
unallocated) that one vmap chunk may fill: the stated budget of :func:`vmap_chunk` on a GPU, where
the host's cache-sized chunk (165 MB peak for resnet18 on a 141 GB H200, issue 39) starves vmap."""

VMAP_GPU_COPIES = 3
"""A chunk's memory per sample on a GPU in parameter-vector sizes: the per-sample gradients, the
backward's temporaries of their size and the gathered copy (a stated bound: ``hpcfl bench entk``
records the chunk and its peak memory, which checks it)."""


def vmap_memory_budget(device: torch.device) -> int | None:
    """Bytes a vmap chunk may use on ``device``: None on the host (the cache-sized rule of
    :func:`vmap_chunk`), on a GPU :data:`VMAP_GPU_FREE_FRACTION` of its free memory (one query,
    once per call: a host sync outside any step)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(VMAP_GPU_FREE_FRACTION * (free + cached))


def vmap_chunk(
    batch_size: int, param_elems: int, largest_bytes: int, elem_size: int, *, memory_budget: int | None
) -> int:
    """Samples per ``vmap`` chunk, at least 1 and at most ``batch_size``.

    On the host (``memory_budget`` None) the chunk is cache-sized: at most
    :data:`VMAP_BUDGET_ELEMS` per-sample gradient elements and a largest per-parameter block of
    :data:`VMAP_BLOCK_BYTES` (glibc's reused heap). With a budget (a GPU, see
    :func:`vmap_memory_budget`) it is the largest that fits: :data:`VMAP_GPU_COPIES` parameter
    vectors of ``param_elems × elem_size`` bytes per sample.
    """
    if memory_budget is None:
        cap = min(VMAP_BUDGET_ELEMS // max(1, param_elems), VMAP_BLOCK_BYTES // max(1, largest_bytes))
    else:
        cap = memory_budget // max(1, VMAP_GPU_COPIES * param_elems * elem_size)
    return max(1, min(batch_size, cap))


def _cast(x: Tensor, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Inputs to the model's device; floating inputs also to its dtype."""
    return x.to(device=device, dtype=dtype if x.is_floating_point() else None)


def _fixed(model: nn.Module, named: list[tuple[str, nn.Parameter]]) -> dict[str, Tensor]:
    """Detached copies of the parameters outside the scope (constants: no graph to the model)."""
    inside = {name for name, _ in named}
    return {name: t.detach() for name, t in model.named_parameters() if name not in inside}


def loop_features(
    model: nn.Module,
    inputs: Tensor,
    *,
    named: list[tuple[str, nn.Parameter]],
    coords: Tensor,
    logit: int,
    out: Tensor,
    progress: bool,
) -> Tensor:
    """TCT Algorithm 3: per sample, backward of f_logit(x), concatenate the flat gradients, index.

    The gradient is taken w.r.t. detached copies of the parameters (``functional_call``), so the
    model's ``.grad`` fields are untouched and frozen parameters are included like the others.
    """
    device, dtype = model_device_dtype(model)
    names = [name for name, _ in named]
    params = {name: t.detach().requires_grad_(True) for name, t in named}
    params = {**_fixed(model, named), **params}
    coords = coords.to(device)
    for start, stop in batches(inputs.shape[0], 1, progress=progress, desc="eNTK loop"):
        x = _cast(inputs[start:stop], device, dtype)  # (1, ...)
        with torch.enable_grad():
            value = logit_of(functional_call(model, params, (x,)), logit)[0]
            grads = torch.autograd.grad(value, [params[n] for n in names], allow_unused=True)
        flat = torch.cat(
            [
                (g if g is not None else torch.zeros_like(params[n])).reshape(-1)
                for g, n in zip(grads, names, strict=True)
            ]
        )  # (P,)
        out[start].copy_(flat.index_select(0, coords))
    return out


def vmap_features(
    model: nn.Module,
    inputs: Tensor,
    *,
    named: list[tuple[str, nn.Parameter]],
    columns: list[ParamColumns],
    logit: int,
    out: Tensor,
    batch_size: int,
    progress: bool,
) -> Tensor:
    """``vmap(grad(f))`` over ``functional_call`` in chunks of samples (:func:`vmap_chunk`: cache-sized
    on the host, the largest that fits a share of free memory on a GPU).

    Each chunk's per-sample gradients are indexed parameter by parameter straight into the output
    columns, so the (chunk, P) concatenation is never formed.
    """
    device, dtype = model_device_dtype(model)
    params = {name: t.detach() for name, t in named}
    fixed = _fixed(model, named)
    total = sum(t.numel() for t in params.values())
    largest = max((t.numel() * t.element_size() for t in params.values()), default=1)
    elem = max((t.element_size() for t in params.values()), default=4)
    chunk = vmap_chunk(batch_size, total, largest, elem, memory_budget=vmap_memory_budget(device))
    locals_ = [c.local.to(device) for c in columns]

    def f(theta: dict[str, Tensor], x: Tensor) -> Tensor:
        return logit_of(functional_call(model, (fixed, theta), (x.unsqueeze(0),)), logit)[0]

    per_sample = vmap(grad(f), in_dims=(None, 0))
    for start, stop in batches(inputs.shape[0], chunk, progress=progress, desc="eNTK vmap"):
        x = _cast(inputs[start:stop], device, dtype)  # (b, ...)
        with torch.enable_grad():
            grads = per_sample(params, x)  # name -> (b, *shape)
        for col, local in zip(columns, locals_, strict=True):
            if col.n:
                flat = grads[col.name].reshape(stop - start, -1)  # (b, numel)
                out[start:stop, col.col0 : col.col1].copy_(flat.index_select(1, local))
        del grads
    return out
