"""A one-hidden-layer MLP, the smallest model of the toolkit.

The two-layer ReLU network is the object of the NTK-FL analysis (Yue et al., "Neural Tangent Kernel
Empowered Federated Learning", ICML 2022, Section 3.2 and Appendix) and the cheapest model on which
per-sample Jacobians can be materialised in full, so it is the ground-truth model for eNTK tests:

    flatten → fc (→100) → ReLU → fc (100→C)

On 1×28×28 that is 784·100+100 + 100·C+C parameters (79,510 for 10 classes).

``init``: ``default`` (PyTorch's: weights U(±1/√fan_in)) or ``kaiming`` (He-normal weights
N(0, 2/fan_in) and zero biases, what the NTK-FL reference code applies to its MLP; its kernel is
~6× larger, so the same evolution time moves the function further).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

INITS = ("default", "kaiming")


class MLP(nn.Module):
    """Flatten → 100 hidden ReLU units → ``classifier``."""

    hidden = 100

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, init: str = "default") -> None:
        super().__init__()
        self.fc1 = nn.Linear(math.prod(input_shape), self.hidden)
        self.relu1 = nn.ReLU(inplace=False)
        self.classifier = nn.Linear(self.hidden, num_classes)
        if init == "kaiming":
            for layer in (self.fc1, self.classifier):
                nn.init.kaiming_normal_(layer.weight, a=0, mode="fan_in")
                nn.init.zeros_(layer.bias)

    def features(self, x: Tensor) -> Tensor:
        """The 100-d hidden representation fed to the classifier."""
        x = torch.flatten(x, 1)  # (B, C_in·H·W)
        return self.relu1(self.fc1(x))  # (B, 100)

    def forward_with_repr(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Logits ``(B, C)`` and the representation ``(B, 100)`` they are computed from."""
        rep = self.features(x)
        return self.classifier(rep), rep

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(B, C)``."""
        return self.classifier(self.features(x))
