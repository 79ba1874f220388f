"""The peers bundle as an hpcfl dataset, so that ``hpcfl run`` trains on exactly its arrays and clients.

hpcfl's own plug-in route (``imports: [hpcfl_bundle]`` in a config, with ``benchmarks/peers`` on
``PYTHONPATH``): it registers the dataset ``peers-bundle`` whose ``data_root`` is the bundle folder.
Its writers are the bundle's client index lists (``clients.json``), so ``partition: natural`` with
``num_clients: 100`` gives hpcfl the very lists every peer loads, for every run seed (hpcfl's own
``dir:0.5`` draws its partition from the run's seed; the bundle fixes the partition seed's split).
The arrays are the bundle's ``.npy`` files: hpcfl's Fashion-MNIST, normalised as it normalises it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpcfl.data.types import Dataset, Split
from hpcfl.errors import DataError
from hpcfl.registry import register_dataset

NAME = "peers-bundle"


def load_bundle(name: str, root: Path, download: bool, **options: Any) -> Dataset:
    """The bundle at ``root`` as an hpcfl :class:`Dataset` whose writers are the bundle's clients."""
    root = Path(root)
    try:
        spec = json.loads((root / "spec.json").read_text())
        clients = json.loads((root / "clients.json").read_text())

        def arr(f: str) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(np.load(root / f)))

        train = Split(arr("train_x.npy"), arr("train_y.npy"))
        test = Split(arr("test_x.npy"), arr("test_y.npy"))
    except (OSError, ValueError) as err:
        raise DataError(
            f"{root} is not a complete peers bundle ({err}); build it with benchmarks/peers/experiment.py"
        ) from None
    return Dataset(
        name=NAME,
        train=train,
        test=test,
        num_classes=int(spec["num_classes"]),
        input_shape=tuple(int(d) for d in spec["input_shape"]),  # type: ignore[arg-type]
        natural_clients=[torch.tensor(c, dtype=torch.int64) for c in clients],
    )


register_dataset(NAME, load_bundle)
