"""SimpleCNN: the small Fashion-MNIST network of TCT.

Yu et al., "TCT: Convexifying Federated Learning using Bootstrapped Neural Tangent Kernels" (NeurIPS
2022), Section 5.1 "Models": the FMNIST experiments use a small ReLU CNN ("SimpleCNN"). The paper's
prose describes it loosely (conv + pooling + two fully connected layers); this is the concrete
variant the project fixes: three 3×3 stride-2 convolutions (downsampling by stride instead of
pooling), then a 128-unit hidden layer and the classifier.

    conv 3×3/2 (in→32) → ReLU → conv 3×3/2 (32→64) → ReLU → conv 3×3/2 (64→128) → ReLU
    → flatten → fc (→128) → ReLU → fc (128→C)

On 1×28×28 the spatial size goes 28 → 14 → 7 → 4, so the flattened size is 128·4·4 = 2048 and the
network has 356,234 parameters for 10 classes. Input channels and the flattened size are derived
from ``input_shape``, so the same class runs on 3×32×32 (CIFAR: 32 → 16 → 8 → 4).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def _conv_out(size: int, kernel: int, stride: int, padding: int) -> int:
    """Output length of a convolution along one axis (PyTorch's floor rule)."""
    return (size + 2 * padding - kernel) // stride + 1


class SimpleCNN(nn.Module):
    """TCT's SimpleCNN (see the module docstring); ``classifier`` is the last layer."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        channels, height, width = input_shape
        self.conv1 = nn.Conv2d(channels, 32, kernel_size=3, stride=2, padding=1)
        self.relu1 = nn.ReLU(inplace=False)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, stride=2, padding=1)
        self.relu2 = nn.ReLU(inplace=False)
        self.conv3 = nn.Conv2d(64, 128, kernel_size=3, stride=2, padding=1)
        self.relu3 = nn.ReLU(inplace=False)
        for _ in range(3):
            height, width = _conv_out(height, 3, 2, 1), _conv_out(width, 3, 2, 1)
        self.fc1 = nn.Linear(128 * height * width, 128)
        self.relu4 = nn.ReLU(inplace=False)
        self.classifier = nn.Linear(128, num_classes)

    def features(self, x: Tensor) -> Tensor:
        """The 128-d representation fed to the classifier."""
        x = self.relu1(self.conv1(x))  # (B, 32, H/2, W/2)
        x = self.relu2(self.conv2(x))  # (B, 64, H/4, W/4)
        x = self.relu3(self.conv3(x))  # (B, 128, H/8, W/8)
        x = torch.flatten(x, 1)  # (B, 128·h·w)
        return self.relu4(self.fc1(x))  # (B, 128)

    def forward_with_repr(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Logits ``(B, C)`` and the representation ``(B, 128)`` they are computed from."""
        rep = self.features(x)
        return self.classifier(rep), rep

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(B, C)``."""
        return self.classifier(self.features(x))
