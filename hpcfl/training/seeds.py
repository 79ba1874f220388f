"""Seeded host generators keyed by a run's seed and where they are used: pure functions of the key
(seed, a salt naming the stream, stage, round, client), so what is drawn from them does not depend
on the rank, the device or a resume.

Host work on purpose: every generator here lives on the CPU, so its draws are the same whatever
device the run trains on. A stream is named by its key alone; two streams differ by a salt word.
"""

from __future__ import annotations

import numpy as np
import torch


def seeded_generator(*key: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with 64 bits of ``np.random.SeedSequence(key)``'s state (the
    first two 32-bit words, high word first)."""
    words = np.random.SeedSequence(list(key)).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(words[0]) << 32 | int(words[1]))


def seeded_rng(*key: int) -> np.random.Generator:
    """A numpy generator on ``np.random.SeedSequence(key)``."""
    return np.random.default_rng(np.random.SeedSequence(list(key)))
