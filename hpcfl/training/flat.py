"""A model whose state lives in one contiguous vector.

Every parameter and floating-point buffer (BatchNorm running statistics) becomes a view into one
flat tensor, and every parameter's ``.grad`` a view into one flat gradient. Aggregation is then a
single allreduce, control variates are vector arithmetic, and the optimiser is three vector ops.
Layout: ``vector = [parameters in model.parameters() order | float buffers in named_buffers order]``.
"""

from __future__ import annotations

import torch
from torch import nn


class FlatModel:
    """Rebinds ``model``'s parameters, gradients and float buffers as views of flat tensors."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        buffers = [
            (module, name, buf)
            for module in model.modules()
            for name, buf in module.named_buffers(recurse=False)
            if buf is not None and buf.is_floating_point()
        ]
        self.num_params = sum(p.numel() for p in params)
        self.num_buffers = sum(b.numel() for _, _, b in buffers)
        first = params[0] if params else next(iter(model.buffers()))
        self.vector = torch.empty(self.num_params + self.num_buffers, dtype=first.dtype, device=first.device)
        self.grad = torch.zeros(self.num_params, dtype=first.dtype, device=first.device)
        offset = 0
        for p in params:
            n = p.numel()
            self.vector[offset : offset + n].copy_(p.detach().flatten())
            p.data = self.vector[offset : offset + n].view_as(p)
            p.grad = self.grad[offset : offset + n].view_as(p)
            offset += n
        for module, name, buf in buffers:
            n = buf.numel()
            self.vector[offset : offset + n].copy_(buf.flatten())
            module._buffers[name] = self.vector[offset : offset + n].view_as(buf)
            offset += n

    @property
    def params(self) -> torch.Tensor:
        """The trainable parameters, a view of the first ``num_params`` entries of ``vector``."""
        return self.vector[: self.num_params]

    @property
    def size(self) -> int:
        """Length of the state vector (parameters and float buffers)."""
        return self.vector.numel()

    def load(self, state: torch.Tensor) -> None:
        """Copy a state vector into the model (in place, views stay valid)."""
        self.vector.copy_(state)
