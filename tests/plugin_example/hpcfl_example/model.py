"""``example_linear``: a linear classifier on the flattened image (multinomial logistic regression)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from hpcfl.registry import ModelSpec


class Linear(nn.Module):
    """Flatten → ``classifier``; the representation is the flattened input."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        self.classifier = nn.Linear(math.prod(input_shape), num_classes)

    def features(self, x: Tensor) -> Tensor:
        return torch.flatten(x, 1)  # (B, C·H·W)

    def forward_with_repr(self, x: Tensor) -> tuple[Tensor, Tensor]:
        rep = self.features(x)
        return self.classifier(rep), rep

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))  # (B, num_classes)


SPEC = ModelSpec(Linear)
