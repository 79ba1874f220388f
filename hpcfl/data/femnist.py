"""FEMNIST in LEAF's JSON format: one client per writer, 62 classes, 1x28x28 images.

Layout: ``<root>/femnist/{train,test}/*.json`` (a full LEAF build) or, when that is absent,
``<root>/femnist-leaf-sample/{train,test}/*.json``. Each file is
``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [[784 floats]], "y": [int]}}}``.
Files are read in natural order of their names (``..._2_...`` before ``..._10_...``) and writers in
each file's ``users`` order; that order defines the client ids. Pixels are kept as LEAF gives them
(floats in 0..1, 1.0 = white background), with no mean/std normalisation, as LEAF's reference models
expect. LEAF publishes no checksum, so the structure is validated instead.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from hpcfl.errors import DataError

NUM_CLASSES = 62
PIXELS = 28 * 28
FOLDERS = ("femnist", "femnist-leaf-sample")


def _natural_key(path: Path) -> list[Any]:
    return [int(tok) if tok.isdigit() else tok for tok in re.split(r"(\d+)", path.name)]


def find_femnist_dir(root: Path) -> Path:
    """The FEMNIST directory under ``root`` (``femnist/`` preferred), or a DataError saying where it looked."""
    for folder in FOLDERS:
        candidate = root / folder
        if (candidate / "train").is_dir() and (candidate / "test").is_dir():
            return candidate
    looked = " or ".join(str(root / f / "{train,test}") for f in FOLDERS)
    raise DataError(
        f"femnist: LEAF JSON not found in {looked}; FEMNIST is not downloaded automatically: build it with "
        "LEAF's preprocess.sh (https://github.com/TalwalkarLab/leaf) and point --data-root or HPCFL_DATA "
        "at the directory holding femnist/"
    )


def _load_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as err:
        raise DataError(f"{path} is not readable LEAF JSON ({err}); regenerate it with LEAF") from err
    if not isinstance(doc, dict) or not {"users", "num_samples", "user_data"} <= doc.keys():
        raise DataError(f"{path} is not LEAF JSON: needs keys users, num_samples, user_data")
    return doc


def _writers_of_file(path: Path) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """[(writer, x float32 (n, 784), y int64 (n,))] of one LEAF file, every field cross-checked."""
    doc = _load_json(path)
    users, counts, data = doc["users"], doc["num_samples"], doc["user_data"]
    if not isinstance(users, list) or not isinstance(counts, list) or not isinstance(data, dict):
        raise DataError(f"{path}: users and num_samples must be lists and user_data a mapping")
    if len(users) != len(counts):
        raise DataError(f"{path}: {len(users)} users but {len(counts)} num_samples entries")
    if len(set(users)) != len(users) or set(users) != set(data):
        raise DataError(f"{path}: users and the keys of user_data differ (or repeat)")
    out = []
    for user, count in zip(users, counts, strict=True):
        record = data[user]
        if not isinstance(record, dict) or "x" not in record or "y" not in record:
            raise DataError(f"{path}: user_data[{user!r}] needs x and y")
        try:
            x = np.asarray(record["x"], dtype=np.float32)
            y = np.asarray(record["y"], dtype=np.int64)
        except (TypeError, ValueError) as err:
            raise DataError(f"{path}: user {user!r} has ragged or non-numeric x/y ({err})") from err
        if x.shape != (count, PIXELS) or y.shape != (count,):
            raise DataError(
                f"{path}: user {user!r} declares {count} samples but has x {x.shape} and y {y.shape} "
                f"(each x must be {PIXELS} floats)"
            )
        if count and (int(y.min()) < 0 or int(y.max()) >= NUM_CLASSES):
            raise DataError(f"{path}: user {user!r} has labels outside 0..{NUM_CLASSES - 1}")
        if count and not (np.isfinite(x).all() and x.min() >= 0.0 and x.max() <= 1.0):
            raise DataError(f"{path}: user {user!r} has pixels outside 0..1")
        out.append((str(user), x, y))
    return out


def _read_split(directory: Path) -> list[tuple[str, np.ndarray, np.ndarray]]:
    files = sorted(directory.glob("*.json"), key=_natural_key)
    if not files:
        raise DataError(f"femnist: no *.json files in {directory}; regenerate the LEAF split")
    writers: list[tuple[str, np.ndarray, np.ndarray]] = []
    seen: set[str] = set()
    for path in files:
        for writer in _writers_of_file(path):
            if writer[0] in seen:
                raise DataError(f"{path}: writer {writer[0]!r} appears in two files of {directory}")
            seen.add(writer[0])
            writers.append(writer)
    return writers


def load_femnist_arrays(
    root: Path,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """(x_train (N,1,28,28), y_train, x_test, y_test, train indices per writer, test indices per writer).

    Writers are aligned: entry ``i`` of both index lists belongs to the same writer (an empty test
    list when a writer has no test samples), and the test split is stored in that writer order.
    A test writer absent from train is a DataError.
    """
    directory = find_femnist_dir(root)
    train, test = _read_split(directory / "train"), _read_split(directory / "test")
    if not train:
        raise DataError(f"femnist: {directory / 'train'} holds no writers; regenerate the LEAF split")
    order = {writer: i for i, (writer, _, _) in enumerate(train)}
    unknown = [w for w, _, _ in test if w not in order]
    if unknown:
        raise DataError(
            f"femnist: test writer {unknown[0]!r} has no train data in {directory}; regenerate the split"
        )
    test_by_writer = {w: (x, y) for w, x, y in test}

    def indices(sizes: list[int]) -> list[np.ndarray]:
        ends = np.cumsum(sizes, dtype=np.int64)
        return [np.arange(end - n, end, dtype=np.int64) for n, end in zip(sizes, ends, strict=True)]

    empty_x, empty_y = np.zeros((0, PIXELS), np.float32), np.zeros(0, np.int64)
    test_aligned = [test_by_writer.get(w, (empty_x, empty_y)) for w, _, _ in train]
    x_train = np.concatenate([x for _, x, _ in train]).reshape(-1, 1, 28, 28)
    y_train = np.concatenate([y for _, _, y in train])
    x_test = np.concatenate([x for x, _ in test_aligned]).reshape(-1, 1, 28, 28)
    y_test = np.concatenate([y for _, y in test_aligned])
    train_idx = indices([len(y) for _, _, y in train])
    test_idx = indices([len(y) for _, y in test_aligned])
    return x_train, y_train, x_test, y_test, train_idx, test_idx
