"""Stage-2 inputs: per-client features of the convexified model, computed once into Zarr stores.

``features.zarr`` holds one array per training client, written by the rank that owns the client;
``features_test.zarr`` holds the test set cut into ``num_clients`` fixed shards (rank r owns
shards s with s mod R = r), so the stores do not depend on the number of ranks. A store that is
complete and matches the model / seed / p / logit / scope / dtype is reused as it is, which is
what makes ``hpcfl tct-stage2`` and resumed runs skip the extraction.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from hpcfl.comm.base import Communicator
from hpcfl.config import Stage2Section
from hpcfl.errors import StoreError
from hpcfl.features import (
    FeatureMeta,
    create_feature_store,
    mark_complete,
    open_client_writer,
    open_feature_store,
)
from hpcfl.features.meta import model_hash
from hpcfl.training.evaluate import shard_range

EXTRACT_ROWS = 2048  # samples per extraction call: bounds host memory to 2048·p floats


def feature_meta(model: nn.Module, cfg2: Stage2Section) -> FeatureMeta:
    """What the stage-2 features are computed from (checked against any existing store)."""
    if cfg2.features == "last_layer":
        width = model.classifier.in_features  # type: ignore[union-attr]
        return FeatureMeta(
            model_hash=model_hash(model),
            seed=cfg2.seed,
            p=width,
            logit=-1,
            params="last_layer",
            dtype=cfg2.dtype,
            coords_hash="-",
            num_params=width,
        )
    from hpcfl.entk import num_params

    total = num_params(model, cfg2.params)
    return FeatureMeta.for_model(
        model, p=min(cfg2.p, total), seed=cfg2.seed, logit=cfg2.logit, params=cfg2.params, dtype=cfg2.dtype
    )


@torch.no_grad()
def _last_layer(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    device = next(model.parameters()).device
    return model.features(x.to(device)).flatten(1)  # type: ignore[operator]


def compute_features(
    model: nn.Module, x: torch.Tensor, cfg2: Stage2Section, meta: FeatureMeta
) -> Iterator[torch.Tensor]:
    """Features of ``x`` in blocks of :data:`EXTRACT_ROWS` rows (model must already be convexified)."""
    for start in range(0, x.shape[0], EXTRACT_ROWS):
        xb = x[start : start + EXTRACT_ROWS]
        if cfg2.features == "last_layer":
            yield _last_layer(model, xb).to(meta.torch_dtype).cpu()
        else:
            from hpcfl.entk import entk_features

            yield entk_features(
                model,
                xb,
                p=meta.p,
                seed=cfg2.seed,
                logit=cfg2.logit,
                params=cfg2.params,
                method=cfg2.method,
                batch_size=cfg2.batch_size,
                dtype=meta.torch_dtype,
            ).cpu()


def test_shards(n_test: int, num_shards: int, comm: Communicator) -> dict[int, tuple[int, int]]:
    """The test-set shards this rank extracts and evaluates: {shard: (start, stop)}."""
    return {s: shard_range(n_test, s, num_shards) for s in range(num_shards) if s % comm.size == comm.rank}


def _is_complete(path: Path, meta: FeatureMeta) -> bool:
    try:
        open_feature_store(path, expect=meta)
    except StoreError:
        return False
    return True


def ensure_store(
    path: Path,
    meta: FeatureMeta,
    items: dict[int, tuple[torch.Tensor, torch.Tensor]],
    all_ids: list[int],
    model: nn.Module,
    cfg2: Stage2Section,
    comm: Communicator,
) -> None:
    """Make ``path`` a complete store of ``meta`` holding ``items`` ({id: (x, labels)}) of every rank.

    A complete matching store is reused. Otherwise rank 0 (re)creates it — a store of other
    settings is replaced, since the run's config decides — every rank writes its own items, and
    rank 0 marks it complete after a barrier.
    """
    complete = comm.bcast(_is_complete(path, meta) if comm.rank == 0 else None)
    if complete:
        return
    if comm.rank == 0:
        try:
            create_feature_store(path, meta=meta)
        except StoreError:
            create_feature_store(path, meta=meta, overwrite=True)
    comm.barrier()
    for k, (x, labels) in items.items():
        writer = open_client_writer(path, k, rows=int(x.shape[0]), meta=meta)
        start = 0
        for block in compute_features(model, x, cfg2, meta):
            writer.write(start, block)
            start += block.shape[0]
        writer.finish(labels.cpu())
    comm.barrier()
    if comm.rank == 0:
        mark_complete(path, clients=all_ids)
    comm.barrier()
