"""The memory guard: refuse an NTK-FL round that cannot fit, before any round runs.

Every rank holds the whole round after the allgather: the N·C·P Jacobian entries, or the
N·(Σ in + C·Σ out) numbers of their Linear-layer factors when they travel factored (twice: the
received buffers and the decoded tensors), the N × N kernel in float64 three times (this rank's
blocks, the reduced sum, and the eigenvectors of the MSE evolution or the copy in the model's dtype
the cross-entropy evolution multiplies with) and the Ψ × P candidate updates in float64 twice (rank
0's and the shared sum). The estimate uses the round's largest possible N (the largest clients).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hpcfl.errors import ConfigError


@dataclass(frozen=True)
class RoundShape:
    """What a round's memory depends on."""

    samples: int  # N, the round's rows (after subsampling)
    outputs: int  # C
    params: int  # P
    grid: int  # Ψ
    itemsize: int = 4  # bytes per Jacobian entry
    per_sample: int | None = None  # numbers per sample when factored (None: dense, C·P)


def round_memory_bytes(shape: RoundShape) -> int:
    """Peak bytes one rank needs for a round of this shape (see the module docstring)."""
    N, C, P = shape.samples, shape.outputs, shape.params
    per_sample = C * P if shape.per_sample is None else shape.per_sample
    return 2 * N * per_sample * shape.itemsize + 3 * N * N * 8 + 2 * shape.grid * P * 8


def largest_round(sizes: Sequence[int], per_round: int, beta: float = 1.0) -> int:
    """N of the round made of the ``per_round`` largest clients, each keeping ⌈β·n⌉ samples."""
    top = sorted(sizes, reverse=True)[:per_round]
    return sum(max(1, math.ceil(beta * n)) for n in top)


def check_round_memory(
    algorithm: str,
    shape: RoundShape,
    budget: int,
    *,
    sizes: Sequence[int],
    per_round: int,
    beta: float,
    input_dim: int,
    first_layer: tuple[int, int] | None,
) -> None:
    """Raise one-line :class:`ConfigError` when a round of ``shape`` needs more than ``budget`` bytes.

    The message names what would fit: a smaller ``params.beta`` (CP-NTK-FL's subsampling), a
    ``params.projection_dim`` (d₁′: ``first_layer`` = (a, b) when P(d₁′) = a·d₁′ + b, e.g. the MLP's
    100 hidden units per input), and a smaller ``clients_per_round``.
    """
    need = round_memory_bytes(shape)
    if need <= budget:
        return
    options = []
    b = beta
    while b > 0.01 and round_memory_bytes(_with(shape, largest_round(sizes, per_round, b))) > budget:
        b = round(b - 0.05, 2) if b > 0.1 else round(b - 0.01, 2)
    if b > 0.01:
        options.append(f"params.beta: {b:g}")
    if first_layer is not None:
        per_input, rest = first_layer
        d = input_dim
        while d > 1 and round_memory_bytes(_with(shape, shape.samples, rest + per_input * d)) > budget:
            d = d // 2
        if d > 1:
            options.append(f"params.projection_dim: {d}")
    m = per_round
    while m > 1 and round_memory_bytes(_with(shape, largest_round(sizes, m, beta))) > budget:
        m -= 1
    if round_memory_bytes(_with(shape, largest_round(sizes, m, beta))) <= budget:
        options.append(f"clients_per_round: {m}")
    fix = " or ".join(options) if options else "a smaller model"
    raise ConfigError(
        f"{algorithm}: a round needs ~{need / 2**30:.1f} GiB per rank (N={shape.samples} samples × "
        f"C={shape.outputs} outputs × P={shape.params} parameters of Jacobians, and the N×N kernel) "
        f"but {budget / 2**30:.1f} GiB is available; set {fix}"
        + ("" if algorithm == "cp-ntkfl" or not options[:-1] else " (beta/projection_dim: use cp-ntkfl)")
    )


def _with(shape: RoundShape, samples: int, params: int | None = None) -> RoundShape:
    return RoundShape(
        samples,
        shape.outputs,
        shape.params if params is None else params,
        shape.grid,
        shape.itemsize,
        shape.per_sample,
    )
