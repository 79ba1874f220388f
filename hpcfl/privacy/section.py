"""The ``privacy:`` config section and the checks that need only the config (no torch, no data).

Two kinds of differential privacy (DP), chosen by ``level``:

- ``client``: DP-FedAvg (McMahan, Ramage, Talwar & Zhang, ICLR 2018): each participant's model
  update is clipped to norm S (``clip``), the sum gets Gaussian noise N(0, (z·S)²), the privacy unit
  is a client; with ``adaptive_clip.target_quantile`` S follows Andrew, Thakkar, McMahan &
  Ramaswamy (NeurIPS 2021), "Differentially Private Learning with Adaptive Clipping";
- ``sample``: DP-SGD (Abadi et al., CCS 2016) inside each client's local training: per-sample
  gradients clipped to C (``clip``), N(0, (z·C)²) per step, the unit is one training sample.

Either ``noise_multiplier`` z is given, or a target ``epsilon`` (with ``delta``), from which z is
calibrated up front by the accountant library for the run's rounds, sampling rate and steps.

Which levels an algorithm supports is its own declaration (``Algorithm.dp_levels``, and
``Algorithm.dp_refusal`` for why not), read here from the class the registry names: this module
names no algorithm, so a plugin can declare DP support as a built-in does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpcfl.errors import ConfigError
from hpcfl.registry import ALGORITHMS

LEVELS = ("none", "client", "sample")
ACCOUNTANTS = ("rdp", "prv")  # Opacus's Rényi-DP and privacy-random-variable accountants


@dataclass(frozen=True)
class AdaptiveClipSection:
    """Andrew et al. (2021) adaptive clipping, client level only: the clip S follows the
    ``target_quantile`` γ of the update norms by the geometric step S ← S·exp(−η_C(b̄ − γ)),
    η_C = ``lr`` (the paper uses γ = 0.5, η_C = 0.2), b̄ the noised fraction of clipped-below
    updates with count noise ``count_stddev`` σ_b (None: the paper's M/20 for M expected
    participants). Off while ``target_quantile`` is None."""

    target_quantile: float | None = None
    lr: float = 0.2
    count_stddev: float | None = None


@dataclass(frozen=True)
class PrivacySection:
    """The run's differential privacy (module docstring); ``level: none`` (default) is off.

    ``epsilon_budget``: the run stops (checkpointed, exit 0, one line) before a round that would
    take ε(δ) above it. ``accountant``: Opacus's ``rdp`` (default) or ``prv``.
    """

    level: str = "none"
    noise_multiplier: float | None = None
    epsilon: float | None = None
    delta: float = 1e-5
    clip: float = 1.0
    adaptive_clip: AdaptiveClipSection = field(default_factory=AdaptiveClipSection)
    epsilon_budget: float | None = None
    accountant: str = "rdp"

    @property
    def enabled(self) -> bool:
        return self.level != "none"

    @property
    def adaptive(self) -> bool:
        return self.adaptive_clip.target_quantile is not None


def _supporting(level: str) -> list[str]:
    """The built-in algorithms that declare ``level`` (for the refusal's advice; imports them all,
    on the error path only)."""
    return [name for name in ALGORITHMS.builtin_names() if level in ALGORITHMS[name].dp_levels]


def validate_privacy(p: PrivacySection, cfg: Any) -> None:
    """Refuse, in one line, a privacy section that is out of range or does not fit the run."""
    if p.level not in LEVELS:
        raise ConfigError(f"config key 'privacy.level' must be one of {', '.join(LEVELS)}, got {p.level!r}")
    if not p.enabled:
        if p != PrivacySection(level=p.level):  # ε, clip, ... without a level would run with no privacy
            raise ConfigError(
                "privacy: settings are given but 'privacy.level' is none, so the run would have no privacy "
                "at all: set privacy.level to client or sample (or remove the privacy section)"
            )
        return
    if p.accountant not in ACCOUNTANTS:
        raise ConfigError(
            f"config key 'privacy.accountant' must be one of {', '.join(ACCOUNTANTS)}, got {p.accountant!r}"
        )
    if (p.noise_multiplier is None) == (p.epsilon is None):
        raise ConfigError("privacy: set exactly one of 'privacy.noise_multiplier' and 'privacy.epsilon'")
    for key in ("noise_multiplier", "epsilon", "clip", "epsilon_budget"):
        value = getattr(p, key)
        if value is not None and not value > 0:
            raise ConfigError(f"config key 'privacy.{key}' must be > 0, got {value}")
    if not 0 < p.delta < 1:
        raise ConfigError(f"config key 'privacy.delta' must be in (0, 1), got {p.delta}")
    ac = p.adaptive_clip
    if ac.target_quantile is not None:
        if p.level != "client":
            raise ConfigError("privacy.adaptive_clip applies to privacy.level=client only; remove it")
        if not 0 < ac.target_quantile < 1:
            raise ConfigError(
                f"config key 'privacy.adaptive_clip.target_quantile' must be in (0, 1), got {ac.target_quantile}"
            )
        if not ac.lr > 0:
            raise ConfigError(f"config key 'privacy.adaptive_clip.lr' must be > 0, got {ac.lr}")
        if ac.count_stddev is not None and not ac.count_stddev > 0:
            raise ConfigError(
                f"config key 'privacy.adaptive_clip.count_stddev' must be > 0, got {ac.count_stddev}"
            )
    finetune = getattr(getattr(cfg, "finetune_eval", None), "steps", 0)
    if finetune:
        raise ConfigError(
            f"privacy.level={p.level} with finetune_eval (steps {finetune}): the evaluation-time fine-tuning trains "
            "on each client's data outside the accountant, so its accuracies would not be covered by the "
            "reported ε; set finetune_eval.steps: 0 (or run without privacy)"
        )
    algorithm = ALGORITHMS[cfg.algorithm]  # the class only (config has loaded it already)
    if p.level not in algorithm.dp_levels:
        raise ConfigError(
            f"privacy.level={p.level} does not support algorithm {cfg.algorithm!r}: {algorithm.dp_refusal}; "
            f"use one of {', '.join(_supporting(p.level))}"
        )
    if p.level == "client":
        sampled = cfg.participation is not None and cfg.participation < 1
        trained = cfg.num_clients - cfg.heldout_clients  # the population that is sampled
        sampled = sampled or (cfg.clients_per_round is not None and cfg.clients_per_round < trained)
        if not sampled:
            raise ConfigError(
                "privacy.level=client needs sampled participation (the accountant's amplification by "
                "sampling, q = M/K): set clients_per_round below num_clients, or participation below 1"
            )
        if cfg.participation_weighting != "uniform":
            raise ConfigError(
                "privacy.level=client samples every client with the same probability q = M/K: "
                "set participation_weighting: uniform"
            )
