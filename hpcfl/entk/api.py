"""The entry point :func:`entk_features` and its caches."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from functools import lru_cache

import torch
from torch import Tensor, nn

from hpcfl.entk._common import batches, eval_mode, model_device_dtype
from hpcfl.entk.coords import ParamColumns, coordinate_set, param_columns, scope_parameters
from hpcfl.entk.cuda_graph import cuda_graph_wanted
from hpcfl.entk.fused import FusedPlan, build_plan, fused_features, structure_signature
from hpcfl.entk.layers import Unsupported
from hpcfl.entk.methods import EntkMethod
from hpcfl.entk.reference import loop_features, vmap_features
from hpcfl.errors import ConfigError, unknown

log = logging.getLogger("hpcfl.entk")

# Plans hold index vectors only (no weights), so they stay valid while the model trains. They are
# keyed by the model object (weakly) and by (scope, P, p, seed, device), and stored with the model's
# structure signature (parameter names, shapes, owner types), which is checked on every use. A
# model found unsupported (when planning or while running) is remembered the same way.
_Entry = tuple[tuple, "FusedPlan | Unsupported"]
_PLANS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, _Entry]] = weakref.WeakKeyDictionary()


@lru_cache(maxsize=8)
def _cached_coords(num: int, p: int, seed: int) -> Tensor:
    """randperm(P) costs ~0.1 s for P = 11M; computed once per (P, p, seed)."""
    return coordinate_set(num, p, seed)


def _method(method: EntkMethod | str) -> EntkMethod:
    try:
        return EntkMethod(method)
    except ValueError:
        raise unknown("eNTK method", str(method), [m.value for m in EntkMethod]) from None


def _plan(
    model: nn.Module,
    named: list[tuple[str, nn.Parameter]],
    columns: Callable[[], list[ParamColumns]],
    key: tuple,
    device: torch.device,
) -> FusedPlan:
    """The cached fused plan for ``key``; raises the cached :class:`Unsupported` when not fusable.
    ``columns()`` is only called to build a plan (on a cached plan it would be per-call host work)."""
    per_model = _PLANS.setdefault(model, {})
    signature = structure_signature(model, named)
    entry = per_model.get(key)
    if entry is None or entry[0] != signature:
        try:
            entry = (signature, build_plan(model, named, columns(), device))
        except Unsupported as err:
            entry = (signature, err)
        per_model[key] = entry
    if isinstance(entry[1], Unsupported):
        raise entry[1]
    return entry[1]


def entk_features(
    model: nn.Module,
    inputs: Tensor,
    *,
    p: int,
    seed: int,
    logit: int = 0,
    params: str = "all",
    method: EntkMethod | str = "auto",
    batch_size: int = 256,
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
    out: Tensor | None = None,
    cuda_graph: bool | None = None,
) -> Tensor:
    """Subsampled eNTK features z = S(∂f_logit(x; θ)/∂θ) of each input → Tensor (n, p).

    TCT (Yu et al., NeurIPS 2022), Section 4.1 and Algorithm 3: the gradient of one output logit
    w.r.t. the parameters at the model's current weights, the model in eval mode (the training
    flags of all submodules are restored afterwards), keeping the p coordinates of
    :func:`~hpcfl.entk.coords.coordinate_set` — columns in sorted coordinate order (see
    :mod:`hpcfl.entk.coords` for the exact index space of ``params="all"`` / ``"features"``). TCT
    first replaces the classifier by a fresh seeded 1-output layer and takes logit 0: pass
    ``hpcfl.models.with_fresh_head(model, seed)`` (what stage 2 does,
    :func:`hpcfl.tct.features.convexified_model`). On a C-output model the gradient of one logit
    is identically zero on the other C−1 rows of the classifier.

    Args:
        model: returns logits (B, C); its parameters fix the compute device and dtype (inputs
            are cast to them batch by batch, so ``inputs`` may stay on the CPU).
        inputs: (n, ...) samples.
        p: kept coordinates, 1 ≤ p ≤ P (p = P is the full eNTK).
        seed: seed of the coordinate draw.
        logit: which output's gradient (TCT: 0, the fresh head's only output).
        params: ``"all"`` or ``"features"`` (all but the last layer).
        method: an :class:`EntkMethod` or its value; ``"auto"`` = fused when supported.
        batch_size: samples per forward/backward (vmap uses smaller chunks when 2**26 / P is).
        dtype: dtype of the returned features (the computation runs in the model's dtype).
        progress: show a tqdm bar over samples.
        out: optional (n, p) destination (any device/dtype), e.g. a reused buffer when streaming
            batches to a feature store; it is filled and returned.
        cuda_graph: replay full batches of the fused path as CUDA graphs (one capture per batch
            shape, checked against the eager batch, eager after any failure; see
            :mod:`hpcfl.entk.cuda_graph`). None (the default) reads ``HPCFL_ENTK_CUDA_GRAPH``
            (1 = on) on every call. A no-op on the CPU (one INFO line per process), so one config
            runs on CPU and GPU nodes alike; ignored by ``loop`` and ``vmap``.

    Returns:
        (n, p) features on the model's device (or ``out``).

    Raises:
        ConfigError: bad ``p``, ``params``, ``method``, ``batch_size``, ``dtype``, ``out`` shape, or a
            ``logit`` the model does not have.

    A model the fused path cannot handle (an unsupported parametrised layer type, weight sharing,
    in-place updates of a layer's input) is computed with ``vmap`` instead, logging one line on the
    ``hpcfl.entk`` logger that names the layer type and the reason.
    """
    chosen = _method(method)
    if int(batch_size) < 1:
        raise ConfigError(f"eNTK batch_size must be at least 1, got {batch_size}")
    if not dtype.is_floating_point:
        raise ConfigError(f"eNTK feature dtype must be floating point, got {dtype}")
    named = scope_parameters(model, params)
    total = sum(t.numel() for _, t in named)
    coords = _cached_coords(total, int(p), int(seed))
    device, _ = model_device_dtype(model)
    n = inputs.shape[0]
    if out is None:
        out = torch.empty(n, int(p), dtype=dtype, device=device)
    elif tuple(out.shape) != (n, int(p)):
        raise ConfigError(f"out must have shape {(n, int(p))}, got {tuple(out.shape)}")
    target = (
        out
        if out.device == device
        else torch.empty(min(n, batch_size), int(p), dtype=out.dtype, device=device)
    )
    with eval_mode(model):
        if chosen in (EntkMethod.AUTO, EntkMethod.FUSED):
            key = (params, total, int(p), int(seed), str(device))
            try:
                plan = _plan(model, named, lambda: param_columns(named, coords), key, device)
                graph = cuda_graph_wanted(cuda_graph)
                return _run_fused(model, inputs, plan, logit, out, target, batch_size, progress, graph)
            except Unsupported as err:
                _PLANS.setdefault(model, {})[key] = (structure_signature(model, named), err)
                # torch.func.vmap has no batching rule for the recurrent layers: one sample at a time
                recurrent = any(isinstance(m, nn.RNNBase) for m in model.modules())
                log.warning(
                    "eNTK: fused path does not support %s layers (%s); computing with %s for the whole model",
                    err.layer,
                    err,
                    "a per-sample loop (vmap cannot batch recurrent layers)" if recurrent else "vmap",
                )
                chosen = EntkMethod.LOOP if recurrent else EntkMethod.VMAP
        if chosen is EntkMethod.VMAP:
            columns = param_columns(named, coords)
            return _stage(
                lambda x, dst, bar: vmap_features(
                    model,
                    x,
                    named=named,
                    columns=columns,
                    logit=logit,
                    out=dst,
                    batch_size=batch_size,
                    progress=bar,
                ),
                inputs,
                out,
                target,
                batch_size,
                progress,
            )
        return _stage(
            lambda x, dst, bar: loop_features(
                model, x, named=named, coords=coords, logit=logit, out=dst, progress=bar
            ),
            inputs,
            out,
            target,
            batch_size,
            progress,
        )


def _run_fused(
    model: nn.Module,
    inputs: Tensor,
    plan: FusedPlan,
    logit: int,
    out: Tensor,
    target: Tensor,
    batch_size: int,
    progress: bool,
    cuda_graph: bool,
) -> Tensor:
    def run(x: Tensor, dst: Tensor, bar: bool) -> Tensor:
        return fused_features(
            model,
            x,
            plan=plan,
            logit=logit,
            out=dst,
            batch_size=batch_size,
            progress=bar,
            cuda_graph=cuda_graph,
        )

    return _stage(run, inputs, out, target, batch_size, progress)


def _stage(
    run: Callable[[Tensor, Tensor, bool], object],
    inputs: Tensor,
    out: Tensor,
    target: Tensor,
    batch_size: int,
    progress: bool,
) -> Tensor:
    """``run(x, dst, progress)`` on all the inputs at once when ``out`` is on the model's device (each
    method batches them itself, so its per-call set-up — the fused path's forward hooks, vmap's
    index columns on the device — is paid once per call, not per batch); when ``out`` lives
    elsewhere, batch by batch through ``target`` on the model's device."""
    if target is out:
        run(inputs, out, progress)
        return out
    for start, stop in batches(inputs.shape[0], batch_size, progress=progress, desc="eNTK"):
        dst = target[: stop - start]
        run(inputs[start:stop], dst, False)
        out[start:stop].copy_(dst)
    return out
