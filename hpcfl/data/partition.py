"""Federated partitions of a labelled train set: ``iid``, ``dir:ALPHA``, ``client-dir:ALPHA``,
``classes:C``, ``balanced-classes:C``, ``natural``.

Every partitioner is a pure function of (labels, spec, num_clients, seed): it draws from one
``np.random.default_rng(seed)`` in a fixed order, so the same inputs give identical partitions on
any machine, and returns one sorted int64 index tensor per client. The spec is parsed and checked
before any work, and every impossible request is a :class:`ConfigError` naming the problem and the
fix. Saving, loading, tabulating and plotting live in :mod:`hpcfl.data.partition_io` and are
re-exported here.

- ``iid``: a uniform random permutation cut into K nearly equal parts (sizes differ by ≤ 1).
- ``dir:ALPHA``: NIID-Bench's label-Dirichlet ("labeldir", Li et al., ICDE 2022): for each class,
  proportions over clients ~ Dir(α·1); clients already holding ≥ N/K samples get share 0, the rest
  are renormalised and the class is cut accordingly. The whole draw is repeated until every client
  holds ≥ ``min_size`` samples, at most :data:`MAX_DIRICHLET_TRIES` times. Smaller α = more skew.
- ``client-dir:ALPHA``: Hsu, Qi & Brown (2019)'s per-client label Dirichlet, the NTK-FL paper's
  setup: every client holds N/K samples (sizes differ by ≤ 1) and draws its class proportions
  q ~ Dir(α·1); its class counts are a multinomial draw of its size from q, and what a class can no
  longer supply is redrawn from q over the classes that still can. Clients are served in id
  order, so the last ones get what is left (the draw keeps every sample assigned).
- ``classes:C``: NIID-Bench's "#C" rule ("noniid-#label", Li et al., ICDE 2022, ``partition_data``
  in their ``utils.py``), the rule of the TCT and FedPVR papers. With P the classes present, client k
  first gets class ``k mod P``, then C−1 further distinct classes drawn uniformly (a draw already
  held is redrawn). Each class is shuffled and ``np.array_split`` among its holders in client order,
  so client sizes vary with how many holders their classes drew. NIID-Bench crashes when a class
  drew no holder (possible only with fewer clients than classes); here the class sets are redrawn,
  at most :data:`MAX_CLASS_SET_TRIES` times, and then it is a ConfigError naming the fix.
- ``balanced-classes:C``: client k holds classes ``(k·C + j) mod P`` for j < C, so the class slots go
  round-robin and every class is held by ⌊KC/P⌋ or ⌈KC/P⌉ clients; each class is shuffled and split
  evenly among its holders. The class layout is fixed (readable heatmaps); the seed decides which
  samples go where. (For C = 1 both rules give the same partition for the same seed.)
- ``natural``: the dataset's own writers (FEMNIST); the first ``num_clients`` writers in dataset
  order, unshuffled. Only with all writers is every sample assigned.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from hpcfl.data.partition_io import SavedPartition as SavedPartition
from hpcfl.data.partition_io import format_partition_table as format_partition_table
from hpcfl.data.partition_io import load_partition as load_partition
from hpcfl.data.partition_io import plot_partition_heatmap as plot_partition_heatmap
from hpcfl.data.partition_io import save_partition as save_partition
from hpcfl.errors import ConfigError, suggest

PARTITION_KINDS: tuple[str, ...] = ("iid", "dir", "client-dir", "classes", "balanced-classes", "natural")
SPEC_FORMS = (
    "iid, dir:ALPHA (e.g. dir:0.5), client-dir:ALPHA (e.g. client-dir:0.1), classes:C (e.g. classes:2), balanced-classes:C (e.g. balanced-classes:2), "
    "natural"
)
MAX_DIRICHLET_TRIES = 1000
# With fewer clients than classes a random draw can leave a class without a holder; the class sets
# are redrawn. 10,000 draws cost well under a second and make a failure of a coverable request rare
# (5 clients x 2 of 10 classes, the hardest case, succeeds per draw with p = 5!/9^5 ≈ 0.002).
MAX_CLASS_SET_TRIES = 10_000


def parse_partition_spec(spec: str) -> tuple[str, float | int | None]:
    """Split ``spec`` into (kind, parameter): ``("iid", None)``, ``("dir", α)``, ``("classes", C)``,
    ``("balanced-classes", C)``, ``("natural", None)``. Anything else is a ConfigError naming the
    problem and a valid form."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"empty partition spec; use one of: {SPEC_FORMS}")
    kind, sep, param = spec.strip().partition(":")
    kind, param = kind.strip().lower(), param.strip()
    if kind not in PARTITION_KINDS:
        raise ConfigError(
            f"unknown partition kind {kind!r}{suggest(kind, PARTITION_KINDS)}; use one of: {SPEC_FORMS}"
        )
    if kind in ("iid", "natural"):
        if sep:
            raise ConfigError(f"partition {spec!r}: {kind!r} takes no parameter; write just {kind!r}")
        return kind, None
    form = f"{kind}:ALPHA (e.g. {kind}:0.5)" if kind in ("dir", "client-dir") else f"{kind}:C (e.g. {kind}:2)"
    if not param:
        raise ConfigError(f"partition {spec!r} is missing its parameter; write {form}")
    if kind in ("dir", "client-dir"):
        try:
            alpha = float(param)
        except ValueError:
            raise ConfigError(f"partition {spec!r}: ALPHA {param!r} is not a number; write {form}") from None
        if not math.isfinite(alpha) or alpha <= 0:
            raise ConfigError(
                f"partition {spec!r}: ALPHA must be a positive finite number (smaller = more skewed); write {form}"
            )
        return kind, alpha
    try:
        classes = int(param)
    except ValueError:
        raise ConfigError(f"partition {spec!r}: C {param!r} is not a whole number; write {form}") from None
    if classes < 1:
        raise ConfigError(f"partition {spec!r}: C (classes per client) must be >= 1; write {form}")
    return kind, classes


def _as_label_array(labels: torch.Tensor | np.ndarray | Sequence[int], num_classes: int) -> np.ndarray:
    y = labels.detach().cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    if y.ndim != 1 or (y.size and not np.issubdtype(y.dtype, np.integer)):
        raise ConfigError(f"labels must be a 1-D integer tensor, got shape {tuple(y.shape)} dtype {y.dtype}")
    y = y.astype(np.int64, copy=False)
    if y.size and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise ConfigError(
            f"labels range over {int(y.min())}..{int(y.max())} but num_classes is {num_classes}; "
            "pass the dataset's num_classes"
        )
    return y


def _split_by_owner(owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Indices grouped by owner; a stable sort keeps each group in ascending index order."""
    order = np.argsort(owner, kind="stable")
    sizes = np.bincount(owner, minlength=num_clients)
    return np.split(order, np.cumsum(sizes)[:-1])


def _iid(y: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    return np.array_split(rng.permutation(y.size), num_clients)


def _dirichlet(
    y: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int,
    spec: str,
    num_classes: int,
) -> list[np.ndarray]:
    n = y.size
    if min_size * num_clients > n:
        raise ConfigError(
            f"partition {spec!r}: {n} samples cannot give each of {num_clients} clients >= {min_size}; "
            "use fewer clients or a smaller --min-size"
        )
    by_class = [np.flatnonzero(y == c) for c in range(num_classes)]
    cap = n / num_clients
    clients = np.arange(num_clients)
    owner = np.empty(n, dtype=np.int64)
    for _ in range(MAX_DIRICHLET_TRIES):
        sizes = np.zeros(num_clients, dtype=np.int64)
        for members in by_class:
            if members.size == 0:
                continue
            idx = rng.permutation(members)
            p = rng.dirichlet(np.full(num_clients, alpha))
            p = np.where(sizes < cap, p, 0.0)  # clients already at N/K take no more
            total = p.sum()
            if not (np.isfinite(total) and total > 0):  # all mass on full clients (α → 0 limit)
                p = np.zeros(num_clients)
                p[rng.choice(np.flatnonzero(sizes < cap))] = 1.0
                total = 1.0
            # Rounded cut points (NIID-Bench floors them, which lets float error hand a client whose
            # share was zeroed a stray sample); the last cut is exactly the class size.
            cuts = np.rint(np.cumsum(p / total) * idx.size).astype(np.int64)
            cuts[-1] = idx.size
            counts = np.diff(cuts, prepend=0)
            owner[idx] = np.repeat(clients, counts)
            sizes += counts
        if sizes.min() >= min_size:
            return _split_by_owner(owner, num_clients)
    raise ConfigError(
        f"partition {spec!r}: no draw in {MAX_DIRICHLET_TRIES} gave each of {num_clients} clients >= {min_size} "
        "samples; use a larger ALPHA, fewer clients, or a smaller --min-size"
    )


def _client_dirichlet(
    y: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """Hsu et al. (2019): each client draws q ~ Dir(α) and takes its N/K samples by class ∝ q."""
    present = np.unique(y)
    pools = [rng.permutation(np.flatnonzero(y == c)) for c in present]
    left = np.array([p.size for p in pools], dtype=np.int64)
    taken = np.zeros(present.size, dtype=np.int64)
    sizes = [part.size for part in np.array_split(np.arange(y.size), num_clients)]
    parts = []
    for size in sizes:
        q = rng.dirichlet(np.full(present.size, alpha))
        counts = np.zeros(present.size, dtype=np.int64)
        need = size
        while need > 0:
            w = np.where(left - counts > 0, q, 0.0)
            if not w.sum() > 0:  # q's classes are exhausted: fall back to what is left, uniformly
                w = (left - counts > 0).astype(np.float64)
            draw = rng.multinomial(need, w / w.sum())
            counts += np.minimum(draw, left - counts)
            need = size - int(counts.sum())
        parts.append(np.concatenate([pools[c][taken[c] : taken[c] + counts[c]] for c in range(present.size)]))
        taken += counts
        left -= counts
    return parts


def _check_classes(
    y: np.ndarray, num_clients: int, per_client: int, spec: str, num_classes: int
) -> np.ndarray:
    """What both class rules rule out; returns the classes present (sorted)."""
    kind = spec.strip().partition(":")[0].strip().lower()
    if per_client > num_classes:
        raise ConfigError(
            f"partition {spec!r}: C={per_client} exceeds the dataset's {num_classes} classes; "
            f"use {kind}:{num_classes} or fewer"
        )
    present = np.unique(y)
    if per_client > present.size:
        raise ConfigError(
            f"partition {spec!r}: only {present.size} of the {num_classes} classes occur in these labels; "
            f"use {kind}:{present.size} or fewer"
        )
    if per_client * num_clients < present.size:
        need = math.ceil(present.size / num_clients)
        raise ConfigError(
            f"partition {spec!r} is not coverable with {num_clients} clients: {num_clients}x{per_client} class slots "
            f"< {present.size} classes, so some class would be held by nobody; use {kind}:{need} or more, "
            f"or at least {math.ceil(present.size / per_client)} clients"
        )
    return present


def _niid_class_sets(
    num_clients: int, per_client: int, num_present: int, rng: np.random.Generator, spec: str
) -> list[list[int]]:
    """NIID-Bench's "#C" class sets (slots into the present classes): client k gets ``k mod P`` and
    then C−1 further distinct slots drawn uniformly, a repeat being redrawn. The whole draw is
    repeated until every slot has a holder (NIID-Bench instead fails in ``np.array_split``)."""
    for _ in range(MAX_CLASS_SET_TRIES):
        sets: list[list[int]] = []
        for k in range(num_clients):
            current = [k % num_present]
            while len(current) < per_client:
                slot = int(rng.integers(num_present))
                if slot not in current:
                    current.append(slot)
            sets.append(current)
        held = np.zeros(num_present, dtype=bool)
        for current in sets:
            held[current] = True
        if held.all():
            return sets
    raise ConfigError(
        f"partition {spec!r}: no draw in {MAX_CLASS_SET_TRIES} gave every one of the {num_present} classes a holder "
        f"with {num_clients} clients; use at least {num_present} clients (then every class has one), a larger C, "
        f"or balanced-classes:{per_client} (round-robin, always covers)"
    )


def _classes(
    y: np.ndarray,
    num_clients: int,
    per_client: int,
    rng: np.random.Generator,
    spec: str,
    num_classes: int,
    *,
    balanced: bool,
) -> list[np.ndarray]:
    present = _check_classes(y, num_clients, per_client, spec, num_classes)
    holders: list[list[int]] = [[] for _ in range(present.size)]
    if balanced:
        for k in range(num_clients):
            for j in range(per_client):
                holders[(k * per_client + j) % present.size].append(k)
    else:
        for k, current in enumerate(_niid_class_sets(num_clients, per_client, present.size, rng, spec)):
            for slot in current:
                holders[slot].append(k)  # client order, as NIID-Bench hands out the splits
    owner = np.empty(y.size, dtype=np.int64)
    for slot, cls in enumerate(present):
        idx = rng.permutation(np.flatnonzero(y == cls))
        h = len(holders[slot])
        if idx.size < h:
            raise ConfigError(
                f"partition {spec!r}: class {int(cls)} has {idx.size} samples but {h} clients hold it; "
                "use fewer clients"
            )
        # np.array_split's sizes: the first idx.size % h holders get one more.
        counts = np.full(h, idx.size // h, dtype=np.int64)
        counts[: idx.size % h] += 1
        owner[idx] = np.repeat(holders[slot], counts)
    return _split_by_owner(owner, num_clients)


def _natural(n: int, num_clients: int, natural: Sequence[torch.Tensor] | None) -> list[np.ndarray]:
    if natural is None:
        raise ConfigError(
            "partition 'natural' needs a dataset with writers (e.g. femnist) and this one has none; "
            "use iid, dir:ALPHA, classes:C or balanced-classes:C"
        )
    if num_clients > len(natural):
        raise ConfigError(
            f"partition 'natural': {num_clients} clients requested but the dataset has {len(natural)} writers; "
            f"use at most {len(natural)} clients"
        )
    parts = [np.asarray(torch.as_tensor(natural[k]).cpu(), dtype=np.int64) for k in range(num_clients)]
    for k, part in enumerate(parts):
        if part.size and (int(part.min()) < 0 or int(part.max()) >= n):
            raise ConfigError(f"partition 'natural': writer {k} indexes outside the {n} labels given")
    return parts


def partition(
    labels: torch.Tensor,
    spec: str,
    num_clients: int,
    *,
    seed: int,
    num_classes: int,
    natural: list[torch.Tensor] | None = None,
    min_size: int = 10,
) -> list[torch.Tensor]:
    """Split the samples of ``labels`` over ``num_clients`` clients as ``spec`` says.

    Returns one sorted int64 index tensor per client. ``natural`` holds a dataset's per-writer
    index tensors (``Dataset.natural_clients``) for the ``natural`` kind; ``min_size`` is the
    smallest client ``dir:ALPHA`` accepts. Raises ConfigError for every impossible request.
    """
    kind, param = parse_partition_spec(spec)
    if isinstance(num_clients, bool) or not isinstance(num_clients, int | np.integer) or num_clients < 1:
        raise ConfigError(f"the number of clients must be a whole number >= 1, got {num_clients!r}")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ConfigError(f"the partition seed must be a non-negative integer, got {seed!r}")
    if min_size < 0:
        raise ConfigError(f"--min-size must be >= 0, got {min_size}")
    num_clients = int(num_clients)
    y = _as_label_array(labels, num_classes)
    if kind == "natural":
        parts = _natural(y.size, num_clients, natural)
    else:
        if num_clients > y.size:
            raise ConfigError(
                f"{num_clients} clients but only {y.size} samples: every client needs at least one; "
                f"use at most {y.size} clients"
            )
        rng = np.random.default_rng(int(seed))
        if kind == "iid":
            parts = _iid(y, num_clients, rng)
        elif kind == "dir":
            assert isinstance(param, float)
            parts = _dirichlet(y, num_clients, param, rng, min_size, spec, num_classes)
        elif kind == "client-dir":
            assert isinstance(param, float)
            parts = _client_dirichlet(y, num_clients, param, rng)
        else:
            assert isinstance(param, int)
            parts = _classes(
                y, num_clients, param, rng, spec, num_classes, balanced=kind == "balanced-classes"
            )
    return [torch.from_numpy(np.sort(p).astype(np.int64)) for p in parts]  # host: index bookkeeping


def partition_stats(labels: torch.Tensor, parts: Sequence[torch.Tensor], num_classes: int) -> np.ndarray:
    """Per-client class counts, an int64 array (clients, classes)."""
    y = _as_label_array(labels, num_classes)
    counts = np.zeros((len(parts), num_classes), dtype=np.int64)
    for k, part in enumerate(parts):
        idx = np.asarray(torch.as_tensor(part).cpu(), dtype=np.int64)
        counts[k] = np.bincount(y[idx], minlength=num_classes)
    return counts
