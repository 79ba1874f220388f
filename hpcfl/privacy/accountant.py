"""Privacy accounting through Opacus's accountants (never our own arithmetic).

Both mechanisms here are the sampled Gaussian mechanism with POISSON sampling (each unit taken
independently with probability q), the case Opacus's RDP (Mironov et al. 2019) and PRV (Gopi,
Lee & Wutschitz 2021) accountants analyse, under add/remove-one adjacency. The run's accountant
state is its history of (σ, q, steps) compositions, kept as tensors in the server state, so it is
checkpointed with the model and a resumed run continues it exactly.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence

from hpcfl.errors import ConfigError

Composition = tuple[float, float, int]  # (noise multiplier σ, sampling rate q, steps)


def _accountant(kind: str):  # noqa: ANN202 - Opacus's IAccountant
    from opacus.accountants import PRVAccountant, RDPAccountant

    return RDPAccountant() if kind == "rdp" else PRVAccountant()


@functools.lru_cache(maxsize=1024)
def _rdp_one_step(sigma: float, q: float) -> tuple[float, ...]:
    """Opacus's RDP of ONE step at its default orders (``compute_rdp(q, σ, 1, orders)``)."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import compute_rdp

    return tuple(compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=RDPAccountant.DEFAULT_ALPHAS))


@functools.lru_cache(maxsize=4096)
def epsilon(sigma: float, q: float, steps: int, delta: float, kind: str = "rdp") -> float:
    """ε(δ) of ``steps`` compositions of the Poisson-sampled Gaussian mechanism, from Opacus.

    RDP: exactly what ``RDPAccountant.get_epsilon`` returns for the history [(σ, q, steps)]
    (``compute_rdp`` is the one-step RDP times ``steps``; the one-step vector is cached, so a
    round's accounting costs Opacus's RDP-to-(ε, δ) conversion alone, ~1 ms instead of ~30 ms).
    """
    if steps <= 0:
        return 0.0
    with warnings.catch_warnings():  # "optimal order is the largest alpha": a looser, still valid bound
        warnings.simplefilter("ignore", UserWarning)
        if kind == "rdp":
            import numpy as np
            from opacus.accountants import RDPAccountant
            from opacus.accountants.analysis.rdp import get_privacy_spent

            rdp = np.array(_rdp_one_step(float(sigma), float(q))) * int(steps)
            return float(get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp, delta=delta)[0])
        acc = _accountant(kind)
        acc.history = [(float(sigma), float(q), int(steps))]
        return float(acc.get_epsilon(delta=delta))


@functools.lru_cache(maxsize=4096)
def history_epsilon(history: tuple[Composition, ...], delta: float, kind: str = "rdp") -> float:
    """ε(δ) of a history of (σ, q, steps) compositions, from Opacus: a run whose noise multiplier
    changed (a resume recalibrated for more rounds) composes every segment at its own σ. RDP adds
    the segments' RDP vectors (what ``RDPAccountant.get_epsilon`` does for such a history); PRV
    gives Opacus's accountant the history itself."""
    history = tuple((float(s), float(q), int(n)) for s, q, n in history if n > 0)
    if not history:
        return 0.0
    if len(history) == 1:
        return epsilon(*history[0], delta, kind)
    with warnings.catch_warnings():  # see epsilon()
        warnings.simplefilter("ignore", UserWarning)
        if kind == "rdp":
            import numpy as np
            from opacus.accountants import RDPAccountant
            from opacus.accountants.analysis.rdp import get_privacy_spent

            rdp = sum(np.array(_rdp_one_step(s, q)) * n for s, q, n in history)
            return float(get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp, delta=delta)[0])
        acc = _accountant(kind)
        acc.history = list(history)
        return float(acc.get_epsilon(delta=delta))


def worst_epsilon(sigma: float, compositions: Sequence[tuple[float, int]], delta: float, kind: str) -> float:
    """The largest ε(δ) over privacy units with their own (q, steps) (sample level: one per client,
    each client's records are protected by its own DP-SGD run)."""
    return max((epsilon(sigma, q, steps, delta, kind) for q, steps in set(compositions)), default=0.0)


def _noise_for(target: float, q: float, steps: int, delta: float, kind: str) -> float:
    """Opacus's ``get_noise_multiplier`` for one (q, steps), its ε within 0.01 of ``target``."""
    from opacus.accountants.utils import MAX_SIGMA, get_noise_multiplier

    # Opacus doubles σ from 20 and gives up past MAX_SIGMA (minutes of accounting at sample level):
    # the largest σ it tries first, so an unreachable target is refused at once
    largest = 10.0 * 2 ** math.floor(math.log2(MAX_SIGMA / 10.0))
    if (reached := epsilon(largest, q, steps, delta, kind)) > target:
        raise ConfigError(
            f"privacy.epsilon={target}: no noise multiplier reaches it (ε is {reached:.3g} even at σ = "
            f"{largest:g}, for {steps} steps at sampling rate {q:g}); raise privacy.epsilon or take fewer "
            "rounds or steps"
        )
    try:
        with warnings.catch_warnings():  # see epsilon()
            warnings.simplefilter("ignore", UserWarning)
            return float(
                get_noise_multiplier(
                    target_epsilon=target, target_delta=delta, sample_rate=q, steps=steps, accountant=kind
                )
            )
    except ValueError as err:
        raise ConfigError(f"privacy.epsilon={target}: no noise multiplier reaches it ({err})") from None


CALIBRATION_TOLERANCE = 0.01  # ε above a calibrated target that Opacus's search may leave


def calibrate(target: float, compositions: Sequence[tuple[float, int]], delta: float, kind: str) -> float:
    """The σ at which every unit's (q, steps) stays within ε = ``target`` at ``delta`` (to Opacus's
    0.01 in ε): calibrated on the unit with the largest q (the least amplified), then on whichever
    unit is still above the target at that σ, until none is (one or two calls of
    ``get_noise_multiplier``, ~2 s each, instead of one per client)."""
    units = sorted(set(compositions), key=lambda u: (-u[0], -u[1]))
    if not units:
        return 0.0
    sigma = _noise_for(target, *units[0], delta, kind)
    while True:
        worst = max(units, key=lambda u: epsilon(sigma, u[0], u[1], delta, kind))
        if epsilon(sigma, worst[0], worst[1], delta, kind) <= target + CALIBRATION_TOLERANCE:
            return sigma
        more = _noise_for(target, *worst, delta, kind)
        if more <= sigma:  # within Opacus's own tolerance already
            return sigma
        sigma = more
