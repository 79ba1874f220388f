"""TCT's stage sections (the ``params:`` of ``algorithm: tct``): stage 1 rounds and stage 2 settings.

Frozen and self-validating, so the config validates them without knowing TCT: a bad value is one
line naming its key as the user wrote it (``stage2.solver``) when the section is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcfl.errors import ConfigError

#: the values each choice-valued stage-2 key accepts
STAGE2_CHOICES: dict[str, tuple[str, ...]] = {
    "params": ("all", "features"),
    "solver": ("closed_form", "primal"),
    "variant": ("scaffold", "fedavg", "gd"),
    "loss": ("mse", "ce"),
    "features": ("entk", "last_layer"),
    "head": ("fresh1", "keep"),
    "dtype": ("float32", "float16", "bfloat16"),
    "method": ("auto", "fused", "vmap", "loop"),
}


@dataclass(frozen=True)
class Stage1Section:
    """TCT stage 1 (FedAvg bootstrap): number of rounds T1 (0 = features at random init)."""

    rounds: int = 10

    def __post_init__(self) -> None:
        if self.rounds < 0:
            raise ConfigError(f"config key 'stage1.rounds' must be >= 0, got {self.rounds}")


@dataclass(frozen=True)
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

    def __post_init__(self) -> None:
        for key in ("p", "lr", "local_steps", "batch_size"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"config key 'stage2.{key}' must be > 0, got {getattr(self, key)}")
        if self.rounds < 0:
            raise ConfigError(f"config key 'stage2.rounds' must be >= 0, got {self.rounds}")
        for key, choices in STAGE2_CHOICES.items():
            if getattr(self, key) not in choices:
                raise ConfigError(
                    f"config key 'stage2.{key}' must be one of {', '.join(choices)}, got {getattr(self, key)!r}"
                )
        if self.loss == "ce" and self.solver == "closed_form":
            raise ConfigError("stage2.loss=ce has no closed form; set stage2.solver=primal")
        if self.head == "fresh1" and self.logit != 0:
            raise ConfigError(
                f"config key 'stage2.logit' ({self.logit}) applies only with stage2.head=keep: the default fresh "
                "1-output head has the single output 0; drop stage2.logit, or set stage2.head=keep for the "
                "legacy C-output head"
            )
