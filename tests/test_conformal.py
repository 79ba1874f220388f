"""Split-conformal prediction sets: the finite-sample coverage bound, the set rule, the run rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hpcfl.metrics.conformal import (
    calibration_split,
    conformal_metrics,
    conformal_scores,
    conformal_threshold,
    prediction_sets,
)


def _exchangeable(n: int, classes: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """i.i.d. (probs, label) pairs from a deliberately miscalibrated model: the guarantee needs
    exchangeability only, not a good model."""
    logits = 2.0 * torch.randn(n, classes, generator=gen, dtype=torch.float64)
    probs = logits.softmax(1)
    truth = (logits + 1.5 * torch.randn(n, classes, generator=gen, dtype=torch.float64)).softmax(1)
    labels = torch.multinomial(truth, 1, generator=gen).squeeze(1)
    return probs, labels


@pytest.mark.parametrize("method", ["lac", "aps"])
@pytest.mark.parametrize("alpha", [0.1, 0.05])
def test_coverage_lies_within_the_finite_sample_bound(method: str, alpha: float) -> None:
    """1 − α ≤ E[coverage] ≤ 1 − α + 1/(n_cal + 1) (Angelopoulos et al., Theorem 1 and its upper
    half for tie-free scores), checked as the mean of 400 independent splits ± 4 standard errors."""
    gen = torch.Generator().manual_seed(0)
    n, trials = 200, 400
    n_cal = n // 2
    cover = []
    for t in range(trials):
        probs, labels = _exchangeable(n, 10, gen)
        m = conformal_metrics(probs, labels, seed=t, alphas=(alpha,), methods=(method,))
        cover.append(m[f"{method}_coverage_{100 * (1 - alpha):g}"])
    c = torch.tensor(cover, dtype=torch.float64)
    se = float(c.std() / math.sqrt(trials))
    assert 1 - alpha - 4 * se <= float(c.mean()) <= 1 - alpha + 1 / (n_cal + 1) + 4 * se, (
        float(c.mean()),
        se,
    )


@pytest.mark.parametrize("method", ["lac", "aps"])
def test_a_class_is_in_the_set_exactly_when_its_score_is_below_the_threshold(method: str) -> None:
    gen = torch.Generator().manual_seed(1)
    probs, labels = _exchangeable(300, 7, gen)
    u = torch.rand(300, generator=gen, dtype=torch.float64)
    qhat = conformal_threshold(conformal_scores(probs, labels, method, u), 0.1)
    sets = prediction_sets(probs, qhat, method, u)
    for j in range(7):
        as_label = torch.full((300,), j, dtype=torch.long)
        assert torch.equal(sets[:, j], conformal_scores(probs, as_label, method, u) <= qhat), j


def test_threshold_is_the_conformal_rank_and_infinite_beyond_n() -> None:
    scores = torch.arange(1, 20, dtype=torch.float64)  # n = 19
    assert conformal_threshold(scores, 0.1) == 18.0  # ⌈20 · 0.9⌉ = 18th smallest
    assert conformal_threshold(scores, 0.01) == math.inf  # ⌈20 · 0.99⌉ = 20 > 19
    probs = torch.full((5, 4), 0.25, dtype=torch.float64)
    assert prediction_sets(probs, math.inf, "lac", torch.zeros(5)).all()


def test_split_is_seeded_disjoint_and_complete() -> None:
    cal, ev = calibration_split(101, 0.5, seed=3)
    assert len(cal) == 50 and len(ev) == 51
    assert torch.equal(torch.cat([cal, ev]).sort().values, torch.arange(101))
    again = calibration_split(101, 0.5, seed=3)
    assert torch.equal(cal, again[0]) and not torch.equal(cal, calibration_split(101, 0.5, seed=4)[0])


def test_aps_sets_grow_with_uncertainty_and_lac_sets_are_smallest_on_average() -> None:
    gen = torch.Generator().manual_seed(2)
    probs, labels = _exchangeable(4000, 10, gen)
    m = conformal_metrics(probs, labels, seed=0)
    for pct in ("90", "95", "99"):
        assert m[f"lac_set_size_{pct}"] <= m[f"aps_set_size_{pct}"] + 1e-9
    assert m["lac_set_size_90"] <= m["lac_set_size_95"] <= m["lac_set_size_99"]


def test_a_run_with_conformal_writes_coverage_and_set_size_per_row(tmp_path: Path) -> None:
    from hpcfl.config import load_config
    from hpcfl.runner.experiment import run_experiment
    from tests.helpers import synthetic_config

    cfg = synthetic_config(
        tmp_path, rounds=2, conformal=True, dataset_options={"n_train": 400, "n_test": 200}
    )
    result = run_experiment(load_config(cfg), tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for key in ("lac_coverage_90", "aps_coverage_95", "lac_set_size_99", "aps_set_size_90"):
        assert key in rows[-1]
    assert 1.0 <= rows[-1]["aps_set_size_99"] <= 10.0
    assert rows[-1]["test_accuracy"] == result.metrics[-1]["test_accuracy"]


def test_calibration_fraction_out_of_range_is_one_line(tmp_path: Path) -> None:
    from tests.helpers import run_cli, synthetic_config

    cfg = synthetic_config(tmp_path, conformal=True, conformal_calibration=1.0)
    proc = run_cli("run", str(cfg), "--run-dir", str(tmp_path / "r"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "conformal_calibration" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
