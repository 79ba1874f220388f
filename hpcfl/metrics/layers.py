"""Layer taps: which activations count as a model's "layers", and reading them with forward hooks.

FedCKA (Son, Kim & Chung, "Compare Where It Matters", Sec. 3.1) regularises "the first two naturally
similar layers": for CNNs without residual blocks the two layers closest to the input, for ResNets
"the initial convolutional layer and first post-residual block" (following Kornblith et al. 2019:
post-residual activations, not those inside a residual branch, are alike across networks). Its
Figure 2 compares every layer of a client's model with the global model's. Both need a rule for
what one "layer" of a model is; here a layer is named by the module whose forward *output* is its
activation:

- a **plain layer** is a Conv/Linear module plus the non-parametrised modules (and normalisations)
  that follow it before the next Conv/Linear: ReLU, pooling, flatten, dropout, BatchNorm, GroupNorm.
  Its activation is the output of the last of them: post-ReLU, and post-pool where the block pools,
  i.e. exactly what the next layer consumes;
- a **residual block** (a module with a ``shortcut`` attribute, as hpcfl's ``BasicBlock``) is one
  layer, its activation the block's output, after the residual sum and its ReLU.

Modules are visited in registration order, which is execution order for every model of
:mod:`hpcfl.models` (their forwards call their attributes in the order they are declared). So:

============ ====================================================================================
model        :func:`block_outputs` (the first two are FedCKA's default)
============ ====================================================================================
cnn-proj     pool1, pool2, relu3, relu4, relu5, projection, classifier (the 7 layers of Table 4)
simplecnn    relu1, relu2, relu3, relu4, classifier
resnet8/18   relu1 (stem), layer1.0, layer1.1, ..., pool (last block + global pool), classifier
vgg11        encoder.2, encoder.5 (the pools after convs 1 and 2; encoder.3, encoder.7 with BN), ...
mlp          relu1, classifier
============ ====================================================================================

:class:`LayerTap` records those outputs with forward hooks during an ordinary forward (so the task
loss and the model's forward stay untouched), and can cut a forward short right after the last
tapped layer has run: a model that only has to provide early activations (FedCKA's global and
previous models) then costs only its first layers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from torch import Tensor, nn

from hpcfl.errors import ConfigError, suggest

__all__ = ["LayerTap", "block_outputs", "check_layers", "first_layers"]

log = logging.getLogger("hpcfl.metrics")

_PARAMETRISED = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
_UNCUT: set[str] = set()  # model classes whose forwards could not be truncated (logged once)


def _units(module: nn.Module, prefix: str, out: list[str]) -> None:
    """Append to ``out`` the name of the module whose output ends each layer (see module docs)."""
    for name, child in module.named_children():
        full = f"{prefix}{name}"
        if hasattr(child, "shortcut"):  # a residual block is one layer
            out.append(full)
        elif any(True for _ in child.children()):
            _units(child, f"{full}.", out)
        elif isinstance(child, _PARAMETRISED):
            out.append(full)
        elif out:  # a follower (activation, pool, norm, ...) extends the current layer
            out[-1] = full


def block_outputs(model: nn.Module) -> list[str]:
    """Names of the modules whose outputs are the model's layer activations, input to output."""
    out: list[str] = []
    _units(model, "", out)
    return out


def first_layers(model: nn.Module, m: int) -> list[str]:
    """FedCKA's default: the first ``m`` layers of :func:`block_outputs` (Sec. 3.1, M = 2)."""
    names = block_outputs(model)
    if m > len(names):
        raise ConfigError(
            f"fedcka.num_layers={m} but {type(model).__name__} has only {len(names)} layers "
            f"({', '.join(names)}); lower num_layers or name the layers in fedcka.layers"
        )
    return names[:m]


def check_layers(model: nn.Module, names: Sequence[str]) -> None:
    """Raise a :class:`ConfigError` naming the valid layers if a name is not a module of ``model``."""
    modules = dict(model.named_modules())
    for name in names:
        if name not in modules or name == "":
            valid = [n for n in modules if n]
            raise ConfigError(
                f"{type(model).__name__} has no layer {name!r}{suggest(name, valid)}; "
                f"layers (block outputs): {', '.join(block_outputs(model))}"
            )
    if not names:
        raise ValueError("at least one layer name is needed")


class _StopForward(Exception):
    """Raised by the hook of the last tapped layer to end a truncated forward."""


class LayerTap:
    """Forward hooks recording the outputs of the named modules of ``model``.

    ``tap.forward(x)`` runs ``model(x)`` and returns ``(output, [activation per name])``. Only a
    module's first call in a forward counts. With ``truncate=True`` the forward stops right after
    the last tapped layer has run (the output is then ``None``): the first call runs in full and
    records the order in which the tapped modules fire; later calls raise from the last one's hook.
    A forward that swallows the exception (or that reaches the layers in a data-dependent order) is
    not truncatable: the tap logs that once and runs full forwards from then on.

    Use as a context manager, or call :meth:`remove`, to take the hooks off again.
    """

    def __init__(self, model: nn.Module, names: Sequence[str], *, truncate: bool = False) -> None:
        check_layers(model, names)
        modules = dict(model.named_modules())
        self.model = model
        self.names = list(names)
        self.truncate = truncate
        self._acts: dict[str, Tensor] = {}
        self._stop: str | None = None  # the last tapped layer to run, known after the first call
        self._cutting = False  # only forwards run by forward() are cut short
        self._handles = [modules[n].register_forward_hook(self._hook(n)) for n in self.names]

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, inputs: Any, output: Tensor) -> None:
            if name not in self._acts:
                self._acts[name] = output
                if self._cutting and name == self._stop and len(self._acts) == len(self.names):
                    raise _StopForward

        return hook

    def reset(self) -> None:
        """Forget the recorded activations (call before a forward that someone else runs)."""
        self._acts = {}

    def collect(self) -> list[Tensor]:
        """The activations recorded since :meth:`reset`, in ``names`` order."""
        missing = [n for n in self.names if n not in self._acts]
        if missing:
            raise ValueError(f"layers {missing} of {type(self.model).__name__} did not run in its forward")
        acts = [self._acts[n] for n in self.names]
        self._acts = {}
        return acts

    def forward(self, x: Tensor) -> tuple[Tensor | None, list[Tensor]]:
        """``model(x)`` (``None`` when cut short) and the tapped activations, in ``names`` order."""
        self.reset()
        output: Tensor | None = None
        self._cutting = self.truncate
        try:
            output = self.model(x)
        except _StopForward:
            pass
        else:
            if self.truncate and self._stop is not None:
                kind = type(self.model).__name__
                if kind not in _UNCUT:  # one line per model class and process
                    _UNCUT.add(kind)
                    log.info(
                        "%s: the forward could not be cut after %r; running full forwards", kind, self._stop
                    )
                self.truncate, self._stop = False, None
        finally:
            self._cutting = False
        if self.truncate and self._stop is None and len(self._acts) == len(self.names):
            self._stop = next(reversed(self._acts))  # fired last; cut there from now on
        return output, self.collect()

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> LayerTap:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()
