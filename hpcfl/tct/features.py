"""Stage-2 inputs: per-client features of the convexified model, computed once into Zarr stores.

``features.zarr`` holds one array per training client, written by the rank that owns the client;
``features_test.zarr`` holds the test set cut into ``num_clients`` fixed shards (rank r owns
shards s with s mod R = r), so the stores do not depend on the number of ranks. With
``client_eval``, ``features_heldout.zarr`` holds every client's held-out share (issue 28), written
by the rank that owns the client, like its training features. A store that is
complete and matches the model / seed / p / head / logit / scope / dtype is reused as it is, which
is what makes ``hpcfl tct-stage2`` and resumed runs skip the extraction.

The features are taken of :func:`convexified_model`: a copy of the stage-1 model whose classifier
is a fresh seeded 1-output layer (``stage2.head: fresh1``, TCT's public code), or, in the legacy
``stage2.head: keep`` form, the C-output classifier re-initialised and differentiated at
``stage2.logit``. The head is part of the store's meta (and of its model hash), so features of the
one form are never reused for the other.
"""

from __future__ import annotations

import copy
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from hpcfl.algorithms import FederationView
from hpcfl.algorithms.tct_params import Stage2Section
from hpcfl.comm.base import Communicator
from hpcfl.errors import StoppedError, StoreError
from hpcfl.features import (
    FeatureMeta,
    create_feature_store,
    mark_complete,
    open_client_writer,
    open_feature_store,
)
from hpcfl.features.meta import model_hash
from hpcfl.features.store import verify_client
from hpcfl.training.evaluate import shard_range
from hpcfl.units import format_bytes

HELD_OUT_STORE = "features_heldout.zarr"  # client_eval's held-out shares, one array per client
EXTRACT_ROWS = 2048  # samples per extraction call: bounds host memory to 2048·p floats


def convexified_model(model: nn.Module, cfg2: Stage2Section) -> nn.Module:
    """The model stage 2 takes features of: a copy of the stage-1 ``model`` (left unchanged) with its
    classifier replaced by a fresh ``nn.Linear(in, 1)`` drawn from ``stage2.seed`` (``head: fresh1``),
    or with the C-output classifier re-initialised from that seed (``head: keep``, and last-layer
    features, which do not read the classifier), in eval mode."""
    from hpcfl.models import reinit_last_layer, with_fresh_head

    if cfg2.features == "entk" and cfg2.head == "fresh1":
        out = with_fresh_head(model, cfg2.seed, outputs=1)
    else:
        out = copy.deepcopy(model)
        reinit_last_layer(out, cfg2.seed)
    return out.eval()


def differentiated_output(cfg2: Stage2Section) -> int:
    """The output of :func:`convexified_model` whose gradient is the feature: the fresh head's only one,
    or ``stage2.logit`` of the kept head."""
    return cfg2.logit if cfg2.head == "keep" else 0


def feature_meta(model: nn.Module, cfg2: Stage2Section) -> FeatureMeta:
    """What the stage-2 features are computed from (checked against any existing store); ``model``
    is the :func:`convexified_model`."""
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
            head="-",
        )
    from hpcfl.entk import num_params

    total = num_params(model, cfg2.params)
    return FeatureMeta.for_model(
        model,
        p=min(cfg2.p, total),
        seed=cfg2.seed,
        logit=differentiated_output(cfg2),
        params=cfg2.params,
        dtype=cfg2.dtype,
        head=cfg2.head,
    )


@torch.no_grad()
def _last_layer(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    device = next(model.parameters()).device
    return model.features(x.to(device)).flatten(1)  # type: ignore[operator]


def compute_features(
    model: nn.Module, x: torch.Tensor, cfg2: Stage2Section, meta: FeatureMeta
) -> Iterator[torch.Tensor]:
    """Features of ``x`` in blocks of :data:`EXTRACT_ROWS` rows (model must already be convexified),
    computed on the model's device and copied to the host block by block for the store (the only
    host transfer of the extraction: no flag or count is read per block)."""
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
                logit=differentiated_output(cfg2),
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


class ExtractionStopped(StoppedError):
    """A stop signal arrived during the feature extraction; finished clients stay in the store."""


def ensure_store(
    path: Path,
    meta: FeatureMeta,
    items: dict[int, tuple[torch.Tensor, torch.Tensor]],
    all_ids: list[int],
    model: nn.Module,
    cfg2: Stage2Section,
    comm: Communicator,
    *,
    stop: Callable[[], bool] | None = None,
) -> None:
    """Make ``path`` a complete store of ``meta`` holding ``items`` ({id: (x, labels)}) of every rank.

    A complete matching store is reused. Otherwise rank 0 (re)creates it — a store of other
    settings is replaced, since the run's config decides — every rank writes its own items that
    are not already done and intact (an interrupted extraction resumes where it stopped), and rank
    0 marks it complete after a barrier. ``stop()`` is asked between blocks of
    :data:`EXTRACT_ROWS` rows, so a stop signal is honoured within seconds: every rank leaves its
    loop, they agree at the barrier, and all raise :class:`ExtractionStopped`.
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
    stopped = False
    for k, (x, labels) in items.items():
        if verify_client(path, k):
            continue  # written and intact before an interruption
        if stop is not None and stop():
            stopped = True
            break
        writer = open_client_writer(path, k, rows=int(x.shape[0]), meta=meta)
        start = 0
        for block in compute_features(model, x, cfg2, meta):
            writer.write(start, block)
            start += block.shape[0]
            if stop is not None and stop() and start < x.shape[0]:
                stopped = True
                break
        if stopped:
            break
        writer.finish(labels.cpu())
    flag = comm.allreduce(torch.tensor([float(stopped)], dtype=torch.float64))  # host: a stop flag
    if bool(flag.item()):
        raise ExtractionStopped(
            f"stopped by a signal during the feature extraction into {path} (finished clients are kept)"
        )
    if comm.rank == 0:
        mark_complete(path, clients=all_ids)
    comm.barrier()


def check_features_fit(
    fed: FederationView, run_dir: Path, *, note: bool = True, free: int | None = None
) -> None:
    """Refuse (rank 0), before any row is written, feature stores the run directory's disk cannot hold.

    Needs only the built federation (model, partition, test set), so a run checks it before stage 1
    is trained and again before the extraction. The stores hold every training client's, test
    shard's and held-out share's rows; bytes already in them (an interrupted extraction) count as written. With ``note``
    it also says when ``stage2.p`` exceeds the parameter count and is clamped to it.
    """
    from hpcfl.entk import num_params

    cfg2, model = fed.algorithm.params.stage2, fed.flat.model  # type: ignore[attr-defined]  # TCTParams
    if cfg2.features == "last_layer":
        p = int(model.classifier.in_features)
    else:
        total = num_params(convexified_model(model, cfg2), cfg2.params)  # P of the head features go through
        p = min(cfg2.p, total)
        if note and cfg2.p > total:
            print(
                f"hpcfl: note: stage2.p={cfg2.p} exceeds the {total} parameters of the model; "
                f"using p={p} (every parameter)",
                file=sys.stderr,
            )
    rows = sum(int(part.numel()) for part in fed.parts) + int(fed.dataset.test.y.numel())
    rows += sum(int(share.numel()) for share in fed.client_eval or ())
    itemsize = torch.empty((), dtype=getattr(torch, cfg2.dtype)).element_size()  # host: a dtype's size
    need = rows * p * itemsize
    for name in ("features.zarr", "features_test.zarr", HELD_OUT_STORE):
        store = run_dir / name
        if store.is_dir():
            need -= sum(f.stat().st_size for f in store.rglob("*") if f.is_file())
    free = shutil.disk_usage(run_dir).free if free is None else free
    if need > free:
        raise StoreError(
            f"the eNTK features need {format_bytes(need)} ({rows} samples x p={p} in {cfg2.dtype}) but "
            f"{run_dir} has {format_bytes(free)} free; lower stage2.p, store stage2.dtype=float16 or bfloat16 "
            "(half the size), or use a --run-dir on a larger file system"
        )
