"""Small helpers shared by the eNTK implementations."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from hpcfl.errors import ConfigError


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Put every submodule in eval mode and restore each one's own ``training`` flag afterwards.

    Recurrent layers on a CUDA device run without cuDNN meanwhile (:func:`cudnn_off_for_recurrent`).
    A model already in eval mode throughout (a TCT stage-2 model, a benchmark's) is left alone:
    ``model.eval()`` and the restore cost ~20 attribute sets per module tree on every call."""
    modules = list(model.modules())
    training = [m for m in modules if m.training]
    if training:
        model.eval()
    try:
        with cudnn_off_for_recurrent(model, modules):
            yield
    finally:
        for m in training:
            m.training = True


def cudnn_off_for_recurrent(
    model: nn.Module, modules: list[nn.Module] | None = None
) -> contextlib.AbstractContextManager:
    """A context with cuDNN off when ``model`` has recurrent layers on a CUDA device, else a no-op.

    Gradients taken in eval mode (eNTK features, NTK-FL's Jacobians) would reach cuDNN's RNN
    backward, which refuses eval mode ("cudnn RNN backward can only be called in training mode");
    PyTorch's native CUDA LSTM/GRU kernels run it. Other layers keep cuDNN (it is only turned off
    while the context is open). ``modules``: the model's modules when the caller has listed them."""
    recurrent = any(isinstance(m, nn.RNNBase) for m in (model.modules() if modules is None else modules))
    first = next(model.parameters(), None)
    if recurrent and first is not None and first.device.type == "cuda":
        return torch.backends.cudnn.flags(enabled=False)
    return contextlib.nullcontext()


def model_device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Device and floating dtype of the model's first parameter (inputs are cast to them)."""
    first = next(model.parameters(), None)
    if first is None:
        raise ValueError("the model has no parameters, so it has no eNTK features")
    return first.device, first.dtype


def batches(n: int, batch_size: int, *, progress: bool, desc: str) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` row ranges of ``batch_size``, with an optional tqdm bar over samples."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n, desc=desc, unit="sample")
    try:
        for start in range(0, n, batch_size):
            stop = min(n, start + batch_size)
            yield start, stop
            if bar is not None:
                bar.update(stop - start)
    finally:
        if bar is not None:
            bar.close()


def logit_of(output: Tensor | tuple, logit: int) -> Tensor:
    """Column ``logit`` of the model's logits ``(B, C)`` → (B,); tuples use their first element."""
    logits = output[0] if isinstance(output, tuple | list) else output
    if logits.dim() != 2:
        raise ValueError(f"the model must return logits of shape (B, C), got {tuple(logits.shape)}")
    if not -logits.shape[1] <= logit < logits.shape[1]:
        raise ConfigError(f"eNTK logit {logit} is out of range for a model with {logits.shape[1]} outputs")
    return logits[:, logit]
