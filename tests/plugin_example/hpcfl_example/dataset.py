"""``example_blobs``: Gaussian class blobs on 1×4×4 "images", drawn from a seed (no files)."""

from __future__ import annotations

from pathlib import Path

import torch

from hpcfl.data import Dataset, Split
from hpcfl.registry import DatasetSpec


def load(
    name: str, root: Path, download: bool, n_train: int = 400, n_test: int = 100, seed: int = 0
) -> Dataset:
    """Four classes, each a unit Gaussian around its own random mean (a learnable task)."""
    g = torch.Generator().manual_seed(int(seed))
    means = 2.0 * torch.randn(4, 1, 4, 4, generator=g)

    def split(n: int) -> Split:
        y = torch.randint(0, 4, (int(n),), generator=g)
        return Split(x=means[y] + torch.randn(int(n), 1, 4, 4, generator=g), y=y)

    return Dataset(name=name, train=split(n_train), test=split(n_test), num_classes=4, input_shape=(1, 4, 4))


SPEC = DatasetSpec(load, options=("n_train", "n_test", "seed"))
