"""From the ``privacy:`` section to the run's private algorithm and trainer."""

from __future__ import annotations

import importlib.util
from typing import Any

from torch import nn

from hpcfl.algorithms.base import Algorithm, Trainer
from hpcfl.algorithms.participation import Population
from hpcfl.errors import ConfigError
from hpcfl.privacy import accountant
from hpcfl.privacy.private import Mechanism, Private, check_privatisable
from hpcfl.privacy.section import PrivacySection
from hpcfl.privacy.sgd import DPTrainer


def check_model(model: nn.Module, level: str) -> None:
    """Refuse BatchNorm: its batch statistics mix samples (sample level) and its running statistics
    are an unclipped channel of the data."""
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        raise ConfigError(
            f"privacy.level={level} refuses BatchNorm models (batch statistics mix samples and are not "
            "clipped); use a GroupNorm variant (resnet8/resnet18 with model_options.norm: gn, vgg11 "
            "with batch_norm: false) or simplecnn/mlp"
        )


def make_private(
    cfg: Any, inner: Algorithm, trainer: Trainer, model: nn.Module, population: Population
) -> tuple[Private, Trainer]:
    """The private algorithm (noise multiplier given, or calibrated for ``privacy.epsilon`` over the
    run's rounds, sampling rate and steps) and the trainer (DP-SGD at sample level)."""
    p: PrivacySection = cfg.privacy
    if importlib.util.find_spec("opacus") is None:
        raise ConfigError("privacy: accounting uses Opacus's accountants: pip install 'hpcfl[privacy]'")
    check_model(model, p.level)
    check_privatisable(inner, p.level)  # before σ is calibrated (a search at sample level)
    K = population.size
    rate = 1.0
    if p.level == "client":
        count = inner.participation.count
        assert count is not None  # validate_privacy requires sampled participation
        rate = count / K
        compositions = [(rate, cfg.rounds)]
    else:
        B = trainer.schedule.batch_size
        compositions = [
            (min(1.0, B / n), cfg.rounds * trainer.schedule.num_steps(n)) for n in population.sizes
        ]
    sigma = p.noise_multiplier
    if sigma is None:
        assert p.epsilon is not None
        sigma = accountant.calibrate(p.epsilon, compositions, p.delta, p.accountant)
    adaptive, count_stddev = None, 0.0
    if p.adaptive:
        adaptive = p.adaptive_clip
        count_stddev = adaptive.count_stddev if adaptive.count_stddev is not None else rate * K / 20.0
        if not 2.0 * count_stddev > sigma:
            raise ConfigError(
                f"privacy.adaptive_clip.count_stddev ({count_stddev:g}) must exceed half the noise multiplier "
                f"({sigma:g}/2): the count's release would take the whole budget (Andrew et al. 2021, Thm 1)"
            )
    mech = Mechanism(
        level=p.level,
        sigma=float(sigma),
        clip=p.clip,
        delta=p.delta,
        kind=p.accountant,
        seed=cfg.seed,
        rate=rate,
        budget=p.epsilon_budget,
        target=p.epsilon,
        adaptive=adaptive,
        count_stddev=count_stddev,
    )
    if p.level == "sample":
        trainer = DPTrainer(
            trainer.flat, trainer.schedule, clip=p.clip, noise_multiplier=mech.sigma, loss_fn=trainer.loss_fn
        )
    return Private(inner, mech, population, trainer.schedule), trainer


def budget_line(server: Any) -> str | None:
    """The one line a run stopped by its ``epsilon_budget`` ends with, or None (not stopped)."""
    from hpcfl.privacy.private import EXHAUSTED_TARGET

    flag = getattr(server, "dp_exhausted", None)
    if flag is None or not bool(flag[0]):
        return None
    if float(flag[0]) == EXHAUSTED_TARGET:
        return (
            "privacy budget reached: the next round would exceed privacy.epsilon, the target the noise was "
            "calibrated for (rounds taken before a resume count at their own noise; checkpoint saved)"
        )
    return "privacy budget reached: the next round would exceed privacy.epsilon_budget (checkpoint saved)"
