"""TCT's stage sections (the ``params:`` of ``algorithm: tct``): stage 1 rounds and stage 2 settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Stage1Section:
    """TCT stage 1 (FedAvg bootstrap): number of rounds T1 (0 = features at random init)."""

    rounds: int = 10


@dataclass
class Stage2Section:
    """TCT stage 2 (convexified problem); defaults from TCT Algorithm 2 except where noted."""

    p: int = 100_000  # eNTK coordinates kept (paper: 100,000)
    seed: int = 0  # seed of the fresh (or re-initialised) head and of the coordinate subset
    # fresh1: the classifier is replaced by a fresh seeded nn.Linear(in, 1) and the features are the
    # gradient of its one output, as TCT's public code does (every kept head coordinate is live).
    # keep: the legacy form before issue 16 — the C-output classifier re-initialised (seeded) and the
    # gradient of output ``logit``; (C−1)/C of the head's coordinates are then identically zero.
    # Ignored by features=last_layer (the representation does not depend on the head).
    head: str = "fresh1"  # fresh1 | keep
    logit: int = 0  # head=keep only: which of the C logits is differentiated (paper: the first)
    params: str = "all"  # all | features
    lr: float = 5e-5  # η2
    auto_lr: bool = False  # use half the largest stable η2 (from λ_max of every client) instead of lr
    local_steps: int = 500  # M
    rounds: int = 100  # T2
    solver: str = "closed_form"  # closed_form | primal
    variant: str = "scaffold"  # scaffold | fedavg | gd
    loss: str = "mse"  # mse | ce (ce: primal only)
    features: str = "entk"  # entk | last_layer
    normalize: bool = True
    dtype: str = "float32"  # storage dtype of the features
    batch_size: int = 256  # eNTK extraction batch
    method: str = "auto"  # eNTK method: auto | fused | vmap | loop
