"""The Zarr feature store: exact round trips, refusal of mismatched stores, and no partial write
ever read as complete."""

from __future__ import annotations

import pytest
import torch

from hpcfl.errors import StoreError
from hpcfl.features import (
    FeatureMeta,
    create_feature_store,
    mark_complete,
    model_hash,
    open_client_writer,
    open_feature_store,
    write_client,
)
from hpcfl.features.store import chunk_rows
from hpcfl.models import build_model


def _meta(dtype: str = "float32", p: int = 37, seed: int = 3) -> FeatureMeta:
    return FeatureMeta(
        model_hash="ab" * 32,
        seed=seed,
        p=p,
        logit=0,
        params="all",
        dtype=dtype,
        coords_hash="cd" * 32,
        num_params=1000,
        head="fresh1",
    )


def _client(k: int, rows: int, p: int = 37) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(k)
    return torch.randn(rows, p, generator=gen) * 10, torch.randint(0, 10, (rows,), generator=gen)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_round_trip_is_exact(tmp_path, dtype):
    meta = _meta(dtype)
    path = tmp_path / "features.zarr"
    create_feature_store(path, meta=meta)
    data = {k: _client(k, rows) for k, rows in [(0, 50), (3, 1), (7, 0)]}
    for k, (feats, labels) in data.items():  # each would be a different rank
        write_client(path, k, features=feats, labels=labels, meta=meta)
    mark_complete(path, clients=list(data))
    reader = open_feature_store(path, expect=meta)
    assert reader.clients == [0, 3, 7]
    for k, (feats, labels) in data.items():
        got, got_labels = reader.read_client(k)
        expected = feats.to(meta.torch_dtype)
        assert got.dtype == meta.torch_dtype, f"client {k}: dtype {got.dtype}"
        assert torch.equal(_bits(got), _bits(expected)), f"client {k}: features not bit-exact"
        assert torch.equal(got_labels, labels), f"client {k}: labels differ"
        assert reader.num_rows(k) == feats.shape[0]
    torch.testing.assert_close(
        reader.read_rows(0, 10, 20), data[0][0][10:20].to(meta.torch_dtype), rtol=0, atol=0
    )


def test_streaming_writer_in_unaligned_batches(tmp_path):
    meta = _meta()
    path = tmp_path / "f.zarr"
    create_feature_store(path, meta=meta)
    feats, labels = _client(1, 23)
    writer = open_client_writer(path, 1, rows=23, meta=meta)
    for start in range(0, 23, 5):
        writer.write(start, feats[start : start + 5].double())
    writer.finish(labels)
    mark_complete(path, clients=[1])
    got, _ = open_feature_store(path, expect=meta).read_client(1)
    assert torch.equal(got, feats), "streamed rows differ"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"p": 38}, "p"),
        ({"seed": 4}, "seed"),
        ({"dtype": "float16"}, "dtype"),
        ({"model_hash": "ef" * 32}, "model_hash"),
        ({"head": "keep"}, "head"),
    ],
)
def test_mismatched_store_is_refused_naming_the_field(tmp_path, change, field):
    meta = _meta()
    path = tmp_path / "f.zarr"
    create_feature_store(path, meta=meta)
    write_client(path, 0, features=_client(0, 4)[0], labels=_client(0, 4)[1], meta=meta)
    mark_complete(path, clients=[0])
    other = FeatureMeta(**{**meta.to_attrs(), **change})
    with pytest.raises(
        StoreError, match=rf"{field} \(store .*requested .*delete the store or recompute"
    ) as err:
        open_feature_store(path, expect=other)
    assert "\n" not in str(err.value), "the error must be one line"
    with pytest.raises(StoreError, match=field):
        create_feature_store(path, meta=other)
    create_feature_store(path, meta=other, overwrite=True)  # the fix the message names
    with pytest.raises(StoreError, match="incomplete"):
        open_feature_store(path, expect=other)


def test_interrupted_writes_are_never_complete(tmp_path, monkeypatch):
    meta = _meta()
    path = tmp_path / "f.zarr"
    create_feature_store(path, meta=meta)
    feats, labels = _client(0, 9)
    write_client(path, 0, features=feats, labels=labels, meta=meta)
    # client 1: rows written, the process dies before finish() (no labels, no marker)
    writer = open_client_writer(path, 1, rows=9, meta=meta)
    writer.write(0, feats)
    with pytest.raises(StoreError, match="incomplete"):
        open_feature_store(path, expect=meta)  # no store-level marker yet
    with pytest.raises(StoreError, match=r"clients \[1\] have no completion marker"):
        mark_complete(path, clients=[0, 1])
    with pytest.raises(StoreError, match="incomplete"):
        open_feature_store(path, expect=meta)
    # a rewrite of a finished client clears its marker before any row lands
    mark_complete(path, clients=[0])
    reader = open_feature_store(path, expect=meta)
    open_client_writer(path, 0, rows=9, meta=meta)  # interrupted rewrite of client 0
    with pytest.raises(StoreError, match="no complete client 0"):
        reader.read_client(0)
    with pytest.raises(StoreError, match="no complete client 1"):
        reader.read_client(1)


def test_missing_or_foreign_store(tmp_path):
    with pytest.raises(StoreError, match="no feature store"):
        open_feature_store(tmp_path / "nope.zarr", expect=None)
    import zarr

    zarr.open_group(str(tmp_path / "other.zarr"), mode="w")
    with pytest.raises(StoreError, match="not an hpcfl eNTK feature store"):
        open_feature_store(tmp_path / "other.zarr", expect=None)


def test_meta_for_model_records_hashes():
    torch.manual_seed(0)
    model = build_model("mlp", (1, 28, 28), 10)
    meta = FeatureMeta.for_model(model, p=1000, seed=5)
    assert meta.num_params == 79_510 and meta.p == 1000 and len(meta.coords_hash) == 64
    assert meta.model_hash == model_hash(model)
    with torch.no_grad():
        model.fc1.weight[0, 0] += 1
    assert model_hash(model) != meta.model_hash, "hash ignores the weights"
    assert FeatureMeta.for_model(model, p=1000, seed=6).coords_hash != meta.coords_hash


def test_chunks_are_power_of_two_rows_under_32_mib():
    assert chunk_rows(100_000, 4) == 64
    assert chunk_rows(10**9, 4) == 1


def test_stores_from_before_the_head_was_recorded_read_as_the_kept_head(tmp_path):
    """Issue 16: eNTK stores written before ``head`` existed were taken through the kept C-output head,
    so they read back as head "keep" and never match today's default fresh 1-output head (they are
    recomputed, not silently reused); last-layer stores never went through a head and still match."""
    meta = _meta()
    legacy = {k: v for k, v in meta.to_attrs().items() if k != "head"}
    assert FeatureMeta.from_attrs(legacy).head == "keep"
    assert FeatureMeta.from_attrs(legacy).mismatches(meta) == ["head (store keep, requested fresh1)"]
    last = FeatureMeta(**{**meta.to_attrs(), "params": "last_layer", "logit": -1, "head": "-"})
    assert FeatureMeta.from_attrs({k: v for k, v in last.to_attrs().items() if k != "head"}) == last
    import zarr

    path = tmp_path / "old.zarr"
    create_feature_store(path, meta=meta)
    zarr.open_group(str(path), mode="r+").attrs["meta"] = legacy  # as the code before issue 16 wrote it
    with pytest.raises(StoreError, match=r"head \(store keep, requested fresh1\)"):
        create_feature_store(path, meta=meta)
