"""The frozen reference models of model-contrastive local objectives (MOON, FedCKA).

MOON (Li, He & Song, CVPR 2021) and FedCKA (Son, Kim & Chung) compare, on every local batch, the
model being trained with two fixed models: the round's global model and the client's own local
model of the previous round. Those two only ever run forwards without gradient, and only as far as
the compared representation (MOON: the projection, FedCKA: the first two layers). This module
holds them:

- :class:`FrozenModel`: one inference-only copy of the working model, built once by ``deepcopy``
  and loaded from a flat state vector (the :class:`~hpcfl.training.flat.FlatModel` layout) at each
  client update, in eval mode as in MOON's reference code (``global_model.eval()``).
- :class:`References`: the pair of them and their representations of a client's batches. When a
  round visits the client's samples more than once (E > 1 local epochs) and the representations
  fit in ``cache_bytes``, they are computed once per sample at the start of the update and
  gathered per batch afterwards: the models are fixed during the round and in eval mode a sample's
  representation does not depend on its batch, so this is the same computation done E times
  fewer (it can differ from the per-batch forward in the last bits, as convolution kernels sum in
  a batch-size dependent order). With E = 1 there is nothing to share and each batch runs both
  models.

On CPU the copies and their inputs use the channels-last memory format: on one AMD EPYC (Zen 3)
core the truncated cnn-proj forward of a CIFAR batch of 64 takes 5.0 ms instead of 11.9 ms, because
PyTorch's NCHW max-pool kernel alone takes 5.2 ms there (0.5 ms channels-last).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = [
    "FrozenModel",
    "References",
    "Represent",
    "sample_visits",
    "split_indices",
    "state_tensors",
    "with_indices",
]

Represent = Callable[[Tensor], list[Tensor]]
"""A frozen model's representations of a batch (one tensor per compared layer)."""


def state_tensors(model: nn.Module) -> list[Tensor]:
    """The tensors of ``model``'s state vector in :class:`FlatModel` order: trainable parameters
    (``model.parameters()`` order), then floating-point buffers (``model.modules()`` order)."""
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [
        buf
        for module in model.modules()
        for buf in module.buffers(recurse=False)
        if buf is not None and buf.is_floating_point()
    ]
    return params + buffers


def _has_conv2d(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


class FrozenModel:
    """An eval-mode, gradient-free copy of ``model`` whose state is loaded from flat vectors."""

    def __init__(self, model: nn.Module, state_size: int) -> None:
        frozen = copy.deepcopy(model)
        device = next(iter(frozen.parameters())).device
        self.channels_last = device.type == "cpu" and _has_conv2d(frozen)
        if self.channels_last:
            frozen = frozen.to(memory_format=torch.channels_last)
        self._targets = state_tensors(frozen)  # before requires_grad is switched off
        size = sum(t.numel() for t in self._targets)
        if size != state_size:
            raise ValueError(f"the model's state has {size} entries, the state vector {state_size}")
        for p in frozen.parameters():
            p.requires_grad_(False)
            p.grad = None
        self.model = frozen.eval()

    @torch.no_grad()
    def load(self, state: Tensor) -> None:
        """Copy a flat state vector into the copy (strides of channels-last weights are handled)."""
        offset = 0
        for t in self._targets:
            n = t.numel()
            t.copy_(state[offset : offset + n].view(t.shape))
            offset += n

    def prepare(self, x: Tensor) -> Tensor:
        """The input in the memory format the copy runs fastest with."""
        if self.channels_last and x.dim() == 4:
            return x.contiguous(memory_format=torch.channels_last)
        return x


class References:
    """The global and previous local model of a client update and their representations of its data.

    Args:
        model: the working model (copied twice, once, on construction).
        state_size: length of the flat state vectors that :meth:`begin` loads.
        represent: builds, for a frozen copy, the function returning its representations of a batch.
        cache_bytes: memory budget for the per-update cache of both models' representations.
    """

    def __init__(
        self,
        model: nn.Module,
        state_size: int,
        represent: Callable[[nn.Module], Represent],
        *,
        cache_bytes: float,
    ) -> None:
        self.models = (FrozenModel(model, state_size), FrozenModel(model, state_size))
        self._represent = [represent(m.model) for m in self.models]
        self.cache_bytes = cache_bytes
        self._cache: list[list[Tensor]] | None = None  # [model][layer] (n, d)
        self._bytes_per_sample: int | None = None

    def begin(self, global_state: Tensor, prev_state: Tensor, x: Tensor, visits: int, chunk: int) -> None:
        """Load the two models; cache their representations of ``x`` if the round revisits samples.

        ``visits``: sample forwards the round will make; ``chunk``: batch size of the cache-filling
        forwards; the training batch is a good choice (on one EPYC core the truncated cnn-proj
        forward costs 1.6× more per sample in chunks of 256 than of 64, interleaved medians).
        """
        self.end()
        for frozen, state in zip(self.models, (global_state, prev_state), strict=True):
            frozen.load(state)
        n = x.shape[0]
        if visits <= n or self.cache_bytes <= 0:
            return
        if self._bytes_per_sample is not None and n * self._bytes_per_sample > self.cache_bytes:
            return
        caches: list[list[Tensor]] = [[], []]
        with torch.no_grad():
            for start in range(0, n, chunk):
                xb = self.models[0].prepare(x[start : start + chunk])
                for cache, represent in zip(caches, self._represent, strict=True):
                    reps = represent(xb)
                    if not cache:
                        per_sample = sum(r[0].numel() * r.element_size() for r in reps)
                        self._bytes_per_sample = 2 * per_sample
                        if n * self._bytes_per_sample > self.cache_bytes:
                            return
                        cache.extend(r.new_empty((n, r[0].numel())) for r in reps)  # (n, d)
                    for c, r in zip(cache, reps, strict=True):
                        c[start : start + r.shape[0]].view(r.shape).copy_(r)  # any input strides
        self._cache = caches

    def batch(self, x: Tensor, idx: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """Both models' representations of the batch ``x`` = the client's samples ``idx``."""
        if self._cache is not None:
            g, p = ([c.index_select(0, idx) for c in cache] for cache in self._cache)  # (B, d) each
            return g, p
        with torch.no_grad():
            xb = self.models[0].prepare(x)
            return self._represent[0](xb), self._represent[1](xb)

    @property
    def cached(self) -> bool:
        """Whether the current update gathers from the cache."""
        return self._cache is not None

    def end(self) -> None:
        """Release the cache of the finished update."""
        self._cache = None


def with_indices(y: Tensor) -> Tensor:
    """Targets ``(n, 2)`` = [label, sample index]: the loss of a batch then knows its samples.

    Local SGD hands the loss ``y[idx]``; the algorithms that gather cached representations need
    ``idx`` itself, which travels in the second column.
    """
    idx = torch.arange(y.shape[0], device=y.device, dtype=y.dtype)
    return torch.stack([y, idx], dim=1)  # (n, 2)


def split_indices(target: Tensor) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`with_indices` on a batch: (labels (B,), sample indices (B,))."""
    return target[:, 0], target[:, 1]


def sample_visits(steps: int | None, epochs: int, batch_size: int, n: int) -> int:
    """How many sample forwards one round of local training makes (E·n, or M·B with M steps)."""
    return steps * batch_size if steps is not None else epochs * n
