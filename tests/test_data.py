"""Dataset loading: real MNIST / Fashion-MNIST / FEMNIST files, checksums, downloads, CIFAR pickles."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import pickle
import shutil
import struct
import tarfile
import time
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcfl.data import (
    DATASETS,
    NORMALIZATION,
    load_dataset,
    make_synthetic,
    partition,
    resolve_data_root,
)
from hpcfl.data import download as dl
from hpcfl.data.cifar import restricted_loads
from hpcfl.errors import ConfigError, DataError

FMNIST_TRAIN_LABELS_MD5 = "25c81989df183df01b3e8a0aad5dffbe"
MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


@pytest.fixture(autouse=True)
def _private_checksum_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keep checksum sidecars for read-only directories out of the real ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))


@pytest.fixture(scope="module")
def fmnist(data_root: Path):
    return load_dataset("fashion-mnist", data_root, download=False)


# --------------------------------------------------------------------------- real IDX files


def test_fashion_mnist_sizes_counts_and_first_labels(fmnist) -> None:
    assert fmnist.name == "fashion-mnist" and fmnist.num_classes == 10 and fmnist.input_shape == (1, 28, 28)
    assert fmnist.train.x.shape == (60000, 1, 28, 28) and fmnist.train.x.dtype == torch.float32
    assert fmnist.test.x.shape == (10000, 1, 28, 28)
    assert fmnist.train.y.dtype == torch.int64 and len(fmnist.train) == 60000 and len(fmnist.test) == 10000
    assert torch.bincount(fmnist.train.y).tolist() == [6000] * 10
    assert torch.bincount(fmnist.test.y).tolist() == [1000] * 10
    # first labels of the official files: train starts with an ankle boot, then two T-shirts
    assert fmnist.train.y[:10].tolist() == [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]
    assert fmnist.test.y[:10].tolist() == [9, 2, 1, 1, 6, 1, 4, 6, 5, 7]
    assert fmnist.natural_clients is None


def test_fashion_mnist_is_normalised_and_matches_raw_pixels(fmnist, data_root: Path) -> None:
    x = fmnist.train.x
    assert abs(x.mean().item()) < 0.01 and abs(x.std().item() - 1.0) < 0.01
    with gzip.open(data_root / "fashion-mnist" / "train-images-idx3-ubyte.gz") as fh:
        raw = fh.read(16 + 2 * 784)
    assert struct.unpack(">4i", raw[:16]) == (2051, 60000, 28, 28)
    pixels = torch.tensor(list(raw[16:]), dtype=torch.float32).view(2, 1, 28, 28)
    mean, std = NORMALIZATION["fashion-mnist"]
    restored = (x[:2] * std[0] + mean[0]) * 255.0
    assert torch.allclose(restored, pixels, atol=1e-3)


def test_loads_are_cached_in_process(fmnist, data_root: Path) -> None:
    start = time.perf_counter()
    again = load_dataset("fmnist", str(data_root), download=False)
    assert again is fmnist
    assert time.perf_counter() - start < 0.5


def test_mnist_official_counts_and_labels(data_root: Path) -> None:
    mnist = load_dataset("mnist", data_root, download=False)
    assert torch.bincount(mnist.train.y).tolist() == MNIST_TRAIN_COUNTS
    assert torch.bincount(mnist.test.y).tolist() == MNIST_TEST_COUNTS
    assert mnist.train.y[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    assert mnist.test.y[:10].tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]
    assert abs(mnist.train.x.mean().item()) < 0.01 and abs(mnist.train.x.std().item() - 1.0) < 0.01


# --------------------------------------------------------------------------- checksums


def _fmnist_copy(data_root: Path, dest: Path) -> Path:
    """A Fashion-MNIST directory in ``dest`` with the images symlinked and the labels copied."""
    target = dest / "fashion-mnist"
    target.mkdir(parents=True)
    for name in ("train-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte.gz"):
        os.symlink(data_root / "fashion-mnist" / name, target / name)
    for name in ("train-labels-idx1-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        shutil.copy(data_root / "fashion-mnist" / name, target / name)
    return target


def test_corrupt_file_is_refused_with_both_digests(data_root: Path, tmp_path: Path) -> None:
    target = _fmnist_copy(data_root, tmp_path)
    labels = target / "train-labels-idx1-ubyte.gz"
    blob = bytearray(labels.read_bytes())
    blob[100] ^= 0xFF
    labels.write_bytes(bytes(blob))
    with pytest.raises(DataError) as err:
        load_dataset("fashion-mnist", tmp_path, download=False)
    msg = str(err.value)
    assert "train-labels-idx1-ubyte.gz" in msg and FMNIST_TRAIN_LABELS_MD5 in msg
    assert hashlib.md5(bytes(blob)).hexdigest() in msg
    assert "delete it and re-download" in msg and "\n" not in msg


def test_checksum_is_cached_in_a_sidecar_keyed_by_size_and_mtime(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _fmnist_copy(data_root, tmp_path) / "train-labels-idx1-ubyte.gz"
    assert dl.file_md5(path) == FMNIST_TRAIN_LABELS_MD5
    sidecar = path.with_name(f".{path.name}.md5.json")
    assert json.loads(sidecar.read_text())["md5"] == FMNIST_TRAIN_LABELS_MD5

    calls = []
    real_md5sum = dl.md5sum
    monkeypatch.setattr(dl, "md5sum", lambda p: calls.append(p) or real_md5sum(p))
    dl.verify_md5(path, FMNIST_TRAIN_LABELS_MD5)
    assert calls == []  # served from the sidecar
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    dl.verify_md5(path, FMNIST_TRAIN_LABELS_MD5)
    assert len(calls) == 1  # a touched file is hashed again


def test_read_only_dataset_dir_is_never_written(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    path = store / "file.bin"
    path.write_bytes(b"hello")
    store.chmod(0o555)
    try:
        assert dl.file_md5(path) == hashlib.md5(b"hello").hexdigest()
        assert sorted(p.name for p in store.iterdir()) == ["file.bin"]
        assert any((Path(os.environ["XDG_CACHE_HOME"]) / "hpcfl" / "checksums").iterdir())
        assert dl.file_md5(path) == hashlib.md5(b"hello").hexdigest()
    finally:
        store.chmod(0o755)


# --------------------------------------------------------------------------- missing files and downloads


def test_missing_file_without_download_says_where_and_how(tmp_path: Path) -> None:
    with pytest.raises(DataError) as err:
        load_dataset("mnist", tmp_path, download=False)
    msg = str(err.value)
    assert "train-images-idx3-ubyte.gz" in msg and str(tmp_path / "mnist") in msg
    assert "--data-root" in msg and "HPCFL_DATA" in msg and "\n" not in msg


def test_offline_download_failure_is_one_clear_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(dl.urllib.request, "urlopen", offline)
    with pytest.raises(DataError) as err:
        load_dataset("fashion-mnist", tmp_path, download=True)
    msg = str(err.value)
    assert "train-images-idx3-ubyte.gz" in msg and "fashion-mnist.s3-website" in msg
    assert "go online" in msg and "HPCFL_DATA" in msg and "\n" not in msg
    assert list((tmp_path / "fashion-mnist").iterdir()) == []  # no partial file left behind


def test_download_verifies_and_renames_atomically(data_root: Path, tmp_path: Path) -> None:
    src = data_root / "fashion-mnist" / "train-labels-idx1-ubyte.gz"
    remote = dl.RemoteFile(src.name, src.as_uri(), FMNIST_TRAIN_LABELS_MD5)
    got = dl.ensure_file(tmp_path / "fashion-mnist", remote, dataset="fashion-mnist", download=True)
    assert got.read_bytes() == src.read_bytes()
    assert not [p for p in got.parent.iterdir() if ".part" in p.name]

    bad = dl.RemoteFile("other.gz", src.as_uri(), "0" * 32)
    with pytest.raises(DataError, match="expected 0{32}"):
        dl.ensure_file(tmp_path / "x", bad, dataset="fashion-mnist", download=True)
    assert list((tmp_path / "x").iterdir()) == []


def test_malformed_idx_is_a_data_error(tmp_path: Path) -> None:
    directory = tmp_path / "mnist"
    directory.mkdir()

    def write(name: str, payload: bytes) -> None:
        with gzip.open(directory / name, "wb") as fh:
            fh.write(payload)

    images = struct.pack(">4i", 2051, 2, 28, 28) + bytes(2 * 784)
    write("train-images-idx3-ubyte.gz", images)
    write("train-labels-idx1-ubyte.gz", struct.pack(">2i", 2049, 2) + bytes([1, 2]))
    write("t10k-images-idx3-ubyte.gz", images[:-5])  # truncated pixels
    write("t10k-labels-idx1-ubyte.gz", struct.pack(">2i", 2049, 2) + bytes([1, 2]))
    with pytest.raises(DataError, match="t10k-images.*header says 2x28x28"):
        load_dataset("mnist", tmp_path, download=False, verify=False)
    write("t10k-images-idx3-ubyte.gz", struct.pack(">4i", 2049, 2, 28, 28) + bytes(2 * 784))
    with pytest.raises(DataError, match="magic 2049, expected 2051"):
        load_dataset("mnist", tmp_path, download=False, verify=False)
    write("t10k-images-idx3-ubyte.gz", images)
    tiny = load_dataset("mnist", tmp_path, download=False, verify=False)
    assert tiny.train.y.tolist() == [1, 2] and tiny.test.x.shape == (2, 1, 28, 28)


def test_resolve_data_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HPCFL_DATA", str(tmp_path / "env"))
    assert resolve_data_root(tmp_path / "arg") == tmp_path / "arg"
    assert resolve_data_root(None) == tmp_path / "env"
    monkeypatch.delenv("HPCFL_DATA")
    assert resolve_data_root(None) == Path.home() / ".cache" / "hpcfl"


def test_relative_data_roots_become_absolute_where_they_enter(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A relative root names the directory seen from where it entered, whatever the cwd later is."""
    from hpcfl.config import load_cli_config
    from hpcfl.data.root import absolutize_env

    (tmp_path / "work" / "repo").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work" / "repo")
    monkeypatch.setenv("HPCFL_DATA", "../shared/datasets")
    expected = tmp_path / "work" / "shared" / "datasets"
    assert resolve_data_root(None) == expected
    assert resolve_data_root("../shared/datasets") == expected
    cfg = load_cli_config(None, ["data_root=../d"], None)
    assert cfg.data_root == str(tmp_path / "work" / "d")
    assert load_cli_config(None, [], "../flag").data_root == str(tmp_path / "work" / "flag")
    absolutize_env()
    monkeypatch.chdir(tmp_path)
    assert os.environ["HPCFL_DATA"] == str(expected) and resolve_data_root(None) == expected


def test_unknown_dataset_and_option_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown dataset 'fashion-mnst'.*did you mean 'fashion-mnist'"):
        load_dataset("fashion-mnst")
    with pytest.raises(ConfigError, match="takes no option 'verfy'"):
        load_dataset("mnist", verfy=False)
    assert set(DATASETS) == {
        "mnist",
        "fashion-mnist",
        "cifar10",
        "cifar100",
        "femnist",
        "shakespeare",
        "synthetic",
    }


# --------------------------------------------------------------------------- CIFAR (official pickle format)


class _Py2Pickler(pickle._Pickler):
    """Writes str and bytes as Python-2 ``str`` (BINSTRING), as the official CIFAR pickles do."""

    dispatch = dict(pickle._Pickler.dispatch)

    def _save_str8(self, obj: str | bytes) -> None:
        raw = obj if isinstance(obj, bytes) else obj.encode("latin1")
        if len(raw) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(raw)]) + raw)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(raw)) + raw)
        self.memoize(obj)

    dispatch[bytes] = _save_str8
    dispatch[str] = _save_str8


def _py2_pickle(obj: object) -> bytes:
    buf = io.BytesIO()
    _Py2Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue().replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")  # numpy 1 name


def _cifar_batches(kind: str, seed: int) -> tuple[dict[str, bytes], np.ndarray, np.ndarray]:
    """Tiny official-format batches: member name → pickle bytes, plus all data and labels in order."""
    rng = np.random.default_rng(seed)
    names = (
        [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"] if kind == "cifar10" else ["train", "test"]
    )
    blobs, datas, labels = {}, [], []
    for name in names:
        n = 3 if kind == "cifar10" else 7
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        if kind == "cifar10":
            y = rng.integers(0, 10, size=n).tolist()
            batch = {b"batch_label": b"tiny", b"labels": y, b"data": data, b"filenames": [b"x.png"] * n}
        else:
            y = rng.integers(0, 100, size=n).tolist()
            batch = {
                b"filenames": [b"x.png"] * n,
                b"fine_labels": y,
                b"coarse_labels": [0] * n,
                b"data": data,
            }
        blobs[name] = _py2_pickle(batch)
        datas.append(data)
        labels.append(np.asarray(y))
    return blobs, np.concatenate(datas), np.concatenate(labels)


def _write_tar(path: Path, inner: str, blobs: dict[str, bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, blob in {"batches.meta": _py2_pickle({b"label_names": [b"a"]}), **blobs}.items():
            info = tarfile.TarInfo(f"{inner}/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))


@pytest.mark.parametrize(
    ("kind", "inner", "archive", "n_train", "n_test"),
    [
        ("cifar10", "cifar-10-batches-py", "cifar-10-python.tar.gz", 15, 3),
        ("cifar100", "cifar-100-python", "cifar-100-python.tar.gz", 7, 7),
    ],
)
def test_cifar_round_trip_from_archive_and_directory(
    tmp_path: Path, kind: str, inner: str, archive: str, n_train: int, n_test: int
) -> None:
    blobs, data, labels = _cifar_batches(kind, seed=1)
    _write_tar(tmp_path / "a" / kind / archive, inner, blobs)
    ds = load_dataset(kind, tmp_path / "a", download=False, verify=False)
    assert ds.num_classes == (10 if kind == "cifar10" else 100) and ds.input_shape == (3, 32, 32)
    assert ds.train.x.shape == (n_train, 3, 32, 32) and ds.test.x.shape == (n_test, 3, 32, 32)
    assert torch.equal(torch.cat([ds.train.y, ds.test.y]), torch.from_numpy(labels))
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in NORMALIZATION[kind])
    restored = (torch.cat([ds.train.x, ds.test.x]) * std + mean) * 255.0
    expected = torch.from_numpy(data.reshape(-1, 3, 32, 32).astype(np.float32))  # R, G, B planes
    assert torch.allclose(restored, expected, atol=1e-3)

    # the extracted directory reads the same
    for name, blob in blobs.items():
        (tmp_path / "d" / kind / inner).mkdir(parents=True, exist_ok=True)
        (tmp_path / "d" / kind / inner / name).write_bytes(blob)
    extracted = load_dataset(kind, tmp_path / "d", download=False)
    assert torch.equal(extracted.train.x, ds.train.x) and torch.equal(extracted.test.y, ds.test.y)

    # the archive is checksum-verified by default: a home-made one is not the official file
    with pytest.raises(DataError, match=f"{archive}.*expected"):
        load_dataset(kind, tmp_path / "a", download=False)


def test_cifar_accepts_python3_pickles(tmp_path: Path) -> None:
    data = np.arange(2 * 3072, dtype=np.int64).astype(np.uint8).reshape(2, 3072)
    blob = pickle.dumps({b"data": data, b"labels": [3, 4]}, protocol=4)
    directory = tmp_path / "cifar10" / "cifar-10-batches-py"
    directory.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (directory / name).write_bytes(blob)
    ds = load_dataset("cifar10", tmp_path, download=False)
    assert ds.train.y.tolist() == [3, 4] * 5 and ds.test.y.tolist() == [3, 4]


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = pickle.dumps({b"data": _Evil(marker), b"labels": [0]}, protocol=4)
    with pytest.raises(DataError, match=r"refusing to unpickle (posix|os|nt)\.system"):
        restricted_loads(evil, source="test")
    blobs, _, _ = _cifar_batches("cifar10", seed=0)
    blobs["test_batch"] = evil
    _write_tar(tmp_path / "cifar10" / "cifar-10-python.tar.gz", "cifar-10-batches-py", blobs)
    with pytest.raises(DataError, match="refusing to unpickle") as err:
        load_dataset("cifar10", tmp_path, download=False, verify=False)
    assert "test_batch" in str(err.value)
    assert not marker.exists()


def test_broken_cifar_pickle_and_archive_are_data_errors(tmp_path: Path) -> None:
    blobs, _, _ = _cifar_batches("cifar100", seed=0)
    with pytest.raises(DataError, match="not a valid CIFAR pickle"):
        restricted_loads(blobs["train"][:50], source="x")
    del blobs["test"]
    _write_tar(tmp_path / "cifar100" / "cifar-100-python.tar.gz", "cifar-100-python", blobs)
    with pytest.raises(DataError, match="lacks cifar-100-python/test"):
        load_dataset("cifar100", tmp_path, download=False, verify=False)


# --------------------------------------------------------------------------- FEMNIST (LEAF JSON)


def test_femnist_sample_writers_and_natural_partition(data_root: Path) -> None:
    if not (data_root / "femnist-leaf-sample").is_dir():
        pytest.skip("FEMNIST LEAF sample not in the data root")
    ds = load_dataset("femnist", data_root)
    assert ds.num_classes == 62 and ds.input_shape == (1, 28, 28)
    assert ds.train.x.shape == (2328, 1, 28, 28) and ds.test.x.shape == (266, 1, 28, 28)
    assert 0.0 <= ds.train.x.min().item() and ds.train.x.max().item() <= 1.0
    assert int(ds.train.y.max()) < 62 and int(ds.test.y.min()) >= 0
    assert ds.natural_clients is not None and ds.natural_test_clients is not None
    assert len(ds.natural_clients) == 16 and len(ds.natural_test_clients) == 16
    assert (
        sum(len(c) for c in ds.natural_clients) == 2328
        and sum(len(c) for c in ds.natural_test_clients) == 266
    )
    first_file = json.loads(
        next(iter(sorted((data_root / "femnist-leaf-sample" / "train").glob("*_0_*.json")))).read_text()
    )
    assert len(ds.natural_clients[0]) == first_file["num_samples"][0]

    parts = partition(ds.train.y, "natural", 16, seed=0, num_classes=62, natural=ds.natural_clients)
    assert [p.tolist() for p in parts] == [c.tolist() for c in ds.natural_clients]
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(2328))
    assert len(partition(ds.train.y, "natural", 5, seed=0, num_classes=62, natural=ds.natural_clients)) == 5


def test_malformed_femnist_is_a_data_error(tmp_path: Path) -> None:
    doc = {"users": ["w1"], "num_samples": [2], "user_data": {"w1": {"x": [[0.5] * 784], "y": [3]}}}
    for split in ("train", "test"):
        (tmp_path / "femnist" / split).mkdir(parents=True)
        (tmp_path / "femnist" / split / "all_data_0.json").write_text(json.dumps(doc))
    with pytest.raises(DataError, match="declares 2 samples"):
        load_dataset("femnist", tmp_path)
    with pytest.raises(DataError, match="LEAF JSON not found.*HPCFL_DATA"):
        load_dataset("femnist", tmp_path / "nowhere")


# --------------------------------------------------------------------------- synthetic


def test_synthetic_is_seeded_and_learnable() -> None:
    a = make_synthetic(n_train=2000, n_test=500, num_classes=5, input_shape=(3, 8, 8), seed=3)
    b = make_synthetic(n_train=2000, n_test=500, num_classes=5, input_shape=(3, 8, 8), seed=3)
    c = make_synthetic(n_train=2000, n_test=500, num_classes=5, input_shape=(3, 8, 8), seed=4)
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.test.y, b.test.y)
    assert not torch.equal(a.train.x, c.train.x)
    assert a.train.x.shape == (2000, 3, 8, 8) and a.input_shape == (3, 8, 8)
    assert torch.bincount(a.train.y).tolist() == [400] * 5
    # nearest class mean, fitted on train, classifies test almost perfectly
    flat_train, flat_test = a.train.x.flatten(1), a.test.x.flatten(1)
    means = torch.stack([flat_train[a.train.y == k].mean(0) for k in range(5)])
    accuracy = (torch.cdist(flat_test, means).argmin(1) == a.test.y).float().mean().item()
    assert accuracy > 0.95
    via_registry = load_dataset(
        "synthetic", n_train=2000, n_test=500, num_classes=5, input_shape=[3, 8, 8], seed=3
    )
    assert torch.equal(via_registry.train.x, a.train.x)
    with pytest.raises(ConfigError, match="input_shape"):
        make_synthetic(input_shape=(1, 0, 4))
