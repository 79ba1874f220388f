"""The fused eNTK path: one batched forward + one backward per batch, then per-layer gathers.

In eval mode the samples of a batch do not interact (BatchNorm uses running statistics), so the
gradient of S = Σ_b f_logit(x_b) w.r.t. a layer's output, restricted to sample b, is exactly the
gradient of f_logit(x_b) w.r.t. that sample's output. Forward hooks record each parametrised
layer's input and the *gradient edge* of its output (``torch.autograd.graph.get_gradient_edge``:
the edge of the value as produced, so a later in-place op on the output cannot redirect it); one
``torch.autograd.grad(S, edges)`` then returns every layer's δ without computing any parameter
gradient (the engine only runs the nodes on the path to the requested edges). Each layer plan turns
(a, δ) into its kept coordinates (see :mod:`hpcfl.entk.layers`).

On CPU two things make the batch cheaper (simplecnn, p = 1e5, 256 samples, 2 cores, medians of
20 interleaved batches): the forward runs with channels-last copies of the conv weights, so every
conv activation and δ is channels-last (oneDNN's fast layout; the materialise conv path then unfolds
without a permute): 89 → 79 ms; and the per-layer gathers run as tasks on all cores
(:mod:`hpcfl.entk.tasks`): gathers 45 → 42 ms. A model whose forward cannot take channels-last
activations (a ``.view`` of a conv output) is detected on the first batch and run in its own format.

CPU note: a batch issues a few hundred parallel torch ops (per-layer gathers), against a few dozen
for plain training, so it is more sensitive to OpenMP threads waiting on descheduled peers when
other processes share the cores. Measured on the 2-core dev box at load ~7 (simplecnn, p = 1e5,
256 samples): 1.1-4.2 s per batch with 2 spinning threads, 0.5 s with the gathers on one thread,
0.18 s with ``torch.set_num_threads(1)`` throughout. On shared cores, run with one thread per
process or ``OMP_WAIT_POLICY=PASSIVE``; on dedicated cores the default is fastest.

On CUDA, ``cuda_graph=True`` (or ``HPCFL_ENTK_CUDA_GRAPH=1``) replays full batches as one CUDA
graph, for models whose batch is bound by host-side launches (:mod:`hpcfl.entk.cuda_graph`);
:func:`_fused_batch` is written to be capturable (no host sync, no branch on a tensor's value).

Supported parametrised layers: Linear (2-d inputs, and 3-d sequence inputs with per-sample
gradients summed over positions), Conv2d (zero padding, any stride, dilation, groups),
BatchNorm1d/2d with running statistics, GroupNorm, Embedding, LayerNorm (last dimension). Anything else raises
:class:`~hpcfl.entk.layers.Unsupported` naming the layer type and the reason; the caller falls back
to ``vmap`` for the whole model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.func import functional_call

from hpcfl.entk._common import batches, logit_of, model_device_dtype
from hpcfl.entk.coords import ParamColumns
from hpcfl.entk.cuda_graph import BatchGraphs, batch_key, bindings, capture_batch, cuda_graph_applies
from hpcfl.entk.layers import (
    ConvPlan,
    EmbeddingPlan,
    Form,
    LayerNormPlan,
    LayerPlan,
    LinearPlan,
    NormPlan,
    Task,
    Unsupported,
    Workspace,
)
from hpcfl.entk.tasks import PIECES_PER_THREAD, run_tasks
from triton_kernels import HAS_TRITON

log = logging.getLogger("hpcfl.entk")

_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.GroupNorm)


def structure_signature(model: nn.Module, named: list[tuple[str, nn.Parameter]]) -> tuple:
    """What a cached plan depends on: parameter names, shapes and the owning module types."""
    modules = dict(model.named_modules())
    return tuple(
        (name, tuple(t.shape), type(modules.get(name.rpartition(".")[0], model)).__name__)
        for name, t in named
    )


@dataclass
class FusedPlan:
    """Per-layer plans (module name → plan) for one (model, scope, coordinates, device)."""

    signature: tuple
    layers: dict[str, LayerPlan]
    workspace: Workspace = field(default_factory=Workspace)
    channels_last: bool | None = None
    """Whether the CPU forward runs channels-last (None: not tried yet; False: the model failed)."""
    cl_weights: tuple[tuple, dict[str, Tensor]] | None = None
    """Channels-last copies of the conv weights and the (name, data pointer, version) they copy."""
    graphs: BatchGraphs = field(default_factory=BatchGraphs)
    """CUDA graphs of full batches (``cuda_graph=True``), and whether capturing failed for this plan."""


def _owner_map(model: nn.Module) -> dict[int, list[tuple[str, nn.Module, str]]]:
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, t in module.named_parameters(recurse=False):
            owners.setdefault(id(t), []).append((mod_name, module, attr))
    return owners


def _layer_plan(
    module: nn.Module, cols: dict[str, ParamColumns], device: torch.device, form: Form | None
) -> LayerPlan:
    kind = type(module).__name__
    extra = set(cols) - {"weight", "bias"}
    if extra:
        raise Unsupported(kind, f"parameter(s) {sorted(extra)} of a {kind} are not weight/bias")
    weight, bias = cols.get("weight"), cols.get("bias")
    if isinstance(module, nn.Linear):
        if weight is None:
            raise Unsupported(kind, "a Linear whose weight is outside the scope but whose bias is inside")
        return LinearPlan(module, weight, bias, device, form=form)
    if isinstance(module, nn.Conv2d):
        if weight is None:
            raise Unsupported(kind, "a Conv2d whose weight is outside the scope but whose bias is inside")
        return ConvPlan(module, weight, bias, device, form=form)
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and isinstance(module, _NORMS):
        if module.running_mean is None or module.running_var is None:
            raise Unsupported(kind, "BatchNorm without running statistics normalises with batch statistics")
        return NormPlan(module, weight, bias, device)
    if isinstance(module, nn.GroupNorm):
        return NormPlan(module, weight, bias, device)
    if isinstance(module, nn.Embedding) and weight is not None:
        return EmbeddingPlan(module, weight, device)
    if isinstance(module, nn.LayerNorm) and module.elementwise_affine:
        return LayerNormPlan(module, weight, bias, device)
    raise Unsupported(kind, f"no per-sample gradient gather for {kind} layers")


def build_plan(
    model: nn.Module,
    named: list[tuple[str, nn.Parameter]],
    columns: list[ParamColumns],
    device: torch.device,
    *,
    form: Form | None = None,
) -> FusedPlan:
    """Check every parametrised layer in scope and precompute its index vectors.

    ``form`` forces every Linear and Conv2d weight not kept whole to ``"gather"`` or
    ``"materialise"`` (tests, ``benchmarks/entk_layer_costs.py``); None (the default) lets the cost
    model choose per layer (:func:`hpcfl.entk.layers.choose_layer_form`).

    Raises:
        Unsupported: a layer type without a gather, a parameter shared by several modules, or a
            parameter owned by a module attribute other than weight/bias.
    """
    owners = _owner_map(model)
    per_module: dict[str, tuple[nn.Module, dict[str, ParamColumns]]] = {}
    for (_, t), col in zip(named, columns, strict=True):
        found = owners.get(id(t), [])
        if len(found) != 1:
            raise Unsupported(
                "shared parameter", f"parameter {col.name!r} is registered in {len(found)} modules"
            )
        mod_name, module, attr = found[0]
        per_module.setdefault(mod_name, (module, {}))[1][attr] = col
    layers = {name: _layer_plan(module, cols, device, form) for name, (module, cols) in per_module.items()}
    return FusedPlan(structure_signature(model, named), layers)


def _as_channels_last(grad: Tensor) -> Tensor:
    return grad.contiguous(memory_format=torch.channels_last)


class _Capture:
    """Forward hooks recording (input, input version, output gradient edge) per planned layer.

    ``channels_last``: also hook every other leaf module to keep its output's gradient
    channels-last (the CPU forward's format, see :meth:`_keep_channels_last`). Off the CPU those
    hooks would only cost a slower module call each, so they are not registered."""

    def __init__(self, model: nn.Module, names: list[str], *, channels_last: bool = True) -> None:
        self.records: dict[str, tuple[Tensor, int, Any]] = {}
        modules = dict(model.named_modules())
        self.handles = [modules[name].register_forward_hook(self._hook(name)) for name in names]
        self.channels_last = False
        if channels_last:
            planned = set(names)
            self.handles += [
                module.register_forward_hook(self._keep_channels_last)
                for name, module in modules.items()
                if name not in planned and not any(True for _ in module.children())
            ]

    def _keep_channels_last(self, module: nn.Module, args: tuple, output: Any) -> None:
        """In a channels-last forward, make the gradient of a channels-last output channels-last too.

        A flatten/reshape hands back an NCHW gradient; an elementwise backward (ReLU's
        ``threshold_backward``) on an NCHW gradient and a channels-last saved output takes a slow
        strided path (simplecnn relu3: ~6 ms instead of ~0.4 ms per 256 samples on 2 cores).
        """
        if (
            self.channels_last
            and isinstance(output, Tensor)
            and output.dim() == 4
            and output.requires_grad
            and output.is_contiguous(memory_format=torch.channels_last)
        ):
            output.register_hook(_as_channels_last)

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            kind = type(module).__name__
            if name in self.records:
                raise Unsupported(kind, f"layer {name!r} runs more than once per forward (weight sharing)")
            if not args or not isinstance(args[0], Tensor) or not isinstance(output, Tensor):
                raise Unsupported(kind, f"layer {name!r} is not called on a single tensor")
            if not output.requires_grad:
                raise Unsupported(kind, f"the output of {name!r} does not depend on anything requiring grad")
            act = args[0]
            self.records[name] = (act.detach(), act._version, get_gradient_edge(output))

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def fused_features(
    model: nn.Module,
    inputs: Tensor,
    *,
    plan: FusedPlan,
    logit: int,
    out: Tensor,
    batch_size: int,
    progress: bool,
    cuda_graph: bool = False,
) -> Tensor:
    """Fill ``out`` (n, p) batch by batch with the fused path (model already in eval mode).

    ``cuda_graph``: replay full batches of ``batch_size`` rows as a CUDA graph captured once per
    batch key (see :mod:`hpcfl.entk.cuda_graph`: opt-in, self-checked against the eager batch,
    eager again after any failure; a no-op off CUDA).

    Raises:
        Unsupported: discovered while running (a layer called twice, an in-place op on a layer's
            input, a Linear on 3-d inputs); ``out`` is then partially written.
    """
    device, dtype = model_device_dtype(model)
    workers = torch.get_num_threads() if device.type == "cpu" else 1
    pieces = PIECES_PER_THREAD * workers if workers > 1 else 1
    names = list(plan.layers)
    graphs = plan.graphs if cuda_graph and cuda_graph_applies(device) else None
    if graphs is not None and not HAS_TRITON:
        graphs.fail("Triton is not installed, and the torch gathers sync with the host")
    capture: _Capture | None = None  # hooks registered only for batches that run the Python path

    def run(x: Tensor, rows: Tensor, workspace: Workspace) -> None:
        nonlocal capture
        if capture is None:
            capture = _Capture(model, names, channels_last=_channels_last_possible(plan, x.device))
        _fused_batch(model, x, plan, capture, logit, rows, workspace, pieces, workers)

    try:
        for start, stop in batches(inputs.shape[0], batch_size, progress=progress, desc="eNTK fused"):
            rows = out[start:stop]  # (B, p)
            batch = inputs[start:stop]  # (B, ...)
            if graphs is not None:
                key = batch_key(batch, rows, logit)
                action = graphs.action(key, full=stop - start == batch_size, current=lambda: bindings(model))
                if action == "replay":
                    graphs.graphs[key].replay(batch, rows)
                    continue
                if action == "capture" and capture_batch(
                    graphs,
                    key,
                    batch,
                    rows,
                    run=run,
                    workspace=Workspace(),
                    input_dtype=dtype if batch.is_floating_point() else batch.dtype,
                    current=bindings(model),
                ):
                    continue
            x = batch.to(device=device)
            if x.is_floating_point():  # a leaf requiring grad gives every layer output a grad_fn
                x = x.to(dtype).requires_grad_(True)
            run(x, rows, plan.workspace)
            if graphs is not None and stop - start == batch_size:
                graphs.warmed(key)
    finally:
        if capture is not None:
            capture.close()
    return out


def _fused_batch(
    model: nn.Module,
    x: Tensor,
    plan: FusedPlan,
    capture: _Capture,
    logit: int,
    rows: Tensor,
    workspace: Workspace,
    pieces: int,
    workers: int,
) -> None:
    """One batch: forward, ``autograd.grad`` to every planned layer's output, the layers' gathers
    into ``rows`` (B, p). ``x`` (B, ...) is on the model's device in its dtype (requiring grad when
    floating). No host syncs and no branch on a tensor's value, so it can be captured as a CUDA
    graph: every Python decision here (which layers ran, which reach the logit, the layer forms)
    depends on the model's structure and the batch's shape only."""
    names = list(plan.layers)
    capture.records.clear()
    with torch.enable_grad():
        score = logit_of(_forward(model, x, plan, capture), logit).sum()  # Σ_b f_logit(x_b)
        ran = [name for name in names if name in capture.records]
        edges = [capture.records[name][2] for name in ran]
        deltas = torch.autograd.grad(score, edges, allow_unused=True) if edges else ()
    del score
    done = set()
    work: list[Task] = []
    for name, delta in zip(ran, deltas, strict=True):
        act, version, _ = capture.records.pop(name)
        if act._version != version:
            kind = type(dict(model.named_modules())[name]).__name__
            raise Unsupported(kind, f"the input of {name!r} is modified in place after the layer ran")
        if delta is None:
            continue
        work += plan.layers[name].tasks(_module(model, name), act, delta, rows, workspace, pieces=pieces)
        done.add(name)
    run_tasks(work, workers)
    for name in names:
        if name not in done:
            plan.layers[name].zero(rows)


def _channels_last_weights(model: nn.Module, plan: FusedPlan) -> dict[str, Tensor]:
    """Channels-last copies of the conv weights, cached in the plan until a weight changes."""
    convs = [
        (f"{name}.weight" if name else "weight", module.weight)
        for name, module in model.named_modules()
        if isinstance(module, nn.Conv2d) and module.weight.dim() == 4
    ]
    key = tuple((name, w.data_ptr(), w._version) for name, w in convs)
    if plan.cl_weights is None or plan.cl_weights[0] != key:
        copies = {name: w.detach().clone(memory_format=torch.channels_last) for name, w in convs}
        plan.cl_weights = (key, copies)
    return plan.cl_weights[1]


def _channels_last_possible(plan: FusedPlan, device: torch.device) -> bool:
    """Whether :func:`_forward` may run channels-last: on the CPU, unless the model failed to."""
    return device.type == "cpu" and plan.channels_last is not False


def _forward(model: nn.Module, x: Tensor, plan: FusedPlan, capture: _Capture) -> Any:
    """The batched forward, on CPU with channels-last copies of the conv weights when the model
    accepts them (every conv activation and δ is then channels-last, see ``FusedPlan``)."""
    if not _channels_last_possible(plan, x.device):
        return model(x)
    weights = _channels_last_weights(model, plan)
    if not weights:
        plan.channels_last = False
        return model(x)
    capture.channels_last = True
    try:
        output = functional_call(model, weights, (x,), strict=False)
    except RuntimeError as err:  # e.g. a .view() that needs NCHW strides
        log.debug("eNTK fused: channels-last forward failed (%s); using the model's own format", err)
        plan.channels_last = False
        capture.records.clear()
        return model(x)
    finally:
        capture.channels_last = False
    plan.channels_last = True
    return output


def _module(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name) if name else model


def layer_inputs_and_deltas(
    model: nn.Module, x: Tensor, *, plan: FusedPlan, logit: int = 0
) -> dict[str, tuple[Tensor, Tensor]]:
    """Each planned layer's input ``a`` and output gradient ``δ`` for one batch ``x`` — what its
    plan's tasks take — from the same forward and backward as :func:`fused_features` (model already
    in eval mode); layers that did not run or do not reach the logit are left out. For timing the
    per-layer forms one by one (``benchmarks/entk_layer_costs.py``)."""
    device, dtype = model_device_dtype(model)
    x = x.to(device=device)
    if x.is_floating_point():
        x = x.to(dtype).requires_grad_(True)
    names = list(plan.layers)
    capture = _Capture(model, names, channels_last=_channels_last_possible(plan, x.device))
    try:
        with torch.enable_grad():
            score = logit_of(_forward(model, x, plan, capture), logit).sum()  # Σ_b f_logit(x_b)
            ran = [name for name in names if name in capture.records]
            edges = [capture.records[name][2] for name in ran]
            deltas = torch.autograd.grad(score, edges, allow_unused=True) if edges else ()
    finally:
        capture.close()
    return {
        name: (capture.records[name][0], delta)
        for name, delta in zip(ran, deltas, strict=True)
        if delta is not None
    }
