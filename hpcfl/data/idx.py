"""MNIST and Fashion-MNIST from their official IDX ``.gz`` files.

Layout: ``<root>/mnist/`` and ``<root>/fashion-mnist/`` holding the four official file names.
Images: big-endian int32 header (magic 2051, N, 28, 28) then N·784 uint8; labels: (magic 2049, N)
then N uint8. Headers, sizes and label range are checked, so a truncated or foreign file gives a
:class:`DataError` instead of garbage tensors.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np

from hpcfl.data.download import RemoteFile, ensure_file
from hpcfl.errors import DataError

IMAGE_MAGIC = 2051
LABEL_MAGIC = 2049

_MNIST_URL = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/"  # torchvision's mirror since yann.lecun.com went away
)
_FMNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"

# (train images, train labels, test images, test labels) with their official MD5s.
IDX_FILES: dict[str, tuple[RemoteFile, ...]] = {
    "mnist": (
        RemoteFile(
            "train-images-idx3-ubyte.gz",
            _MNIST_URL + "train-images-idx3-ubyte.gz",
            "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        ),
        RemoteFile(
            "train-labels-idx1-ubyte.gz",
            _MNIST_URL + "train-labels-idx1-ubyte.gz",
            "d53e105ee54ea40749a09fcbcd1e9432",
        ),
        RemoteFile(
            "t10k-images-idx3-ubyte.gz",
            _MNIST_URL + "t10k-images-idx3-ubyte.gz",
            "9fb629c4189551a2d022fa330f9573f3",
        ),
        RemoteFile(
            "t10k-labels-idx1-ubyte.gz",
            _MNIST_URL + "t10k-labels-idx1-ubyte.gz",
            "ec29112dd5afa0611ce80d1b7f02629c",
        ),
    ),
    "fashion-mnist": (
        RemoteFile(
            "train-images-idx3-ubyte.gz",
            _FMNIST_URL + "train-images-idx3-ubyte.gz",
            "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        ),
        RemoteFile(
            "train-labels-idx1-ubyte.gz",
            _FMNIST_URL + "train-labels-idx1-ubyte.gz",
            "25c81989df183df01b3e8a0aad5dffbe",
        ),
        RemoteFile(
            "t10k-images-idx3-ubyte.gz",
            _FMNIST_URL + "t10k-images-idx3-ubyte.gz",
            "bef4ecab320f06d8554ea6380940ec79",
        ),
        RemoteFile(
            "t10k-labels-idx1-ubyte.gz",
            _FMNIST_URL + "t10k-labels-idx1-ubyte.gz",
            "bb300cfdad3c16e7a12a480ee83cd310",
        ),
    ),
}


def _read_gz(path: Path) -> bytes:
    try:
        with gzip.open(path, "rb") as fh:
            return fh.read()
    except (OSError, EOFError, zlib.error) as err:
        raise DataError(f"{path} is not a readable gzip file ({err}); delete it and re-download") from err


def _header(raw: bytes, path: Path, ndim: int) -> tuple[int, ...]:
    need = 4 * (1 + ndim)
    if len(raw) < need:
        raise DataError(f"{path} is truncated (no IDX header); delete it and re-download")
    return tuple(int(v) for v in np.frombuffer(raw, dtype=">i4", count=1 + ndim))


def read_idx_images(path: str | Path) -> np.ndarray:
    """Decode an IDX3 image file to a uint8 array (N, rows, cols)."""
    path = Path(path)
    raw = _read_gz(path)
    magic, n, rows, cols = _header(raw, path, 3)
    if magic != IMAGE_MAGIC:
        raise DataError(f"{path} is not an IDX image file (magic {magic}, expected {IMAGE_MAGIC})")
    if n < 0 or rows <= 0 or cols <= 0 or len(raw) != 16 + n * rows * cols:
        raise DataError(
            f"{path} has {len(raw) - 16} pixel bytes but its header says {n}x{rows}x{cols}; "
            "delete it and re-download"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=16).reshape(n, rows, cols)


def read_idx_labels(path: str | Path, num_classes: int = 10) -> np.ndarray:
    """Decode an IDX1 label file to a uint8 array (N,), checking every label is < ``num_classes``."""
    path = Path(path)
    raw = _read_gz(path)
    magic, n = _header(raw, path, 1)
    if magic != LABEL_MAGIC:
        raise DataError(f"{path} is not an IDX label file (magic {magic}, expected {LABEL_MAGIC})")
    if n < 0 or len(raw) != 8 + n:
        raise DataError(
            f"{path} has {len(raw) - 8} labels but its header says {n}; delete it and re-download"
        )
    labels = np.frombuffer(raw, dtype=np.uint8, offset=8)
    if labels.size and int(labels.max()) >= num_classes:
        raise DataError(f"{path} holds label {int(labels.max())}, outside 0..{num_classes - 1}")
    return labels


def load_idx_arrays(
    name: str, root: Path, *, download: bool, verify: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train images, train labels, test images, test labels) of ``mnist`` or ``fashion-mnist`` as uint8.

    Files come from ``<root>/<name>/``; missing ones are downloaded when ``download`` is set.
    ``verify=False`` skips the MD5 check (for hand-made files in the official format).
    """
    directory = root / name
    paths = [
        ensure_file(directory, f, dataset=name, download=download, verify=verify) for f in IDX_FILES[name]
    ]
    x_train, y_train = read_idx_images(paths[0]), read_idx_labels(paths[1])
    x_test, y_test = read_idx_images(paths[2]), read_idx_labels(paths[3])
    for x, y, split in ((x_train, y_train, "train"), (x_test, y_test, "test")):
        if x.shape[0] != y.shape[0]:
            raise DataError(
                f"{name} {split}: {x.shape[0]} images but {y.shape[0]} labels in {directory}; "
                "delete the files and re-download"
            )
    return x_train, y_train, x_test, y_test
