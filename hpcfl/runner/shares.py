"""Per-client held-out shares: a seeded fraction of each client's samples set apart (validation,
``client_eval``, the held-out clients' own shares), one function so every hold-out draws alike."""

from __future__ import annotations

import numpy as np
import torch

from hpcfl.training.seeds import seeded_rng


def split_clients(
    parts: list[torch.Tensor], fraction: float, seed: int, *, salt: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per client, a seeded ``fraction`` of its samples (at least one, never its last) held out:
    (the remaining indices, the held-out indices), both per client in client order. ``salt`` keeps
    the draws of different hold-outs (validation, ``client_eval``) apart."""
    rng = seeded_rng(seed, salt)
    kept, held = [], []
    for part in parts:
        n = int(part.numel())
        m = min(n - 1, max(1, round(fraction * n)))
        chosen = np.zeros(n, dtype=bool)
        chosen[rng.permutation(n)[:m]] = True
        mask = torch.from_numpy(chosen)  # host: index bookkeeping
        kept.append(part[~mask])
        held.append(part[mask])
    return kept, held
