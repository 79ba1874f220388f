"""The two models of BlazeFL's published benchmark, defined once for BlazeFL's side and hpcfl's side.

BlazeFL's benchmark (its ``benchmarks/`` and ``examples/quickstart-fedavg/models/selector.py``) trains
``CNN``, the CIFAR-10 network of PyTorch's "Training a classifier" tutorial (conv 5×5 3→6, pool, conv
5×5 6→16, pool, fc 400→120→84→10: 62,006 parameters), and torchvision's ``resnet18(num_classes=10)``
(the ImageNet layout: a 7×7 stride-2 stem and a max-pool before the four stages, BatchNorm; 11,181,642
parameters; on 32×32 inputs the stages see 8×8 … 1×1 maps). hpcfl's own ``simplecnn`` and ``resnet18``
are different networks (hpcfl's ResNet-18 is the CIFAR layout, whose 3×3 stem keeps 32×32 maps where
torchvision's reduces them to 8×8 before the first stage: many times the compute per image), so this
module gives both frameworks the same two modules. ``ResNet18`` here has torchvision's layers, in its
order and with its initialisation: checked against torchvision 0.28.0's ``resnet18(num_classes=10)``
(same state_dict keys and shapes, the same initial weights after the same ``manual_seed``, the same
outputs in eval mode); hpcfl's venv has no torchvision, so its tests check the counts and the keys.

Imports only torch, so BlazeFL's venv and hpcfl's can both import it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class BlazeCNN(nn.Module):
    """BlazeFL's ``CNN`` (the PyTorch tutorial's CIFAR-10 network) for 3×32×32 inputs."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    @property
    def classifier(self) -> nn.Linear:
        return self.fc3

    def features(self, x: Tensor) -> Tensor:
        x = self.pool(F.relu(self.conv1(x)))  # (B, 6, 14, 14)
        x = self.pool(F.relu(self.conv2(x)))  # (B, 16, 5, 5)
        return F.relu(self.fc2(F.relu(self.fc1(torch.flatten(x, 1)))))  # (B, 84)

    def forward_with_repr(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.features(x)
        return self.fc3(h), h

    def forward(self, x: Tensor) -> Tensor:
        return self.fc3(self.features(x))  # (B, C)


class BasicBlock(nn.Module):
    """torchvision's ResNet ``BasicBlock`` (two 3×3 convs, BatchNorm, a 1×1 projection when the shape
    changes)."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=False)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """torchvision's ``resnet18(num_classes=...)``: the same modules, names, order and initialisation."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=False)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths, inplanes = (64, 128, 256, 512), 64
        for i, planes in enumerate(widths, start=1):
            stride = 1 if i == 1 else 2
            setattr(
                self,
                f"layer{i}",
                nn.Sequential(BasicBlock(inplanes, planes, stride), BasicBlock(planes, planes)),
            )
            inplanes = planes
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    @property
    def classifier(self) -> nn.Linear:
        return self.fc

    def features(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))  # (B, 64, H/4, W/4)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))  # (B, 512, H/32, W/32)
        return torch.flatten(self.avgpool(x), 1)  # (B, 512)

    def forward_with_repr(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.features(x)
        return self.fc(h), h

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.features(x))  # (B, C)


MODELS = {"cnn": BlazeCNN, "resnet18": ResNet18}


def build(name: str, num_classes: int = 10) -> nn.Module:
    """One of BlazeFL's benchmark models by its name here (``cnn`` | ``resnet18``)."""
    return MODELS[name](num_classes)
