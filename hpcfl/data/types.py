"""The in-memory dataset types every loader returns.

A dataset is two splits of already-normalised tensors (or, for text, symbol codes) plus what the partitioner and the models
need to know about it (class count, input shape, the writers of a naturally federated dataset).
Tensors are shared by the in-process cache of :func:`hpcfl.data.load_dataset`: treat them as
read-only (index them, never modify them in place).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Split:
    """One split held in memory."""

    x: torch.Tensor  # float32 (N, C, H, W), already normalised; uint8 (N, L) symbol codes for text
    y: torch.Tensor  # int64 (N,)

    def __len__(self) -> int:
        return int(self.y.shape[0])


@dataclass(frozen=True)
class TestSelection:
    """How a run picks its test set from a dataset's pooled one (:func:`hpcfl.data.testset.run_test_set`).

    ``own_writers``: under partition ``natural``, the test shares of the writers the run trains
    (``natural_test_clients``; LEAF evaluates a run on its own users' test data), not every
    writer's; ``count``: then that many of those samples drawn from ``seed`` (an estimate of test
    accuracy a CPU can afford), None for all; ``option``: the dataset option that set ``count``,
    named in the one-line error when the run's set is smaller."""

    own_writers: bool = True
    count: int | None = None
    seed: int = 0
    option: str = "test_samples"


@dataclass(frozen=True)
class Dataset:
    """A train and a test split with the metadata partitioners and models need."""

    name: str
    train: Split
    test: Split
    num_classes: int
    input_shape: tuple[int, int, int]  # (C, H, W); (1, 1, L) for text
    # Train / test index tensors per writer (FEMNIST), aligned by writer; None for pooled datasets.
    natural_clients: list[torch.Tensor] | None = None
    natural_test_clients: list[torch.Tensor] | None = None
    # Text: the size of the symbol vocabulary ``x`` indexes (the classes are the next symbol); None
    # for images. Models that read symbols check it against their own (hpcfl.models.build_model).
    vocab_size: int | None = None
    # How a run picks its test set from ``test`` (None: the whole pooled test set, every partition)
    test_selection: TestSelection | None = None
