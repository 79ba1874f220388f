"""Partitioners: coverage, exactness, reproducibility, error messages, saved files and plots."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcfl.data import (
    format_partition_table,
    load_partition,
    parse_partition_spec,
    partition,
    partition_stats,
    plot_partition_heatmap,
    save_partition,
)
from hpcfl.data.idx import read_idx_labels
from hpcfl.errors import ConfigError, DataError

# `hpcfl.data.partition` the attribute is the function; the module is reached through importlib.
partition_module = importlib.import_module("hpcfl.data.partition")


@pytest.fixture(scope="module")
def labels(data_root: Path) -> torch.Tensor:
    """Fashion-MNIST train labels (60000, 6000 per class), straight from the official file."""
    raw = read_idx_labels(data_root / "fashion-mnist" / "train-labels-idx1-ubyte.gz")
    return torch.from_numpy(raw.astype(np.int64))


@pytest.fixture(scope="module")
def small_labels() -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(0).permutation(np.arange(1000) % 10))


def _assert_exact_cover(parts: list[torch.Tensor], n: int) -> None:
    for part in parts:
        assert part.dtype == torch.int64 and part.ndim == 1
        assert torch.all(part[1:] > part[:-1]), "indices must be sorted and unique"
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(n)), "every sample exactly once"


@pytest.mark.parametrize(
    ("spec", "num_clients"),
    [(s, k) for s in ("iid", "dir:0.5", "dir:0.1", "classes:2", "classes:3") for k in (10, 7)]
    + [("classes:1", 10)],
)
def test_every_sample_assigned_exactly_once(labels: torch.Tensor, spec: str, num_clients: int) -> None:
    parts = partition(labels, spec, num_clients, seed=0, num_classes=10)
    assert len(parts) == num_clients
    _assert_exact_cover(parts, labels.numel())


@pytest.mark.parametrize(("per_client", "num_clients"), [(1, 10), (1, 23), (2, 10), (3, 7), (5, 4), (10, 3)])
def test_classes_gives_exactly_c_classes_split_evenly(
    labels: torch.Tensor, per_client: int, num_clients: int
) -> None:
    parts = partition(labels, f"classes:{per_client}", num_clients, seed=1, num_classes=10)
    counts = partition_stats(labels, parts, 10)
    assert ((counts > 0).sum(axis=1) == per_client).all()
    assert ((counts > 0).sum(axis=0) >= 1).all(), "every class is held by someone"
    for column in counts.T:
        shares = column[column > 0]
        assert shares.max() - shares.min() <= 1, "a class is split evenly among its holders"


def test_classes_one_with_ten_clients_gives_one_class_each(labels: torch.Tensor) -> None:
    counts = partition_stats(labels, partition(labels, "classes:1", 10, seed=0, num_classes=10), 10)
    assert sorted(counts.argmax(axis=1).tolist()) == list(range(10))
    assert (counts.max(axis=1) == 6000).all() and (counts.sum(axis=1) == 6000).all()


def test_iid_sizes_are_balanced(labels: torch.Tensor) -> None:
    sizes = [len(p) for p in partition(labels, "iid", 7, seed=0, num_classes=10)]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("spec", ["iid", "dir:0.5", "classes:2"])
def test_same_seed_same_partition_different_seed_different(small_labels: torch.Tensor, spec: str) -> None:
    a = partition(small_labels, spec, 10, seed=5, num_classes=10)
    b = partition(small_labels, spec, 10, seed=5, num_classes=10)
    c = partition(small_labels, spec, 10, seed=6, num_classes=10)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


def test_dirichlet_respects_min_size_and_is_skewed(labels: torch.Tensor) -> None:
    parts = partition(labels, "dir:0.1", 20, seed=0, num_classes=10, min_size=500)
    assert min(len(p) for p in parts) >= 500
    counts = partition_stats(labels, parts, 10)
    # label skew: most clients miss some classes entirely at alpha = 0.1
    assert ((counts == 0).sum(axis=1) > 0).mean() > 0.5


def test_dirichlet_gives_up_with_a_clear_error(
    small_labels: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(partition_module, "MAX_DIRICHLET_TRIES", 20)
    with pytest.raises(ConfigError, match="no draw in 20.*larger ALPHA.*fewer clients"):
        partition(small_labels, "dir:0.001", 50, seed=0, num_classes=10, min_size=15)
    with pytest.raises(ConfigError, match="cannot give each of 200 clients >= 10"):
        partition(small_labels, "dir:0.5", 200, seed=0, num_classes=10)


def test_natural_takes_the_first_writers() -> None:
    y = torch.tensor([0, 1, 1, 2, 0, 2])
    writers = [torch.tensor([0, 1]), torch.tensor([2, 3, 4]), torch.tensor([5])]
    parts = partition(y, "natural", 3, seed=0, num_classes=3, natural=writers)
    assert [p.tolist() for p in parts] == [[0, 1], [2, 3, 4], [5]]
    assert [p.tolist() for p in partition(y, "natural", 2, seed=9, num_classes=3, natural=writers)] == [
        [0, 1],
        [2, 3, 4],
    ]
    with pytest.raises(ConfigError, match="3 writers; use at most 3"):
        partition(y, "natural", 4, seed=0, num_classes=3, natural=writers)


def test_parse_partition_spec() -> None:
    assert parse_partition_spec("iid") == ("iid", None)
    assert parse_partition_spec(" DIR:0.5 ") == ("dir", 0.5)
    assert parse_partition_spec("classes:2") == ("classes", 2)
    assert parse_partition_spec("natural") == ("natural", None)


@pytest.mark.parametrize(
    ("spec", "num_clients", "extra", "fragment"),
    [
        ("dirichlet:0.5", 10, {}, "unknown partition kind 'dirichlet' (did you mean 'dir'?)"),
        ("shards:2", 10, {}, "unknown partition kind 'shards'"),
        ("", 10, {}, "empty partition spec"),
        ("dir", 10, {}, "missing its parameter; write dir:ALPHA"),
        ("dir:", 10, {}, "missing its parameter"),
        ("dir:abc", 10, {}, "ALPHA 'abc' is not a number"),
        ("dir:0", 10, {}, "ALPHA must be a positive"),
        ("dir:-1", 10, {}, "ALPHA must be a positive"),
        ("dir:nan", 10, {}, "ALPHA must be a positive"),
        ("dir:inf", 10, {}, "ALPHA must be a positive"),
        ("classes:0", 10, {}, "C (classes per client) must be >= 1"),
        ("classes:1.5", 10, {}, "C '1.5' is not a whole number"),
        ("classes:11", 10, {}, "C=11 exceeds the dataset's 10 classes"),
        ("classes:2", 4, {}, "not coverable with 4 clients"),
        ("classes:1", 9, {}, "some class would be held by nobody"),
        ("iid:3", 10, {}, "'iid' takes no parameter"),
        ("iid", 0, {}, "number of clients must be a whole number >= 1"),
        ("iid", 1001, {}, "1001 clients but only 1000 samples"),
        ("natural", 10, {}, "needs a dataset with writers"),
        ("iid", 10, {"seed": -1}, "seed must be a non-negative integer"),
        ("iid", 10, {"num_classes": 5}, "pass the dataset's num_classes"),
    ],
)
def test_bad_input_is_one_line_config_error(
    small_labels: torch.Tensor, spec: str, num_clients: int, extra: dict, fragment: str
) -> None:
    kwargs = {"seed": 0, "num_classes": 10, **extra}
    with pytest.raises(ConfigError) as err:
        partition(small_labels, spec, num_clients, **kwargs)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_stats_table_save_load_and_plot(small_labels: torch.Tensor, tmp_path: Path) -> None:
    parts = partition(small_labels, "dir:0.5", 6, seed=2, num_classes=10)
    counts = partition_stats(small_labels, parts, 10)
    assert counts.shape == (6, 10) and counts.dtype == np.int64
    assert counts.sum(axis=1).tolist() == [len(p) for p in parts]
    assert counts.sum(axis=0).tolist() == [100] * 10

    table = format_partition_table(counts).splitlines()
    assert len(table) == 6 + 2 and table[0].split()[-1] == "total" and table[-1].split()[-1] == "1000"

    path = save_partition(tmp_path / "run" / "partition.json", parts, "dir:0.5", 2, counts, dataset="toy")
    doc = json.loads(path.read_text())
    assert doc["spec"] == "dir:0.5" and doc["seed"] == 2 and doc["num_clients"] == 6
    assert doc["clients"][0]["indices"] == parts[0].tolist()
    saved = load_partition(path.parent)  # a directory means its partition.json
    assert saved.spec == "dir:0.5" and saved.seed == 2 and saved.dataset == "toy"
    assert all(torch.equal(a, b) for a, b in zip(saved.parts, parts, strict=True))
    assert np.array_equal(saved.counts, counts)
    assert sorted(p.name for p in path.parent.iterdir()) == ["partition.json"], "no temp file left"

    doc["clients"][1]["size"] += 1
    path.write_text(json.dumps(doc))
    with pytest.raises(DataError, match="malformed.*hpcfl partition"):
        load_partition(path)

    png = plot_partition_heatmap(counts, tmp_path / "plots" / "partition.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    big = plot_partition_heatmap(np.arange(100 * 62).reshape(100, 62), tmp_path / "plots" / "big.png")
    assert big.stat().st_size > 0
    assert sorted(p.name for p in png.parent.iterdir()) == ["big.png", "partition.png"]
