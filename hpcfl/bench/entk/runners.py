"""What each method of ``hpcfl bench entk`` runs: the model and batch of a spec, and one closure per
method that fills the same (B, p) features (:func:`make_runner`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MODELS = ("simplecnn", "mlp", "resnet18", "resnet8", "vgg11", "char-transformer", "char-lstm")
METHODS = ("loop", "vmap", "fused", "fused-graph", "opacus", "opacus-functorch", "backpack")
OPACUS_MODES = {"opacus": "hooks", "opacus-functorch": "functorch"}
INPUT_SHAPES = {"simplecnn": (1, 28, 28), "mlp": (1, 28, 28)}
CIFAR_SHAPE = (3, 32, 32)


def input_shape(model: str) -> tuple[int, int, int]:
    """The input shape a model is timed on: Fashion-MNIST's, CIFAR's, or for a text model (``char-``)
    Shakespeare's ``(1, 1, L)`` with LEAF's sequence length L = 80."""
    from hpcfl.models import TEXT_MODELS

    if model in TEXT_MODELS:
        from hpcfl.data.shakespeare import SEQ_LEN

        return (1, 1, SEQ_LEN)
    return INPUT_SHAPES.get(model, CIFAR_SHAPE)


def bench_model(name: str, shape: tuple[int, ...], options: dict[str, Any]) -> Any:
    """Model ``name`` for inputs of ``shape``: 10 classes for images; a text model (``char-``) reads
    symbol codes of Shakespeare's 80-symbol vocabulary and gives logits over it."""
    from hpcfl.models import TEXT_MODELS, build_model

    if name in TEXT_MODELS:
        from hpcfl.data.shakespeare import VOCAB

        return build_model(name, shape, len(VOCAB), vocab_size=len(VOCAB), **options)
    return build_model(name, shape, 10, **options)


def model_and_batch(spec: dict[str, Any]) -> tuple[Any, Any]:
    """A spec's model (:func:`bench_model`, seeded with ``spec["seed"]``, on its device, eval mode) and
    a random batch of ``spec["batch"]`` inputs of ``spec["input_shape"]``: images, or for a text model
    symbol codes ``(B, L)`` (uint8, as the text datasets keep them)."""
    import torch

    from hpcfl.models import TEXT_MODELS

    torch.manual_seed(spec["seed"])
    shape = tuple(spec["input_shape"])
    device = torch.device(spec["device"])
    model = bench_model(spec["model"], shape, model_options(spec)).to(device).eval()
    if spec["model"] in TEXT_MODELS:
        vocab = model.classifier.out_features
        return model, torch.randint(0, vocab, (spec["batch"], shape[-1]), dtype=torch.uint8, device=device)
    return model, torch.randn(spec["batch"], *shape, device=device)


def parse_methods(text: str) -> list[str]:
    """Validate ``--methods``."""
    from hpcfl.errors import unknown

    methods = [m.strip() for m in text.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            raise unknown("benchmark method", m, METHODS)
    return methods


def _gather_into(out: Any, grads: list[Any], columns: list[Any]) -> None:
    """Index per-parameter per-sample gradients (B, *shape) into the output columns."""
    for g, col in zip(grads, columns, strict=True):
        if col.n:
            out[:, col.col0 : col.col1].copy_(
                g.reshape(g.shape[0], -1).index_select(1, col.local.to(g.device))
            )


def _vmap_note(named: list[tuple[str, Any]], batch: int, device: Any) -> str:
    """The vmap row's note: the chunk :func:`~hpcfl.entk.reference.vmap_chunk` gives here, and why."""
    from hpcfl.entk.reference import vmap_chunk, vmap_memory_budget

    tensors = [t for _, t in named]
    budget = vmap_memory_budget(device)
    chunk = vmap_chunk(
        batch,
        sum(t.numel() for t in tensors),
        max((t.numel() * t.element_size() for t in tensors), default=1),
        max((t.element_size() for t in tensors), default=4),
        memory_budget=budget,
    )
    rule = "cache-sized" if budget is None else f"fits {budget / 2**20:,.0f} MiB, half the free memory"
    return f"chunk {chunk} of {batch} ({rule})"


def make_runner(spec: dict[str, Any]) -> tuple[Callable[[], None], int, str, Any]:
    """(run once, samples per run, note, the (B, p) features it writes) for one method."""
    import torch

    from hpcfl.entk import entk_features
    from hpcfl.entk.coords import coordinate_set, param_columns, scope_parameters

    model, x = model_and_batch(spec)
    device = x.device
    batch, p, method = spec["batch"], spec["p"], spec["method"]
    named = scope_parameters(model, "all")
    columns = param_columns(named, coordinate_set(sum(t.numel() for _, t in named), p, spec["seed"]))
    out = torch.empty(batch, p, device=device)
    note = ""

    if method in ("vmap", "fused", "fused-graph"):
        if method == "vmap":
            note = _vmap_note(named, batch, device)
        graph = method == "fused-graph"

        def run() -> None:
            entk_features(
                model,
                x,
                p=p,
                seed=spec["seed"],
                method="fused" if graph else method,
                batch_size=batch,
                out=out,
                cuda_graph=graph,
            )

        if graph:
            note = _graph_setup(run, device)
        return run, batch, note, out
    if method == "loop":
        n = min(batch, spec["loop_samples"])
        xl, outl = x[:n], out[:n]

        def run() -> None:
            entk_features(model, xl, p=p, seed=spec["seed"], method="loop", out=outl)

        return run, n, note, outl
    if method == "plain":
        note = "forward+backward, parameter gradients only"
        # cuDNN's RNN backward refuses eval mode; plain training runs in train mode, which for a model
        # without dropout or BatchNorm (the text models) is the same function
        train = device.type == "cuda" and any(isinstance(m, torch.nn.RNNBase) for m in model.modules())
        if train:
            note += ", train mode (cuDNN's recurrent backward; no dropout or BatchNorm: same function)"

        def run() -> None:
            if train:
                model.train()
            model.zero_grad(set_to_none=True)
            model(x)[:, 0].sum().backward()
            if train:
                model.eval()

        return run, batch, note, out
    if method in OPACUS_MODES:
        from opacus import GradSampleModule

        if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            raise RuntimeError("Opacus does not compute per-sample gradients through BatchNorm")
        mode = OPACUS_MODES[method]
        gsm = GradSampleModule(
            model, batch_first=True, loss_reduction="sum", force_functorch=mode == "functorch"
        )
        gsm.train()  # Opacus records activations in train mode only (same function: no BN/dropout)
        params = [t for _, t in named]

        def run() -> None:
            for t in params:
                t.grad_sample = None
                t.grad = None
            gsm(x)[:, 0].sum().backward()
            _gather_into(out, [t.grad_sample for t in params], columns)

        return run, batch, f"{mode}, train mode (no BN/dropout: same function)", out
    if method == "backpack":
        from backpack import backpack, extend
        from backpack.extensions import BatchGrad

        ext = extend(model)

        def run() -> None:
            ext.zero_grad(set_to_none=True)
            with backpack(BatchGrad()):
                ext(x)[:, 0].sum().backward()
            missing = [name for name, t in named if getattr(t, "grad_batch", None) is None]
            if missing:
                raise RuntimeError(
                    f"BackPACK BatchGrad gave no per-sample gradient for {len(missing)} parameters "
                    f"(first: {missing[0]}; a layer type it does not extend)"
                )
            _gather_into(out, [t.grad_batch for _, t in named], columns)

        return run, batch, note, out
    raise ValueError(method)


def _graph_setup(run: Callable[[], None], device: Any) -> str:
    """Run ``fused-graph``'s eager batch and its capture, so every timed batch replays → its note:
    the graph in use and the memory set-up reserved (the graph's private pool among it, held from
    then on, so outside the peak the worker measures), or the warning that turned it off."""
    import logging

    import torch

    class Keep(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    keep = Keep()
    logger = logging.getLogger("hpcfl.entk")
    logger.addHandler(keep)
    before = torch.cuda.memory_reserved(device)
    try:
        run()  # eager: compiles (and with HPCFL_TRITON_AUTOTUNE=1 tunes) the gathers for this shape
        run()  # captured, replayed once, checked against its eager result
    finally:
        logger.removeHandler(keep)
    if keep.lines:
        return f"CUDA graph OFF: {keep.lines[0]}"[:200]
    held = (torch.cuda.memory_reserved(device) - before) / 2**20
    return (
        f"CUDA graph replay (captured, checked in set-up; set-up reserved {held:,.0f} MiB, outside the peak)"
    )


def model_options(spec: dict[str, Any]) -> dict[str, Any]:
    """``build_model`` options of a spec: ``norm`` where ``--norm`` was given, and any ``model_options``
    (a caller's own sizes, e.g. a tiny check's)."""
    return {**({"norm": spec["norm"]} if spec.get("norm") else {}), **spec.get("model_options", {})}
