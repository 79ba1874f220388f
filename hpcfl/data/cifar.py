"""CIFAR-10 / CIFAR-100 from the official python-pickle archives, with a restricted unpickler.

Layout: ``<root>/cifar10/`` holding ``cifar-10-batches-py/`` (extracted) or
``cifar-10-python.tar.gz``; ``<root>/cifar100/`` holding ``cifar-100-python/`` or
``cifar-100-python.tar.gz``. The extracted directory wins when present; otherwise members are
read straight out of the archive in one streaming pass (nothing is extracted to disk). The
archive is MD5-verified; an extracted directory has no published checksum and is checked for
structure only.

The batches are Python-2 pickles of dicts of bytes keys, lists of ints and one uint8 numpy array.
Pickle can run arbitrary code, so :class:`RestrictedUnpickler` resolves only numpy's array
reconstruction; anything else is refused with a :class:`DataError`.
"""

from __future__ import annotations

import io
import pickle
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcfl.data.download import RemoteFile, ensure_file
from hpcfl.errors import DataError

try:  # numpy >= 2 moved the module; old pickles still name numpy.core.multiarray
    from numpy._core.multiarray import _reconstruct
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]

_CIFAR_URL = "https://www.cs.toronto.edu/~kriz/"

_ALLOWED: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that can rebuild numpy arrays and plain containers and nothing else."""

    def __init__(self, file: io.BufferedIOBase, *, source: str) -> None:
        super().__init__(file, encoding="bytes")
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise DataError(
                f"refusing to unpickle {module}.{name} from {self.source}: an official CIFAR file never "
                "needs it; delete the file and re-download it from the official site"
            ) from None


def restricted_loads(data: bytes, *, source: str) -> Any:
    """Unpickle ``data`` (encoding='bytes') with :class:`RestrictedUnpickler`; malformed → DataError."""
    try:
        return RestrictedUnpickler(io.BytesIO(data), source=source).load()
    except DataError:
        raise
    except Exception as err:  # a broken pickle can raise almost anything; it is the file's fault
        raise DataError(
            f"{source} is not a valid CIFAR pickle ({type(err).__name__}: {err}); delete it and re-download"
        ) from err


@dataclass(frozen=True)
class _Spec:
    """Where one CIFAR variant lives and how its batches are named."""

    folder: str  # directory under the data root
    archive: RemoteFile  # the official .tar.gz
    inner: str  # top directory inside the archive (and the extracted directory's name)
    train: tuple[str, ...]  # train batch member names
    test: str  # test batch member name
    label_key: bytes
    num_classes: int


CIFAR_SPECS: dict[str, _Spec] = {
    "cifar10": _Spec(
        "cifar10",
        RemoteFile(
            "cifar-10-python.tar.gz",
            _CIFAR_URL + "cifar-10-python.tar.gz",
            "c58f30108f718f92721af3b95e74349a",
        ),
        "cifar-10-batches-py",
        tuple(f"data_batch_{i}" for i in range(1, 6)),
        "test_batch",
        b"labels",
        10,
    ),
    "cifar100": _Spec(
        "cifar100",
        RemoteFile(
            "cifar-100-python.tar.gz",
            _CIFAR_URL + "cifar-100-python.tar.gz",
            "eb9058c3a382ffc7106e4002c42a8d85",
        ),
        "cifar-100-python",
        ("train",),
        "test",
        b"fine_labels",
        100,
    ),
}


def _read_members_from_dir(directory: Path, names: list[str]) -> dict[str, bytes]:
    out = {}
    for name in names:
        path = directory / name
        try:
            out[name] = path.read_bytes()
        except OSError as err:
            raise DataError(
                f"{path} is missing or unreadable ({err.strerror}); restore the extracted CIFAR directory "
                f"or remove {directory} so the official archive is used"
            ) from err
    return out


def _read_members_from_tar(archive: Path, inner: str, names: list[str]) -> dict[str, bytes]:
    wanted = {f"{inner}/{name}": name for name in names}
    out: dict[str, bytes] = {}
    try:
        with tarfile.open(archive, mode="r|gz") as tar:  # one streaming pass: gzip cannot seek cheaply
            for member in tar:
                name = wanted.get(member.name.removeprefix("./"))
                if name is None or not member.isfile():
                    continue
                fh = tar.extractfile(member)
                assert fh is not None  # isfile() members always have data
                out[name] = fh.read()
    except (tarfile.TarError, OSError, EOFError, zlib.error) as err:
        raise DataError(f"{archive} is not a readable .tar.gz ({err}); delete it and re-download") from err
    missing = sorted(set(wanted) - {f"{inner}/{n}" for n in out})
    if missing:
        raise DataError(
            f"{archive} lacks {', '.join(missing)}; delete it and re-download the official archive"
        )
    return out


def _decode_batch(
    blob: bytes, source: str, label_key: bytes, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    batch = restricted_loads(blob, source=source)
    if not isinstance(batch, dict) or b"data" not in batch or label_key not in batch:
        raise DataError(f"{source} is not a CIFAR batch (needs keys b'data' and {label_key!r})")
    data, labels = batch[b"data"], batch[label_key]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        shape = getattr(data, "shape", None)
        raise DataError(
            f"{source}: b'data' must be a uint8 array N x 3072, got {type(data).__name__} {shape}"
        )
    try:
        y = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError) as err:
        raise DataError(f"{source}: {label_key!r} is not a list of integers") from err
    if y.shape != (data.shape[0],):
        raise DataError(f"{source}: {data.shape[0]} images but {y.size} labels")
    if y.size and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise DataError(f"{source}: labels outside 0..{num_classes - 1}")
    return data.reshape(-1, 3, 32, 32), y  # rows are R(1024) G(1024) B(1024), row-major 32x32


def load_cifar_arrays(
    name: str, root: Path, *, download: bool, verify: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train images uint8 (N,3,32,32), train labels int64, test images, test labels) of ``cifar10``/``cifar100``.

    CIFAR-100 labels are the fine (100-class) labels. ``verify=False`` skips the archive's MD5 check
    (for hand-made archives in the official format).
    """
    spec = CIFAR_SPECS[name]
    directory = root / spec.folder
    members = [*spec.train, spec.test]
    extracted = directory / spec.inner
    if extracted.is_dir():
        blobs, where = _read_members_from_dir(extracted, members), str(extracted)
    else:
        accepted = f"{spec.folder}/{spec.archive.name} (or the extracted {spec.folder}/{spec.inner}/)"
        archive = ensure_file(
            directory, spec.archive, dataset=name, download=download, verify=verify, accepted=accepted
        )
        blobs, where = _read_members_from_tar(archive, spec.inner, members), str(archive)
    parts = [_decode_batch(blobs[m], f"{where}:{m}", spec.label_key, spec.num_classes) for m in members]
    x_train = np.concatenate([p[0] for p in parts[:-1]])
    y_train = np.concatenate([p[1] for p in parts[:-1]])
    return x_train, y_train, parts[-1][0], parts[-1][1]
