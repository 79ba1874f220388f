"""The model zoo: every network of the papers, built by name from the data's input shape.

=========== ===================================================== =============================
name        model (paper)                                         options (default)
=========== ===================================================== =============================
simplecnn   3 stride-2 convs + 2 fc (TCT, FMNIST)                 —
mlp         flatten → 100 → ReLU → C (NTK-FL's two-layer net)     —
cnn-proj    2 convs + 256-d projection head (MOON, FedCKA)        —
resnet8     CIFAR ResNet-8, widths 16/32/64 (FedPVR)              ``norm`` = ``"bn"`` | ``"gn"``
resnet18    CIFAR ResNet-18 (TCT)                                 ``norm`` = ``"gn"`` | ``"bn"``
vgg11       VGG-11, no dropout (FedPVR)                           ``batch_norm`` = ``False``
char-lstm   LEAF's Shakespeare LSTM: embed 8, 2×LSTM 256, Linear   ``embed`` 8, ``hidden`` 256,
                                                                  ``layers`` 2, ``vocab``
char-       causal pre-LN Transformer, learned positions           ``d_model`` 64, ``layers`` 2,
transformer                                                       ``heads`` 4, ``vocab``
=========== ===================================================== =============================

The two ``char-`` models read symbol codes ``(B, L)`` of a text dataset (``Dataset.vocab_size``)
and predict the next symbol (:mod:`hpcfl.models.text`); ``vocab`` defaults to the dataset's and a
different one is a ConfigError, as is an image model on text or a text model on images.

Every model built here has the same small interface, which the algorithms rely on:

- ``model(x)`` → logits ``(B, C)``;
- ``model.classifier``: the last ``nn.Linear`` (what TCT replaces by a fresh 1-output layer, FedPVR
  variance-reduces);
- ``model.features(x)`` → the representation fed to the classifier, and
  ``model.forward_with_repr(x)`` → ``(logits, representation)`` in one pass (for ``cnn-proj`` the
  representation is the 256-d projection MOON's contrastive loss uses, ``model.projection``);
- only standard layers held as module attributes (Conv2d, Linear, BatchNorm2d, GroupNorm, ReLU with
  ``inplace=False``, pools), so forward hooks see every parametrised op and its unmodified input.

Initialisation is PyTorch's default for every layer (``mlp`` also takes ``init: kaiming``, the
NTK-FL reference code's), so a model is a function of the global seed in force when
:func:`build_model` runs.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hpcfl.errors import ConfigError, suggest, unknown
from hpcfl.models.cnn_proj import CNNProj
from hpcfl.models.mlp import INITS, MLP
from hpcfl.models.resnet import NORMS, resnet8, resnet18
from hpcfl.models.simplecnn import SimpleCNN
from hpcfl.models.text import CharLSTM, CharTransformer
from hpcfl.models.vgg import vgg11
from hpcfl.registry import MODEL_SPECS, ModelSpec

__all__ = [
    "BUILTIN_MODELS",
    "IMAGE_MODELS",
    "MODELS",
    "TEXT_MODELS",
    "ModelSpec",
    "build_model",
    "last_linear",
    "reinit_last_layer",
    "with_fresh_head",
]


def _norm_option(model: str, value: Any) -> str:
    if not isinstance(value, str) or value not in NORMS:
        raise unknown(f"norm for model {model!r}", str(value), NORMS)
    return value


def _bool_option(option: str) -> Callable[[str, Any], bool]:
    def check(model: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(f"option {option!r} of model {model!r} must be true or false, got {value!r}")
        return value

    return check


def _init_option(model: str, value: Any) -> str:
    if not isinstance(value, str) or value not in INITS:
        raise unknown(f"init for model {model!r}", str(value), INITS)
    return value


def _positive_option(option: str) -> Callable[[str, Any], int]:
    def check(model: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"option {option!r} of model {model!r} must be a whole number >= 1, got {value!r}"
            )
        return value

    return check


def _char_lstm(input_shape: tuple[int, int, int], num_classes: int, **options: Any) -> nn.Module:
    return CharLSTM(input_shape[2], num_classes, **options)


def _char_transformer(input_shape: tuple[int, int, int], num_classes: int, **options: Any) -> nn.Module:
    if options.get("d_model", 64) % options.get("heads", 4):
        raise ConfigError(
            f"model 'char-transformer': d_model {options.get('d_model', 64)} is not a multiple of "
            f"heads {options.get('heads', 4)}; choose d_model = heads x head size"
        )
    return CharTransformer(input_shape[2], num_classes, **options)


_LSTM_OPTIONS = {name: _positive_option(name) for name in ("embed", "hidden", "layers", "vocab")}
_TRANSFORMER_OPTIONS = {name: _positive_option(name) for name in ("d_model", "layers", "heads", "vocab")}

BUILTIN_MODELS: dict[str, ModelSpec] = {
    "simplecnn": ModelSpec(SimpleCNN),
    "mlp": ModelSpec(MLP, {"init": _init_option}, flat_inputs=True),
    "cnn-proj": ModelSpec(CNNProj, min_side=16),  # two unpadded 5×5 convs and two 2×2 pools
    "resnet8": ModelSpec(resnet8, {"norm": _norm_option}),
    "resnet18": ModelSpec(resnet18, {"norm": _norm_option}),
    "vgg11": ModelSpec(vgg11, {"batch_norm": _bool_option("batch_norm")}),
    "char-lstm": ModelSpec(_char_lstm, _LSTM_OPTIONS, text=True),
    "char-transformer": ModelSpec(_char_transformer, _TRANSFORMER_OPTIONS, text=True),
}

MODELS: tuple[str, ...] = tuple(BUILTIN_MODELS)
"""The built-in model names; :func:`build_model` also accepts plugins' (:mod:`hpcfl.registry`)."""
TEXT_MODELS: tuple[str, ...] = tuple(n for n, spec in BUILTIN_MODELS.items() if spec.text)
"""The built-in models that read symbol codes (text datasets)."""
IMAGE_MODELS: tuple[str, ...] = tuple(n for n in MODELS if n not in TEXT_MODELS)
"""The built-in models that read images."""


def _check_vocabulary(
    name: str, spec: ModelSpec, num_classes: int, vocab_size: int | None, options: dict[str, Any]
) -> None:
    """A text model on text of its vocabulary, an image model on images; else one ConfigError line."""
    if spec.text and vocab_size is None:
        raise ConfigError(
            f"model {name!r} reads symbol codes but the dataset holds images; use it on a text dataset "
            f"(shakespeare) or pick an image model ({', '.join(IMAGE_MODELS)})"
        )
    if not spec.text and vocab_size is not None:
        raise ConfigError(
            f"model {name!r} reads images but the dataset holds text over {vocab_size} symbols; "
            f"use {' or '.join(TEXT_MODELS)}"
        )
    if spec.text:
        vocab = options.pop("vocab", vocab_size)
        if vocab != vocab_size or num_classes != vocab_size:
            raise ConfigError(
                f"model {name!r}: its vocabulary of {vocab} symbols does not match the dataset's "
                f"{vocab_size}; drop the model's vocab option or set it to {vocab_size}"
            )


def _check_shape(input_shape: Any) -> tuple[int, int, int]:
    try:
        dims = tuple(input_shape)
    except TypeError:
        dims = ()
    ok = len(dims) == 3 and all(
        isinstance(d, numbers.Integral) and not isinstance(d, bool) and d >= 1 for d in dims
    )
    if not ok:
        raise ConfigError(
            f"input_shape must be (channels, height, width) with positive integers, got {input_shape!r}"
        )
    return int(dims[0]), int(dims[1]), int(dims[2])


def build_model(
    name: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    *,
    vocab_size: int | None = None,
    **options: Any,
) -> nn.Module:
    """Build model ``name`` for images of ``input_shape`` = (C, H, W) and ``num_classes`` outputs.

    Layer sizes that depend on the image (input channels, flattened size, which pools run) are
    derived from ``input_shape``, so every model runs on 1×28×28 (MNIST-like) and 3×32×32 (CIFAR).
    ``options`` are the model's own (see the module docstring); unset ones take their defaults.
    ``vocab_size`` is a text dataset's (``Dataset.vocab_size``; None for images): a ``char-`` model
    needs it, ``input_shape`` is then ``(1, 1, L)`` and ``num_classes`` the vocabulary.

    Raises:
        ConfigError: unknown ``name`` or option, a bad option value, a malformed ``input_shape``,
            an image too small for the model, or ``num_classes`` < 1. The message names the
            cause and the valid choices.
    """
    if name not in MODEL_SPECS:
        raise unknown("model", name, MODEL_SPECS)
    spec = MODEL_SPECS[name]
    for key in options:
        if key not in spec.options:
            valid = ", ".join(sorted(spec.options)) or "none"
            hint = suggest(key, spec.options)
            raise ConfigError(f"unknown option {key!r} for model {name!r}{hint}; valid options: {valid}")
    checked = {key: spec.options[key](name, value) for key, value in options.items()}
    shape = _check_shape(input_shape)
    if min(shape[1:]) < spec.min_side:
        raise ConfigError(
            f"model {name!r} needs images of at least {spec.min_side}×{spec.min_side} pixels, "
            f"got {shape[1]}×{shape[2]}; choose a model for small images such as simplecnn"
        )
    if not isinstance(num_classes, numbers.Integral) or isinstance(num_classes, bool) or num_classes < 1:
        raise ConfigError(f"num_classes must be a positive integer, got {num_classes!r}")
    _check_vocabulary(name, spec, int(num_classes), vocab_size, checked)
    return spec.build(shape, int(num_classes), **checked)


def last_linear(model: nn.Module) -> nn.Linear:
    """The classifier layer: ``model.classifier`` if it is an ``nn.Linear``, else the last one registered.

    This is the layer TCT replaces by a fresh 1-output layer before computing eNTK features (stage 1 →
    stage 2, :func:`with_fresh_head`).

    Raises:
        TypeError: the model has no ``nn.Linear`` layer at all.
    """
    head = getattr(model, "classifier", None)
    if isinstance(head, nn.Linear):
        return head
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise TypeError(f"{type(model).__name__} has no nn.Linear layer to act as the classifier")
    return linears[-1]


def _seeded_default_init(layer: nn.Linear, seed: int) -> None:
    """PyTorch's default ``nn.Linear`` init drawn from a private CPU generator seeded with ``seed``,
    in float32, copied into the layer's tensors (in place; views of them stay valid)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    weight = torch.empty(layer.weight.shape, dtype=torch.float32)  # host: seeded CPU init, copied in
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=gen)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if layer.bias is not None:
            fan_in = layer.weight.shape[1]
            bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
            bias = torch.empty(layer.bias.shape, dtype=torch.float32)  # host: seeded CPU init, copied in
            nn.init.uniform_(bias, -bound, bound, generator=gen)
            layer.bias.copy_(bias)


def reinit_last_layer(model: nn.Module, seed: int) -> None:
    """Re-initialise the classifier's weight and bias from ``seed``, in place.

    TCT (Yu et al., NeurIPS 2022, Section 4.1) computes the eNTK of the stage-1 model "with the last
    layer re-initialised"; the draw must be the same on every rank and every resumed run, so it
    depends on ``seed`` alone: a private CPU ``torch.Generator`` draws PyTorch's default ``nn.Linear``
    init (Kaiming-uniform with a = √5 for the weight, U(±1/√fan_in) for the bias) in float32, and the
    values are copied into the existing tensors. Hence the global RNG state is untouched, the values
    are the same on CPU and GPU (up to the cast to the layer's dtype), they equal
    ``torch.manual_seed(seed); layer.reset_parameters()`` on CPU, and views into the parameters
    (a flat parameter buffer) stay valid. (Stage 2 now uses :func:`with_fresh_head`; this is its
    ``stage2.head: keep`` legacy form.)
    """
    _seeded_default_init(last_linear(model), seed)


def with_fresh_head(model: nn.Module, seed: int, outputs: int = 1) -> nn.Module:
    """A copy of ``model`` whose classifier (:func:`last_linear`) is a fresh ``nn.Linear(in, outputs)``.

    TCT's public code takes the eNTK of the stage-1 model with its classifier replaced by a new
    one-output layer, so every parameter of the head reaches the differentiated output (keeping the
    C-output head and differentiating logit 0 leaves the other C−1 rows' gradients identically
    zero). The new layer gets PyTorch's default init from a generator seeded with ``seed`` alone
    (as :func:`reinit_last_layer`: same on every rank and resume, global RNG untouched), on the old
    layer's device and dtype; it takes the old one's place in the module tree, so its parameters
    stay last in ``parameters()`` order. ``model`` itself is not changed.
    """
    old = last_linear(model)
    fresh = copy.deepcopy(model)
    name = next(n for n, m in model.named_modules() if m is old)
    parent_name, _, attr = name.rpartition(".")
    parent = fresh.get_submodule(parent_name)
    # built on the meta device: nn.Linear's own init would draw from (and advance) the global RNG
    layer = nn.Linear(
        old.in_features, outputs, bias=old.bias is not None, device="meta", dtype=old.weight.dtype
    )
    layer = layer.to_empty(device=old.weight.device)
    _seeded_default_init(layer, seed)
    setattr(parent, attr, layer)
    return fresh
