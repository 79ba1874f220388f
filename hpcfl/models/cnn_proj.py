"""The CIFAR-10 CNN with a projection head used by MOON and FedCKA.

Son, Kim and Chung, "Compare Where It Matters: Using Layer-Wise Regularization To Improve Federated
Learning on Heterogeneous Data" (FedCKA), Section 4.1 "Experiment Setup", following Li, He and Song,
"Model-Contrastive Federated Learning" (MOON, CVPR 2021): two 5×5 convolutions with 16 and 32
channels, each followed by 2×2 max pooling, form the encoder; a head of four fully connected layers
with 120, 84, 84 and 256 units follows; the last layer maps to the classes.

    conv 5×5 (in→16) → ReLU → maxpool 2 → conv 5×5 (16→32) → ReLU → maxpool 2 → flatten
    → fc 120 → ReLU → fc 84 → ReLU → fc 84 → ReLU → fc 256 (projection) → fc C (classifier)

As in MOON's reference network, there is no non-linearity between the 256-d projection and the
classifier: the projection output is the representation MOON's contrastive loss compares
(:meth:`CNNProj.forward_with_repr`). FedCKA regularises the two convolutions (``conv1``,
``conv2``), the layers closest to the input.

Convolutions are unpadded, so CIFAR's 32 → 28 → 14 → 10 → 5 gives a flattened size of 32·5·5 = 800
and Fashion-MNIST's 28 → 24 → 12 → 8 → 4 gives 32·4·4 = 512; the size is derived from
``input_shape``, and inputs smaller than 16×16 are rejected by :func:`hpcfl.models.build_model`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

PROJ_DIM = 256
"""Width of the projection (MOON's ``out_dim``), i.e. of the representation."""


def encoder_size(height: int, width: int) -> tuple[int, int]:
    """Spatial size after the encoder (conv5 → pool2 → conv5 → pool2); ≤ 0 means too small."""
    for _ in range(2):
        height, width = (height - 4) // 2, (width - 4) // 2
    return height, width


class CNNProj(nn.Module):
    """MOON/FedCKA CNN (see the module docstring); ``projection`` gives the 256-d representation."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        channels, height, width = input_shape
        out_h, out_w = encoder_size(height, width)
        self.conv1 = nn.Conv2d(channels, 16, kernel_size=5)
        self.relu1 = nn.ReLU(inplace=False)
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=5)
        self.relu2 = nn.ReLU(inplace=False)
        self.pool2 = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(32 * out_h * out_w, 120)
        self.relu3 = nn.ReLU(inplace=False)
        self.fc2 = nn.Linear(120, 84)
        self.relu4 = nn.ReLU(inplace=False)
        self.fc3 = nn.Linear(84, 84)
        self.relu5 = nn.ReLU(inplace=False)
        self.projection = nn.Linear(84, PROJ_DIM)
        self.classifier = nn.Linear(PROJ_DIM, num_classes)

    def features(self, x: Tensor) -> Tensor:
        """The projection output ``(B, 256)``: MOON's representation, the classifier's input."""
        x = self.pool1(self.relu1(self.conv1(x)))  # (B, 16, (H-4)/2, (W-4)/2)
        x = self.pool2(self.relu2(self.conv2(x)))  # (B, 32, h, w)
        x = torch.flatten(x, 1)  # (B, 32·h·w)
        x = self.relu3(self.fc1(x))  # (B, 120)
        x = self.relu4(self.fc2(x))  # (B, 84)
        x = self.relu5(self.fc3(x))  # (B, 84)
        return self.projection(x)  # (B, 256)

    def forward_with_repr(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Logits ``(B, C)`` and the 256-d projection ``(B, 256)`` in one forward pass."""
        rep = self.features(x)
        return self.classifier(rep), rep

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(B, C)``."""
        return self.classifier(self.features(x))
