"""The per-layer cost model of the fused eNTK path: for a Linear or Conv2d weight whose kept
coordinates are not all of it, which :data:`Form` — the gather kernels or materialising the layer's
per-sample gradients with one batched product, then picking — is cheaper, as a pure function of the
batch, the layer's dims, its kept coordinates and the device type (:func:`choose_layer_form`, used
by :mod:`hpcfl.entk.layers`); and the least-squares fit of its constants to measured times
(:func:`fit_constants`, used by ``benchmarks/entk_layer_costs.py``).

Each form's time is Σ constant × count (:func:`form_features`), linear in the constants, so the
constants of a device are a non-negative least-squares fit on per-layer timings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from hpcfl.entk.cost_file import COST_TERMS as COST_TERMS  # where they live; named here for callers
from hpcfl.entk.cost_file import fitted_file as fitted_file
from hpcfl.entk.settings import COSTS_ENV as COSTS_ENV
from hpcfl.entk.settings import active, costs_label

Form = Literal["full", "gather", "materialise", "native"]
"""How a Linear/Conv2d weight's kept coordinates are formed (see the module docstring; ``"native"``:
the compiled CPU kernel of :mod:`hpcfl.entk.native`, used wherever it is usable, outside the model)."""

FORMS: tuple[str, ...] = ("gather", "materialise")
"""The forms the cost model weighs (``"full"`` is not a choice: p = P always writes whole)."""

NATIVE: Form = "native"
FORCEABLE: tuple[str, ...] = (*FORMS, NATIVE)
"""The forms a plan's ``form=`` may force (tests, ``benchmarks/entk_layer_costs.py``)."""

DENSE_TILE_ELEMS = 1 << 20
"""Elements of the per-tile temporaries of the materialise path on the CPU (unfolded input +
per-sample gradient, 4 MiB in float32): each tile is unfolded, multiplied and gathered while it is
in cache (simplecnn conv3, 256 samples, 1 thread: bmm + gather 17 ms in tiles of 8-32 samples, 25 ms
in one (256, 128, 576) block; unfolding the whole batch once instead of per tile was ~15% slower
overall), and a fresh 75 MB buffer per batch would cost more in page faults (~25 ms) than the bmm."""

CUDA_TILE_ELEMS = 1 << 26
"""The same bound on a GPU (256 MiB in float32): there a tile is not kept in a cache but is one
launch of each kernel, so tiles are as large as memory comfortably allows (simplecnn conv2 at batch
256 is one tile, not the CPU bound's 64 tiles of 4 samples)."""

# Cost model, in nanoseconds for one layer's weight over a batch of B samples: each form's cost is
# Σ constant × feature (:func:`form_features`), linear in the constants so that they can be fitted
# by least squares on measured times (benchmarks/entk_layer_costs.py).
#
# CPU constants fitted on the 2-core dev box (1 thread, MKL) over every conv layer of simplecnn,
# resnet8, resnet18 and vgg11 (p = 1e5 / 2e4): the materialise path costs ~0.03 ns per bmm MAC plus
# ~0.3 ns per element of unfolded input and per-sample gradient streamed through cache, plus ~1 ns
# per picked element; one term of the gather-and-reduce costs ~1 ns (0.7-1.4 ns measured on
# vgg11/resnet-shaped layers, 1 thread, with its temporaries reused within a call; 2-3.4 ns before,
# when each chunk page-faulted in fresh ones). Examples (ms, materialise vs gather): simplecnn
# conv3, 28% of its weights kept, 256 samples: 18 vs 79; resnet8 layer3.0.conv2, 25% kept, 128
# samples: 13 vs 53; a vgg11 512→512 conv at 4×4, 1% kept, 32 samples: gather 16 ms. Where the
# model's two estimates are within ~20% the measured times were too. No launch or store term: the
# CPU choice is the one these constants made before the terms existed.
CPU_COSTS: dict[str, float] = {"launch": 0.0, "mac": 0.03, "mem": 0.3, "pick": 1.0, "term": 1.0, "store": 0.0}

CUDA_COSTS: dict[str, float] = {
    "launch": 6892.0,
    "mac": 6.441e-05,
    "mem": 0.001572,
    "pick": 0.00845,
    "term": 0.001973,
    "store": 0.004891,
}
"""Fitted on one NVIDIA H200 (PyTorch 2.11, Triton 3.6; 2026-11-27, ``benchmarks/entk_layer_costs.py
--device cuda``, batch 256, p = 1e5, results in ``benchmarks/results/entk_layer_costs_cuda.*``) over
74 (layer, form) rows of simplecnn, resnet18-GN and vgg11 (resnet8 keeps every weight whole at
p = 1e5). With them the model picks the faster form on 5/5, 21/21 and 11/11 layers (the estimates
before the fit: 4/5 — simplecnn's conv1, 0.024 ms by the gathers, 0.190 ms materialised). A launch
costs ~7 µs, a gathered term ~2 ps and a bmm MAC ~0.06 ps: on this GPU the gathers win every layer but
simplecnn's conv2 and conv3 (L = 49 and 16 output positions over most of a small weight). Whole
batches move less than the layer sums suggest: the layers' forms are 0.44 ms of simplecnn's ~2.3-2.9
ms fused batch, the rest is the forward/backward and host-side launch overhead (the kernel profile's
device time of a fused batch is about plain training's), and two policies that do the same work timed
up to 25% apart (resnet8, every weight whole)."""

_COSTS = {"cpu": CPU_COSTS, "cuda": CUDA_COSTS}

NATIVE_TERMS: tuple[str, ...] = ("native_mac", "native_vec", "native_unfold")
"""The native form's constants (:func:`native_features`): a multiply-add of its register blocks
(padding included), a 16-lane vector compressed and stored, an element of the unfolded input."""

NATIVE_COSTS: dict[str, float] = {"native_mac": 0.021, "native_vec": 1.05, "native_unfold": 0.52}
"""ns per count of the native CPU kernel (:mod:`hpcfl.entk.native`), on the scale of :data:`CPU_COSTS`
so that a plan weighs the native form's estimate against the torch forms'. Fitted (non-negative
least squares on relative error, ``benchmarks/entk_layer_costs.py``'s ``native_fit``) on the 2-core
AVX-512 EPYC, 1 thread, batch 256, over the 31 layers of simplecnn and vgg11 at p = 1e5 and
simplecnn and resnet8 at p = 2e4 (``benchmarks/results/entk_layer_costs_cpu_p1e5.*``, ``_p2e4.*``;
the joint fit over both files: 0.0214, 1.06, 0.54). Against the torch form the built-in constants
pick, the faster of the two is chosen on 25 of 31 layers: three vgg11 convs stay on the gathers
though the kernel is 1.2-2.3× faster there (the torch constants under-price those gathers, as
before), and the two it takes wrongly lose 1.7 ms and 0.03 ms (resnet8 layer2.0.conv2 at p = 2e4:
23.9 native, 22.2 materialised). Measured at p = 1e5: simplecnn fc1 7.2 ms (gathers 16.5), conv3
10.1 (materialised 14.2), conv2 7.8 (8.7)."""


def fitted_record() -> dict[str, Any] | None:
    """The fitted constants in force (:func:`hpcfl.entk.settings.active`: the run's ``entk.costs``
    or ``$HPCFL_ENTK_COSTS``), for a run's record (None when none): the file, the device type it
    was fitted on and its constants. They choose each layer's eNTK form, and the forms round
    differently, so TCT's stage 2 depends on them."""
    settings = active()
    if not settings.costs:
        return None
    device_type, fitted = fitted_file(settings.costs, costs_label(settings))
    return {"file": settings.costs, "device_type": device_type, "fitted": fitted}


def constants(device_type: str) -> dict[str, float]:
    """The cost constants for a device type: :data:`CUDA_COSTS` or :data:`CPU_COSTS`, or the fitted
    ones of the file in force (``entk.costs`` / ``$HPCFL_ENTK_COSTS``) where it was fitted on that
    device type."""
    key = "cuda" if device_type == "cuda" else "cpu"
    settings = active()
    if settings.costs:
        fitted_type, fitted = fitted_file(settings.costs, costs_label(settings))
        if fitted_type == key:
            return fitted
    return _COSTS[key]


def materialise_tile(batch: int, per_sample: int, device_type: str) -> int:
    """Samples per tile of the materialise path: its temporaries (``per_sample`` elements a sample)
    stay within :data:`DENSE_TILE_ELEMS` on the CPU and :data:`CUDA_TILE_ELEMS` on CUDA."""
    bound = CUDA_TILE_ELEMS if device_type == "cuda" else DENSE_TILE_ELEMS
    return max(1, min(batch, bound // max(1, per_sample)))


def form_features(
    form: str,
    *,
    batch: int,
    n: int,
    out_channels: int,
    k: int,
    unfold_rows: int,
    length: int,
    device_type: str,
) -> dict[str, float]:
    """The counts each cost constant multiplies for one form of one layer's weight over a batch.

    Args:
        form: ``"gather"`` or ``"materialise"``.
        batch: B samples; n: kept coordinates of the weight.
        out_channels, k: the weight as an (O, K) matrix (Linear: O × I; Conv2d: O × (C/G)·kh·kw).
        unfold_rows: rows of the unfolded input per sample (Conv2d C·kh·kw; 0 for a Linear, whose
            input needs no unfolding).
        length: L output positions (1 for a Linear).
        device_type: ``"cuda"`` or anything else (the CPU), for the tile size.

    ``gather``: one launch, n·L multiply-add terms and n stores per sample. ``materialise``: per
    tile an unfold (conv only), a batched product and a pick (launches), O·K·L MACs per sample, the
    unfolded input and the per-sample gradient streamed once (mem), n picked entries.
    """
    if form == "gather":
        return {"launch": 1.0, "term": float(batch * n * length), "store": float(batch * n)}
    if form != "materialise":
        raise ValueError(f"unknown form {form!r} (one of {FORMS})")
    per_sample = unfold_rows * length + out_channels * k
    tiles = -(-batch // materialise_tile(batch, per_sample, device_type))
    return {
        "launch": float(tiles * (3 if unfold_rows else 2)),
        "mac": float(batch * out_channels * k * length),
        "mem": float(batch * per_sample),
        "pick": float(batch * n),
    }


def native_features(
    *, batch: int, out_channels: int, k: int, unfold_rows: int, length: int
) -> dict[str, float]:
    """The counts :data:`NATIVE_COSTS` multiply for the native form of one layer's weight (the
    arguments as :func:`form_features`'). A Linear on (B, I) inputs (L = 1, nothing unfolded) is a
    scaled copy of the input per row, 16 columns a vector; otherwise the kernel runs blocks of 4 rows
    by 64 columns over the L positions (rows and columns padded up to whole blocks)."""
    lanes = -(-k // 16)
    if length == 1 and not unfold_rows:
        return {"native_mac": 0.0, "native_vec": float(batch * out_channels * lanes), "native_unfold": 0.0}
    rows, cols = -(-out_channels // 4) * 4, -(-k // 64) * 64
    return {
        "native_mac": float(batch * rows * cols * length),
        "native_vec": float(batch * rows * cols // 16),
        "native_unfold": float(batch * unfold_rows * length),
    }


def native_cost(*, batch: int, out_channels: int, k: int, unfold_rows: int, length: int) -> float:
    """The native form's estimated time (ns) for one layer's weight over a batch."""
    counts = native_features(
        batch=batch, out_channels=out_channels, k=k, unfold_rows=unfold_rows, length=length
    )
    return sum(NATIVE_COSTS[name] * count for name, count in counts.items())


def layer_form_costs(
    *, batch: int, n: int, out_channels: int, k: int, unfold_rows: int, length: int, device_type: str
) -> dict[str, float]:
    """Each form's estimated time (ns) for one layer's weight over a batch (see :func:`form_features`)."""
    consts = constants(device_type)
    dims = dict(
        batch=batch,
        n=n,
        out_channels=out_channels,
        k=k,
        unfold_rows=unfold_rows,
        length=length,
        device_type=device_type,
    )
    return {
        form: sum(consts[name] * count for name, count in form_features(form, **dims).items())
        for form in FORMS
    }


def choose_layer_form(
    *,
    batch: int,
    n: int,
    out_channels: int,
    k: int,
    unfold_rows: int,
    length: int,
    device_type: str,
    native: bool = False,
) -> Form:
    """``"materialise"`` where the cost model (:func:`layer_form_costs`) makes it strictly cheaper,
    else ``"gather"`` — a pure function of the batch, the layer's dims, its kept coordinates and the
    device type; with ``native`` (the kernel is usable for this layer), ``"native"`` where
    :func:`native_cost` is below both."""
    cost = layer_form_costs(
        batch=batch,
        n=n,
        out_channels=out_channels,
        k=k,
        unfold_rows=unfold_rows,
        length=length,
        device_type=device_type,
    )
    best: Form = "materialise" if cost["materialise"] < cost["gather"] else "gather"
    if (
        native
        and native_cost(batch=batch, out_channels=out_channels, k=k, unfold_rows=unfold_rows, length=length)
        < cost[best]
    ):
        return NATIVE  # type: ignore[return-value]
    return best


def choose_whole_form(
    *, batch: int, out_channels: int, k: int, unfold_rows: int, length: int, device_type: str, native: bool
) -> Form:
    """For a conv weight kept whole (p = P): ``"full"`` (its per-sample gradients materialised and
    written in place) or, where the native kernel is usable (``native``) and :func:`native_cost` is
    below the materialise estimate, ``"native"`` (every lane kept: the compress is a plain store)."""
    if not native:
        return "full"
    shape = dict(batch=batch, out_channels=out_channels, k=k, unfold_rows=unfold_rows, length=length)
    whole = layer_form_costs(n=out_channels * k, device_type=device_type, **shape)["materialise"]
    return NATIVE if native_cost(**shape) < whole else "full"


def fit_constants(
    features: Sequence[dict[str, float]], times_ns: Sequence[float], *, terms: Sequence[str] = COST_TERMS
) -> dict[str, float]:
    """Non-negative least-squares constants (ns per count) for measured times.

    Each row (one form of one layer, its counts from :func:`form_features` and its measured time)
    is weighted by 1/time, so the fit minimises relative errors: the small layers, where a launch
    or two decide the form, count as much as the large ones. Constants a row set does not
    determine (a count that is zero in every row) come back 0. Lawson-Hanson active-set NNLS.

    Raises:
        ValueError: no rows, a length mismatch, or a time that is not positive.
    """
    if not features or len(features) != len(times_ns):
        raise ValueError(f"need as many feature rows as times, got {len(features)} and {len(times_ns)}")
    t = np.asarray(times_ns, dtype=np.float64)
    if not np.all(t > 0):
        raise ValueError("measured times must be positive")
    a = np.array([[row.get(name, 0.0) for name in terms] for row in features], dtype=np.float64) / t[:, None]
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    x = _nnls(a / scale, np.ones_like(t)) / scale
    return {name: float(v) for name, v in zip(terms, x, strict=True)}


def _nnls(a: np.ndarray, b: np.ndarray, *, max_iter: int = 200) -> np.ndarray:
    """argmin ‖Ax − b‖ subject to x ≥ 0 (Lawson & Hanson 1974, Algorithm NNLS)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 1e-12 * max(1.0, float(np.abs(a).max()))
    for _ in range(max_iter):
        w = a.T @ (b - a @ x)
        if passive.all() or w[~passive].max(initial=-np.inf) <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if z[passive].min() > 0:
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x
