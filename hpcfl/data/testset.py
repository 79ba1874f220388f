"""A run's test set: the dataset's pooled test split, or the part of it a dataset asks for.

A naturally federated dataset may ask (:class:`~hpcfl.data.types.TestSelection`) that a run under
partition ``natural`` be tested on the test shares of the writers it trains, as LEAF evaluates a
run on its own users' test data (``models/main.py`` scores the clients it loaded), and then on a
seeded subset of those samples. Shakespeare does both (``dataset_options.test_set: run``, the
default, and ``test_samples``); every other dataset keeps the pooled test set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from hpcfl.data.types import Dataset, Split
from hpcfl.errors import DataError


def run_test_indices(dataset: Dataset, writers: Sequence[int] | None) -> torch.Tensor | None:
    """Indices into ``dataset.test`` of the run's test set, or None for all of it. ``writers``: the
    natural writers the run trains (partition ``natural``), None under any other partition."""
    sel = dataset.test_selection
    if sel is None:
        return None
    shares = dataset.natural_test_clients
    if sel.own_writers and writers is not None and shares is not None:
        chosen = [shares[k] for k in writers]
        idx = torch.cat(chosen) if chosen else torch.zeros(0, dtype=torch.int64)  # host: index bookkeeping
        what = f"the test shares of the run's {len(chosen)} writers"
    else:
        idx = torch.arange(len(dataset.test))  # host: index bookkeeping
        what = "the pooled test set"
    if sel.count is not None:
        n = int(idx.numel())
        if not 1 <= sel.count <= n:
            raise DataError(
                f"{dataset.name}: {sel.option} {sel.count} cannot be met: {what} holds {n} samples, "
                f"so use 1..{n}"
            )
        draw = np.random.default_rng([sel.seed, 2])  # host: which test samples, a stream of their own
        pick = np.sort(draw.choice(n, sel.count, replace=False))
        idx = idx[torch.from_numpy(pick)]  # host: index bookkeeping
    return idx


def run_test_set(dataset: Dataset, writers: Sequence[int] | None) -> Dataset:
    """``dataset`` with ``test`` replaced by the run's test set (:func:`run_test_indices`) and the
    writers' test shares renumbered into it; ``dataset`` itself when the run uses the whole test set.
    The cached dataset is never modified (a new object)."""
    idx = run_test_indices(dataset, writers)
    if idx is None:
        return dataset
    idx, _ = torch.sort(idx)
    test = Split(x=dataset.test.x[idx], y=dataset.test.y[idx])
    shares = dataset.natural_test_clients
    if shares is not None:  # each writer's share, as positions in the new test split
        where = torch.full((len(dataset.test),), -1, dtype=torch.int64)  # host: index bookkeeping
        where[idx] = torch.arange(idx.numel())  # host: index bookkeeping
        shares = [where[s][where[s] >= 0] for s in shares]
    return dataclasses.replace(dataset, test=test, natural_test_clients=shares)
