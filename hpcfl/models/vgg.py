"""VGG-11 for small images, the model of FedPVR's drift-diversity study.

Simonyan and Zisserman, "Very Deep Convolutional Networks for Large-Scale Image Recognition" (ICLR
2015), configuration A, as used on CIFAR by FedPVR (Li et al., CVPR 2023, Sections 3 and 4, where
variance reduction is applied to the last three layers, i.e. the three fully connected ones):

    [64, M, 128, M, 256, 256, M, 512, 512, M, 512, 512, M]   (3×3 convs, pad 1, ReLU; M = maxpool 2)
    → flatten → fc 512 → ReLU → fc 512 → ReLU → fc C

Deliberate choices:

- **No dropout** in the classifier: train and eval mode then compute the same function (without
  ``batch_norm``), so the eNTK of TCT stage 1, taken in eval mode, is the kernel of the network that
  was trained.
- ``batch_norm=False`` by default (a BatchNorm2d after each convolution when true).
- **Pools adapt to the input**: a max pool is skipped when the feature map is already 1 pixel high or
  wide, so the spatial size never drops below 1. On 3×32×32 all five pools run (32 → 1, flattened
  size 512); on 1×28×28 the sizes go 28 → 14 → 7 → 3 → 1 and the last pool is skipped (flattened
  size 512 again). The flattened size is derived from ``input_shape``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

VGG11: tuple[int | str, ...] = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")
"""VGG configuration A: output channels of 3×3 convolutions, ``"M"`` for a 2×2 max pool."""


class VGG(nn.Module):
    """VGG encoder (``encoder``), two 512-unit hidden layers, then ``classifier``."""

    def __init__(
        self,
        input_shape: tuple[int, int, int],
        num_classes: int,
        *,
        config: tuple[int | str, ...] = VGG11,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        in_channels, height, width = input_shape
        layers: list[nn.Module] = []
        for item in config:
            if item == "M":
                if height >= 2 and width >= 2:  # skip pools that would leave < 1 pixel
                    layers.append(nn.MaxPool2d(2))
                    height, width = height // 2, width // 2
                continue
            out_channels = int(item)
            layers.append(nn.Conv2d(in_channels, out_channels, 3, padding=1))
            if batch_norm:
                layers.append(nn.BatchNorm2d(out_channels))
            layers.append(nn.ReLU(inplace=False))
            in_channels = out_channels
        self.encoder = nn.Sequential(*layers)
        self.fc1 = nn.Linear(in_channels * height * width, 512)
        self.relu1 = nn.ReLU(inplace=False)
        self.fc2 = nn.Linear(512, 512)
        self.relu2 = nn.ReLU(inplace=False)
        self.classifier = nn.Linear(512, num_classes)

    def features(self, x: Tensor) -> Tensor:
        """The 512-d representation fed to the classifier."""
        x = torch.flatten(self.encoder(x), 1)  # (B, 512·h·w)
        x = self.relu1(self.fc1(x))  # (B, 512)
        return self.relu2(self.fc2(x))  # (B, 512)

    def forward_with_repr(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Logits ``(B, C)`` and the representation ``(B, 512)`` they are computed from."""
        rep = self.features(x)
        return self.classifier(rep), rep

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(B, C)``."""
        return self.classifier(self.features(x))


def vgg11(input_shape: tuple[int, int, int], num_classes: int, *, batch_norm: bool = False) -> VGG:
    """VGG-11 (configuration A) for small images; see the module docstring."""
    return VGG(input_shape, num_classes, config=VGG11, batch_norm=batch_norm)
