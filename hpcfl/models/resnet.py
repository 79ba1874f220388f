"""CIFAR-style residual networks: ResNet-18 (TCT) and ResNet-8 (FedPVR).

Both use BasicBlocks (He et al., "Deep Residual Learning for Image Recognition", CVPR 2016) and the
CIFAR stem: one 3×3 stride-1 convolution, no max pooling, global average pooling before the
classifier (``AdaptiveAvgPool2d(1)``, so any input size ≥ 1×1 works).

- ``resnet18``: stages of [2, 2, 2, 2] blocks with widths 64/128/256/512, the ResNet-18 of TCT
  (Yu et al., NeurIPS 2022, Section 5.1) for CIFAR-10/100: 11,173,962 parameters for 10 classes.
  TCT's main tables use BatchNorm ("ResNet-18-BN"); Appendix B.2, Table 4 uses GroupNorm with
  ``num_groups=2`` ("ResNet-18-GN"). **The default here is** ``norm="gn"``: its output for a sample
  does not depend on the batch or on running statistics that FedAvg would have to average, which
  keeps client updates and eNTK features (TCT stage 2) per-sample in both train and eval mode.
- ``resnet8``: the CIFAR ResNet of depth 6n+2 with n = 1 (three stages of one BasicBlock, widths
  16/32/64, 78,042 parameters for 10 classes), as used by FedPVR (Li et al., "On the effectiveness
  of partial variance reduction in federated learning with heterogeneous data", CVPR 2023, Section
  4, following Lin et al., FedDF, NeurIPS 2020). We pick the original He et al. widths 16/32/64
  rather than a 64/128/256 variant because that is the depth-8 network of He et al. and FedDF.
  **Its default is** ``norm="bn"``, the BatchNorm of He et al. and FedDF. The FedPVR authors'
  code trains ResNet-8 with GroupNorm of 2 groups (``group_norm_num_groups`` = 2 in its
  ``configs/conf.py``), so comparisons with FedPVR use ``model_options: {norm: gn}`` (the "paper
  code" track of ``benchmarks/README.md``); averaged BatchNorm running statistics under strong label
  skew (``dir:0.1``) add to the round-to-round swings of every method.

Downsampling shortcuts are 1×1 convolutions + norm (projection shortcuts). Convolutions followed by
a norm have no bias. Residual sums are out-of-place (``out + shortcut``) and every ReLU is a
separate ``inplace=False`` module, so forward hooks see every activation unmodified.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

Norm = Literal["bn", "gn"]
NORMS: tuple[str, ...] = ("bn", "gn")
"""``bn``: BatchNorm2d. ``gn``: GroupNorm with :data:`GN_GROUPS` groups."""

GN_GROUPS = 2
"""Groups per GroupNorm layer, as in TCT Appendix B.2 (``num_groups=2``) and the FedPVR authors' code."""


def make_norm(norm: Norm, channels: int) -> nn.Module:
    """A BatchNorm2d (``"bn"``) or 2-group GroupNorm (``"gn"``) over ``channels`` channels."""
    if norm == "bn":
        return nn.BatchNorm2d(channels)
    if norm == "gn":
        return nn.GroupNorm(GN_GROUPS, channels)
    raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with norms, plus an identity or 1×1-projection shortcut."""

    def __init__(self, in_channels: int, channels: int, stride: int, norm: Norm) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = make_norm(norm, channels)
        self.relu1 = nn.ReLU(inplace=False)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=1, padding=1, bias=False)
        self.norm2 = make_norm(norm, channels)
        self.shortcut = nn.Sequential()  # identity when empty
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False),
                make_norm(norm, channels),
            )
        self.relu2 = nn.ReLU(inplace=False)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu1(self.norm1(self.conv1(x)))  # (B, C, H/s, W/s)
        out = self.norm2(self.conv2(out))  # (B, C, H/s, W/s)
        return self.relu2(out + self.shortcut(x))  # out-of-place residual sum


class ResNet(nn.Module):
    """CIFAR ResNet: 3×3 stem, stages of BasicBlocks, global average pool, ``classifier``."""

    def __init__(
        self,
        input_shape: tuple[int, int, int],
        num_classes: int,
        *,
        blocks: tuple[int, ...],
        widths: tuple[int, ...],
        norm: Norm,
    ) -> None:
        super().__init__()
        if len(blocks) != len(widths):
            raise ValueError("blocks and widths must have one entry per stage")
        self.conv1 = nn.Conv2d(input_shape[0], widths[0], 3, stride=1, padding=1, bias=False)
        self.norm1 = make_norm(norm, widths[0])
        self.relu1 = nn.ReLU(inplace=False)
        in_channels = widths[0]
        for i, (n_blocks, width) in enumerate(zip(blocks, widths, strict=True)):
            stride = 1 if i == 0 else 2
            stage = []
            for b in range(n_blocks):
                stage.append(BasicBlock(in_channels, width, stride if b == 0 else 1, norm))
                in_channels = width
            self.add_module(f"layer{i + 1}", nn.Sequential(*stage))
        self.num_stages = len(blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(in_channels, num_classes)

    def features(self, x: Tensor) -> Tensor:
        """The pooled representation ``(B, widths[-1])`` fed to the classifier."""
        x = self.relu1(self.norm1(self.conv1(x)))  # (B, w0, H, W)
        for i in range(self.num_stages):
            x = getattr(self, f"layer{i + 1}")(x)  # (B, w_i, H/2^i, W/2^i)
        return torch.flatten(self.pool(x), 1)  # (B, w_last)

    def forward_with_repr(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Logits ``(B, C)`` and the pooled representation they are computed from."""
        rep = self.features(x)
        return self.classifier(rep), rep

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(B, C)``."""
        return self.classifier(self.features(x))


def resnet18(input_shape: tuple[int, int, int], num_classes: int, *, norm: Norm = "gn") -> ResNet:
    """TCT's CIFAR ResNet-18 ([2, 2, 2, 2] blocks, widths 64/128/256/512); GroupNorm by default."""
    return ResNet(input_shape, num_classes, blocks=(2, 2, 2, 2), widths=(64, 128, 256, 512), norm=norm)


def resnet8(input_shape: tuple[int, int, int], num_classes: int, *, norm: Norm = "bn") -> ResNet:
    """FedPVR's CIFAR ResNet-8 ([1, 1, 1] blocks, widths 16/32/64); BatchNorm by default,
    ``norm="gn"`` for the FedPVR authors' GroupNorm(2)."""
    return ResNet(input_shape, num_classes, blocks=(1, 1, 1), widths=(16, 32, 64), norm=norm)
