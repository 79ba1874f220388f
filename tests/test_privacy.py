"""Differential privacy (issue 29): sample-level DP-SGD against Opacus, client-level DP-FedAvg with
adaptive clipping across ranks, Opacus's accountant, the budget stop and the refusals."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, final_state, mpiexec_cmd, run_cli, synthetic_config

opacus = pytest.importorskip("opacus")


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _client_cfg(tmp_path: Path, **over):
    privacy = {"level": "client", "noise_multiplier": 1.0, "clip": 0.5}
    privacy.update(over.pop("privacy", {}))
    keys = dict(
        algorithm="fedavg", num_clients=8, clients_per_round=4, rounds=3, momentum=0.0, privacy=privacy
    )
    keys.update(over)
    return synthetic_config(tmp_path, **keys)


# -- sample level -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,options",
    [("mlp", {}), ("simplecnn", {}), ("resnet8", {"norm": "gn"}), ("cnn-proj", {})],
)
def test_clipped_sum_equals_opacus(name: str, options: dict) -> None:
    """Σ clip(g_i) from hpcfl's per-sample paths equals Opacus's GradSampleModule with its clipping:
    the book-keeping path with each Conv2d's norm chosen by cost, forced ghost and forced
    materialised (the zoo's 3×3 stride 1/2 padded, 1×1 shortcut and 5×5 unpadded convolutions)."""
    from opacus import GradSampleModule

    from hpcfl.models import build_model
    from hpcfl.privacy import ghost
    from hpcfl.privacy.sgd import OPACUS_EPS, clipped_grad_sum, vmap_clipped_grad_sum
    from hpcfl.training.flat import FlatModel
    from hpcfl.training.sgd import cross_entropy_loss

    torch.manual_seed(0)
    model = build_model(name, (1, 28, 28), 10, **options).double()
    x = torch.randn(6, 1, 28, 28, dtype=torch.float64)
    y = torch.randint(0, 10, (6,))
    clip = 0.7
    reference = GradSampleModule(copy.deepcopy(model), loss_reduction="sum")
    torch.nn.functional.cross_entropy(reference(x), y, reduction="sum").backward()
    samples = [p.grad_sample.flatten(1) for p in reference.parameters() if p.requires_grad]
    per_sample = torch.cat(samples, dim=1)  # (B, P)
    norms = per_sample.norm(dim=1)
    factor = (clip / (norms + 1e-6)).clamp(max=1.0)  # Opacus's DPOptimizer.clip_and_accumulate
    expected = (factor[:, None] * per_sample).sum(0)
    flat = FlatModel(model)
    assert bool((norms > clip).any()), "the test should clip some samples"
    assert ghost.supported(model)
    paths = {
        "auto": lambda out: clipped_grad_sum(model, cross_entropy_loss, x, y, clip, out),
        "book-keeping": lambda out: ghost.hooked_clipped_grad_sum(model, x, y, clip, out, OPACUS_EPS),
        **{
            f"book-keeping, conv {form}": lambda out, form=form: ghost.hooked_clipped_grad_sum(
                model, x, y, clip, out, OPACUS_EPS, conv_form=form
            )
            for form in ("ghost-unfold", "ghost-shift", "materialise")
        },
        "vmap": lambda out: vmap_clipped_grad_sum(model, cross_entropy_loss, x, y, clip, out),
    }
    for path, run in paths.items():
        out = torch.empty_like(flat.grad)
        losses, ours_norms = run(out)
        torch.testing.assert_close(ours_norms, norms, rtol=0, atol=1e-10, msg=path)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-10, msg=path)
        mean = torch.nn.functional.cross_entropy(model(x), y)
        torch.testing.assert_close(losses.mean(), mean, rtol=0, atol=1e-12, msg=path)


class _ConvVariants(torch.nn.Module):
    """Conv2d variants beyond the zoo's: groups, dilation, non-square kernel and stride, 'same'
    padding, reflect and circular padding modes, bias on and off; a frozen conv weight; GroupNorm."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.c1 = nn.Conv2d(2, 4, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2))
        self.c2 = nn.Conv2d(4, 6, 3, padding="same", groups=2, bias=False)
        self.c3 = nn.Conv2d(6, 6, 3, stride=2, padding=1, padding_mode="reflect", groups=3)
        self.n3 = nn.GroupNorm(2, 6)
        self.c4 = nn.Conv2d(6, 4, 2, padding=1, padding_mode="circular")
        self.c4.weight.requires_grad_(False)  # its bias alone is trained (and clipped)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.c2(torch.tanh(self.c1(x))))
        x = self.c4(torch.relu(self.n3(self.c3(x))))
        return self.fc(torch.nn.functional.adaptive_avg_pool2d(x, 4).flatten(1))


@pytest.mark.parametrize(
    "held,unfold_max_d", [(True, 64), (True, 0), (False, 64)], ids=["held", "held-grouped-only", "chunked"]
)
def test_book_keeping_conv_variants_equal_vmap(
    held: bool, unfold_max_d: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Grouped, dilated, strided, 'same'/reflect/circular-padded convolutions, with and without bias
    and with a frozen weight: every Conv2d norm form equals vmap per-sample gradients (float64, 1e-10),
    with materialised per-sample gradients held (narrow ungrouped convs by the unfolded product, or
    every conv by the batch-grouped backward), or formed a few samples at a time and dropped."""
    from hpcfl.privacy import ghost

    monkeypatch.setattr(ghost, "UNFOLD_MAX_D", unfold_max_d)
    from hpcfl.privacy.sgd import OPACUS_EPS, vmap_clipped_grad_sum
    from hpcfl.training.sgd import cross_entropy_loss

    torch.manual_seed(1)
    model = _ConvVariants().double()
    if not held:  # chunks of 2 samples or more (the largest weight's 2), the last one short
        largest = max(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Conv2d))
        monkeypatch.setattr(ghost, "HOLD_BYTES", 0)
        monkeypatch.setattr(ghost, "CHUNK_BYTES", 2 * 8 * largest)
    x = torch.randn(5, 2, 11, 9, dtype=torch.float64)
    y = torch.randint(0, 3, (5,))
    clip = 5.1
    P = sum(p.numel() for p in model.parameters() if p.requires_grad)
    expected = torch.empty(P, dtype=torch.float64)
    _, norms = vmap_clipped_grad_sum(model, cross_entropy_loss, x, y, clip, expected)
    assert bool((norms > clip).any()) and bool((norms < clip).any()), "clip some samples, not all"
    assert ghost.supported(model)
    for form in (None, "ghost-unfold", "ghost-shift", "materialise"):
        out = torch.empty(P, dtype=torch.float64)
        _, ours = ghost.hooked_clipped_grad_sum(model, x, y, clip, out, OPACUS_EPS, conv_form=form)
        torch.testing.assert_close(ours, norms, rtol=0, atol=1e-10, msg=str(form))
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-10, msg=str(form))


def test_conv_norm_form_is_chosen_by_cost() -> None:
    """Bu et al.'s hybrid rule with the shifted ghost norm as a third form: wide maps and 1×1
    shortcuts materialise, strided convolutions of many channels onto very small maps take the
    unfolded ghost norm, stride-1 convolutions of many channels on small maps the shifted one."""
    from hpcfl.privacy.ghost import choose_conv_form

    nn = torch.nn

    def form(conv: torch.nn.Conv2d, side: int) -> str:
        return choose_conv_form(conv, side * side, (side, side))

    assert form(nn.Conv2d(64, 128, 3, stride=2, padding=1), 4) == "ghost-unfold"  # simplecnn conv3
    assert form(nn.Conv2d(32, 64, 3, stride=2, padding=1), 7) == "materialise"  # simplecnn conv2, resnet8
    assert form(nn.Conv2d(64, 64, 3, padding=1), 7) == "ghost-shift"  # resnet8 layer3
    assert form(nn.Conv2d(512, 512, 3, padding=1), 4) == "ghost-shift"  # resnet18 layer4 on 32×32
    assert form(nn.Conv2d(32, 64, 1, stride=2), 7) == "materialise"  # resnet8 layer3 shortcut
    assert form(nn.Conv2d(16, 16, 3, padding=1), 28) == "materialise"  # resnet8 layer1
    assert form(nn.Conv2d(1, 32, 3, stride=2, padding=1), 14) == "materialise"  # simplecnn conv1


def test_group_norm_statistics_fallback_equals_the_saved_ones() -> None:
    """The GroupNorm weight's per-sample gradient uses the mean and 1/std its forward saved; where the
    output's node is another one, they are computed from the input, and are the same."""
    from hpcfl.privacy.ghost import _group_stats

    torch.manual_seed(3)
    m = torch.nn.GroupNorm(2, 6).double()
    a = torch.randn(4, 6, 5, 5, dtype=torch.float64) * 3 + 1
    out = m(a)
    assert type(out.grad_fn).__name__ == "NativeGroupNormBackward0"
    saved = _group_stats(m, a, out)
    computed = _group_stats(m, a, out * 1.0)  # a MulBackward0 node: nothing saved to read
    for s, c in zip(saved, computed, strict=True):
        torch.testing.assert_close(s, c, rtol=0, atol=1e-12)


def test_book_keeping_refuses_an_output_modified_in_place_and_sgd_falls_back() -> None:
    """A layer output changed in place (ReLU(inplace=True)) would give the wrong output gradient:
    the book-keeping path refuses before its backward and clipped_grad_sum takes vmap instead."""
    from hpcfl.privacy import ghost
    from hpcfl.privacy.sgd import OPACUS_EPS, clipped_grad_sum, vmap_clipped_grad_sum
    from hpcfl.training.sgd import cross_entropy_loss

    torch.manual_seed(2)
    nn = torch.nn
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(3 * 4 * 4, 2)
    ).double()
    x, y = torch.randn(4, 1, 6, 6, dtype=torch.float64), torch.randint(0, 2, (4,))
    P = sum(p.numel() for p in model.parameters())
    out, expected = torch.empty(P, dtype=torch.float64), torch.empty(P, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="in place"):
        ghost.hooked_clipped_grad_sum(model, x, y, 0.5, out, OPACUS_EPS)
    clipped_grad_sum(model, cross_entropy_loss, x, y, 0.5, out)
    vmap_clipped_grad_sum(model, cross_entropy_loss, x, y, 0.5, expected)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_dp_sgd_noise_has_the_configured_scale() -> None:
    """One DP-SGD step with and without noise (same batches): the difference is N(0, (σC)²)·lr/qn."""
    from hpcfl.models import build_model
    from hpcfl.training.flat import FlatModel
    from hpcfl.training.sgd import LocalSchedule
    from tests.helpers import dp_local_sgd

    torch.manual_seed(1)
    flat = FlatModel(build_model("mlp", (1, 28, 28), 10))
    x0 = flat.vector.clone()
    x, y = torch.randn(200, 1, 28, 28), torch.randint(0, 10, (200,))
    schedule = LocalSchedule(lr=0.1, batch_size=50, steps=1, weight_decay=0.0)
    after = {}
    for sigma in (0.0, 1.3):
        flat.load(x0)
        dp_local_sgd(flat, x, y, schedule, torch.Generator().manual_seed(5), clip=0.8, noise_multiplier=sigma)
        after[sigma] = flat.vector.clone()
    z = (after[0.0] - after[1.3]).double() * 50 / (0.1 * 1.3 * 0.8)  # standard normal entries
    n = z.numel()
    assert abs(float(z.mean())) < 5 / math.sqrt(n)
    assert abs(float(z.std()) - 1.0) < 5 * math.sqrt(0.5 / n)


# -- client level -------------------------------------------------------------------------------


def _private_fedavg(adaptive: dict | None = None, sigma: float = 1.0):
    from hpcfl.algorithms import FedAvg
    from hpcfl.algorithms.participation import Participation, Population
    from hpcfl.models import build_model
    from hpcfl.privacy.private import Mechanism, Private
    from hpcfl.privacy.section import AdaptiveClipSection
    from hpcfl.training.layout import StateLayout
    from hpcfl.training.sgd import LocalSchedule

    model = build_model("mlp", (1, 28, 28), 10)
    inner = FedAvg(FedAvg.Params(), layout=StateLayout.of_model(model), participation=Participation(count=4))
    mech = Mechanism(
        level="client",
        sigma=sigma,
        clip=0.5,
        delta=1e-5,
        kind="rdp",
        seed=11,
        rate=0.5,
        adaptive=AdaptiveClipSection(**adaptive) if adaptive else None,
        count_stddev=2.0 if adaptive else 0.0,
    )
    return Private(inner, mech, Population((100,) * 8), LocalSchedule(lr=0.1, batch_size=10)), model


def test_every_contribution_is_clipped_and_unweighted() -> None:
    """A participant's upload is y − x clipped to S, weight 1, with the bit ‖Δ‖ ≤ S."""
    from hpcfl.algorithms.base import ClientData
    from hpcfl.training.flat import FlatModel
    from hpcfl.training.sgd import LocalResult
    from tests.helpers import client_ctx

    algo, model = _private_fedavg()
    server = algo.init_server(FlatModel(model).vector)
    data = ClientData(0, torch.zeros(100, 1, 28, 28), torch.zeros(100, dtype=torch.long))
    task = algo.local_task(server, algo.init_client(0, server), data, client_ctx(None))
    result = LocalResult(loss=0.0, steps=1, finite=True)
    for scale, below in ((10.0, 0.0), (1e-3, 1.0)):
        step = torch.randn(server.x.shape, generator=torch.Generator().manual_seed(2))
        upload, _ = task.finish(server.x + scale * step / step.norm(), result)
        assert upload.weight == 1.0
        assert float(upload.sums["x"].double().norm()) <= 0.5 * (1 + 1e-6)
        assert float(upload.sums["dp_below"][0]) == below


def test_server_noise_and_adaptive_clip_follow_the_papers() -> None:
    """The server adds N(0, (z_Δ S)²) from the (seed, round) generator, divides by qK, and updates
    S ← S·exp(−η(b̄ − γ)) with b̄ = (Σb + N(0, σ_b²))/qK (Andrew et al. 2021), on a crafted sequence."""
    from hpcfl.algorithms.base import Aggregate, ServerContext
    from hpcfl.algorithms.participation import Population
    from hpcfl.privacy.private import noise_generator
    from hpcfl.training.flat import FlatModel

    algo, model = _private_fedavg({"target_quantile": 0.5, "lr": 0.2})
    server = algo.init_server(FlatModel(model).vector)
    z = algo.mech.sigma
    z_delta = (z**-2 - (2 * 2.0) ** -2) ** -0.5
    S = 0.5
    for rnd, below_count in enumerate((4, 0, 3, 1)):
        total = torch.full_like(server.x, 0.01)
        agg = Aggregate(
            sums={"x": total, "dp_below": torch.tensor([float(below_count)])}, weight=4.0, count=4
        )
        ctx = ServerContext(rnd, (0, 1, 2, 3), Population((100,) * 8), lambda t: t)
        new, row = algo.server_update(server, agg, ctx)
        gen = noise_generator(11, rnd)
        noise = torch.randn(server.x.numel(), generator=gen, dtype=torch.float64) * (z_delta * S)
        count_noise = float(torch.randn(1, generator=gen, dtype=torch.float64)) * 2.0
        expected_x = server.x + (total + noise.float()) / 4.0
        assert torch.equal(new.x, expected_x)
        S = S * math.exp(-0.2 * ((below_count + count_noise) / 4.0 - 0.5))
        assert float(new.dp_clip[0]) == pytest.approx(S, rel=1e-15)
        assert row["epsilon"] > 0
        server = new


def test_poisson_participation_has_rate_q() -> None:
    """Client-level participants: each client independently with q = M/K (the accountant's sampling)."""
    from hpcfl.algorithms.participation import Population
    from hpcfl.runner.rounds import round_generator

    algo, _ = _private_fedavg()
    counts = [len(algo.participants(r, Population((100,) * 8), round_generator(0, 0, r))) for r in range(400)]
    assert len(set(counts)) > 3  # a Poisson count, not a fixed M
    assert abs(sum(counts) / len(counts) - 4.0) < 0.3


def test_epsilon_equals_opacus_and_is_monotone(tmp_path: Path) -> None:
    """ε(δ) in metrics.jsonl equals Opacus's RDP accountant for (σ, q, rounds), rising every round."""
    from opacus.accountants import RDPAccountant

    from hpcfl.config import load_config
    from hpcfl.runner import run_experiment

    result = run_experiment(load_config(_client_cfg(tmp_path)), tmp_path / "run")
    eps = [row["epsilon"] for row in _rows(tmp_path / "run")]
    for r, value in enumerate(eps, start=1):
        acc = RDPAccountant()
        acc.history = [(1.0, 0.5, r)]
        assert value == acc.get_epsilon(delta=1e-5)
    assert eps == sorted(eps) and len(set(eps)) == len(eps)
    assert result.finished


def test_target_epsilon_is_calibrated_by_opacus(tmp_path: Path) -> None:
    """privacy.epsilon: σ from Opacus's get_noise_multiplier for (q, rounds); the run ends within it."""
    from opacus.accountants.utils import get_noise_multiplier

    from hpcfl.config import load_config
    from hpcfl.runner import run_experiment

    cfg = _client_cfg(tmp_path, privacy={"noise_multiplier": None, "epsilon": 4.0})
    run_experiment(load_config(cfg), tmp_path / "run")
    rows = _rows(tmp_path / "run")
    sigma = get_noise_multiplier(target_epsilon=4.0, target_delta=1e-5, sample_rate=0.5, steps=3)
    assert rows[-1]["dp_noise_multiplier"] == sigma
    assert 3.9 <= rows[-1]["epsilon"] <= 4.01


@pytest.mark.slow
def test_client_level_is_bit_identical_on_1_and_2_ranks_and_after_resume(tmp_path: Path) -> None:
    """The same final state on 1 and 2 MPI ranks (noise drawn once per round from (seed, round)),
    and a run stopped after 2 rounds and resumed ends bit-identical, ε and the clip included."""
    cfg = _client_cfg(tmp_path, privacy={"adaptive_clip": {"target_quantile": 0.5, "count_stddev": 2.0}})
    one = run_cli("run", str(cfg), "--run-dir", str(tmp_path / "r1"))
    assert one.returncode == 0, one.stderr
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    two = subprocess.run(
        mpiexec_cmd(2, "run", str(cfg), "--run-dir", str(tmp_path / "r2")),
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr
    assert torch.equal(final_state(tmp_path / "r2"), final_state(tmp_path / "r1"))
    part = run_cli("run", str(cfg), "--run-dir", str(tmp_path / "r3"), "--set", "rounds=2")
    assert part.returncode == 0, part.stderr
    resumed = run_cli("run", str(cfg), "--run-dir", str(tmp_path / "r3"), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert torch.equal(final_state(tmp_path / "r3"), final_state(tmp_path / "r1"))
    keys = ("epsilon", "dp_clip", "test_accuracy", "participants")
    assert [{k: r[k] for k in keys} for r in _rows(tmp_path / "r3")] == [
        {k: r[k] for k in keys} for r in _rows(tmp_path / "r1")
    ]


def test_budget_stop_checkpoints_exits_0_and_stays_stopped(tmp_path: Path) -> None:
    """epsilon_budget: the run stops before the round that would exceed it, with a checkpoint, exit
    0 and one line; a resume does not train past it."""
    cfg = _client_cfg(tmp_path, rounds=10, privacy={"epsilon_budget": 6.0})
    first = run_cli("run", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert first.returncode == 0, first.stderr
    lines = [line for line in first.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "privacy budget reached" in lines[0], first.stderr
    rows = _rows(tmp_path / "run")
    assert rows[-1]["epsilon"] <= 6.0 < 100 and len(rows) < 10
    assert (tmp_path / "run" / "checkpoints" / "LATEST").read_text().strip().endswith(str(len(rows)))
    status = run_cli("status", str(tmp_path / "run"))  # issue 44: status said only "finished"
    assert status.returncode == 0 and "stopped by its privacy budget" in status.stdout, status.stdout
    again = run_cli("run", str(cfg), "--run-dir", str(tmp_path / "run"), "--resume")
    assert again.returncode == 0, again.stderr
    assert "privacy budget reached" in again.stderr
    assert len(_rows(tmp_path / "run")) == len(rows)


@pytest.mark.parametrize(
    "over,words",
    [
        ({"algorithm": "scaffold"}, "control variates"),
        ({"algorithm": "fednova"}, "does not support algorithm"),
        ({"clients_per_round": None}, "sampled participation"),
        ({"privacy": {"epsilon": 3.0}}, "exactly one"),
        ({"privacy": {"level": "sample", "adaptive_clip": {"target_quantile": 0.5}}}, "client only"),
        ({"privacy": {"level": "both"}}, "privacy.level"),
        ({"privacy": {"clip": 0}}, "privacy.clip"),
        ({"privacy": {"delta": 2}}, "privacy.delta"),
        ({"model": "resnet8", "dataset_options": {"n_train": 200, "n_test": 40, "seed": 3}}, "BatchNorm"),
        ({"privacy": {"adaptive_clip": {"target_quantile": 0.5}}}, "count_stddev"),
    ],
)
def test_refused_combinations_give_one_line(tmp_path: Path, over: dict, words: str) -> None:
    proc = run_cli("run", str(_client_cfg(tmp_path, **over)), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode not in (0, 75)
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], proc.stderr


def test_every_builtin_declares_its_dp_support_in_its_own_class() -> None:
    """Issue 43: DP support is each algorithm's declaration, in its own file (a subclass does not
    inherit its parent's silently); the decisions are those the privacy section listed before."""
    from hpcfl.algorithms import Algorithm
    from hpcfl.registry import ALGORITHMS

    supported = {}
    for name in ALGORITHMS.builtin_names():
        cls = ALGORITHMS[name]
        assert "dp_levels" in vars(cls) or "dp_refusal" in vars(cls), name
        assert cls.dp_levels or cls.dp_refusal != Algorithm.dp_refusal, name
        supported[name] = cls.dp_levels
    assert {n for n, levels in supported.items() if levels} == {
        "fedavg",
        "fedprox",
        "fedadam",
        "fedyogi",
        "fedadagrad",
        "fedavgm",
    }
    assert {levels for levels in supported.values() if levels} == {("client", "sample")}


def test_an_unreachable_target_epsilon_is_refused_before_opacus_searches(monkeypatch) -> None:
    """Issue 44: privacy.epsilon=1e-9 was refused only after Opacus's search had doubled σ past its
    limit (153 s at sample level); now one accountant evaluation at the largest σ it would try."""
    import opacus.accountants.utils

    from hpcfl.errors import ConfigError
    from hpcfl.privacy import accountant

    def searched(**kwargs):
        raise AssertionError("Opacus's search ran")

    monkeypatch.setattr(opacus.accountants.utils, "get_noise_multiplier", searched)
    with pytest.raises(ConfigError, match=r"privacy.epsilon=1e-09: no noise multiplier reaches it \(ε is "):
        accountant.calibrate(1e-9, [(0.5, 3)], 1e-5, "rdp")


def test_privacy_settings_without_a_level_are_refused(tmp_path: Path) -> None:
    """Issue 44: ε, δ and clip without ``level`` ran with no privacy at all (exit 0, config.yaml
    still showing ε); now one line naming privacy.level, and no run directory written."""
    cfg = synthetic_config(
        tmp_path, algorithm="fedavg", privacy={"epsilon": 3.0, "delta": 1e-5, "clip": 1.0}, rounds=1
    )
    proc = run_cli("run", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode not in (0, 75) and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "privacy.level" in lines[0], proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


class _StopAfter:
    """A stop request that turns on after ``rounds`` rounds (a job preempted mid-run)."""

    def __init__(self, rounds: int) -> None:
        self.left = rounds

    @property
    def requested(self) -> bool:
        self.left -= 1
        return self.left <= 0

    def stop_now(self) -> bool:
        return False


def test_resume_with_more_rounds_accounts_the_spent_rounds_at_their_own_noise(tmp_path: Path) -> None:
    """Issue 44: a run calibrated to a target ε, stopped after 2 rounds and resumed with more rounds,
    recalibrates σ for the new length. Its ε is the composition over the actual history (2 rounds at
    the first σ, the rest at the second; Opacus's accountant over that history), never the new σ
    over every round (which reported less than was spent), and the target then stops the run."""
    from opacus.accountants import RDPAccountant

    from hpcfl.config import load_config
    from hpcfl.runner import run_experiment

    cfg = _client_cfg(tmp_path, rounds=6, privacy={"noise_multiplier": None, "epsilon": 8.0})
    first = run_experiment(load_config(cfg), tmp_path / "run", stop=_StopAfter(2))  # type: ignore[arg-type]
    assert first.rounds_done == 2 and not first.finished
    more = load_config(cfg, ["rounds=40"])
    second = run_experiment(more, tmp_path / "run", resume=True)
    rows = _rows(tmp_path / "run")
    s1, s2 = rows[0]["dp_noise_multiplier"], rows[-1]["dp_noise_multiplier"]
    assert s2 > s1 and all(r["dp_noise_multiplier"] == s1 for r in rows[:2])
    for r, row in enumerate(rows, start=1):
        acc = RDPAccountant()
        acc.history = [(s1, 0.5, min(r, 2))] + ([(s2, 0.5, r - 2)] if r > 2 else [])
        assert row["epsilon"] == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-12)
    naive = RDPAccountant()
    naive.history = [(s2, 0.5, len(rows))]
    assert rows[-1]["epsilon"] > naive.get_epsilon(delta=1e-5)  # what the run used to report
    assert rows[-1]["epsilon"] <= 8.0 + 0.01 and len(rows) < 40  # the target stopped it
    assert second.finished and second.budget_stop is not None and "privacy.epsilon" in second.budget_stop


def test_sample_level_epsilon_is_the_worst_client_and_report_shows_it(tmp_path: Path) -> None:
    """Sample level: ε is the largest over clients of Opacus's ε for (σ, q_k = B/n_k, steps taken),
    and ``hpcfl report`` names it."""
    from opacus.accountants import RDPAccountant

    from hpcfl.config import load_config
    from hpcfl.report.summary import markdown_table, summarise
    from hpcfl.runner import run_experiment

    cfg = _client_cfg(
        tmp_path,
        num_clients=3,
        clients_per_round=None,
        rounds=2,
        dataset_options={"n_train": 300, "n_test": 60, "seed": 3},
        privacy={"level": "sample", "noise_multiplier": 1.1},
    )
    result = run_experiment(load_config(cfg), tmp_path / "run")
    assert result.finished
    partition = json.loads((tmp_path / "run" / "partition.json").read_text())
    sizes = [int(c["size"]) for c in partition["clients"]]
    expected = []
    for n in sizes:
        acc = RDPAccountant()
        acc.history = [(1.1, min(1.0, 50 / n), 2 * math.ceil(n / 50))]
        expected.append(acc.get_epsilon(delta=1e-5))
    assert _rows(tmp_path / "run")[-1]["epsilon"] == max(expected)
    assert "sample-level DP, ε=" in markdown_table([summarise(tmp_path / "run")])


@pytest.mark.parametrize("algorithm", ["fedprox", "fedadam", "fedavgm"])
def test_client_level_server_steps_resume_bit_identical(tmp_path: Path, algorithm: str) -> None:
    """FedProx, FedAdam and FedAvgM under client-level DP with adaptive clipping: 2 rounds + a
    resume end bit-identical to 3 rounds (server optimiser state, clip and accountant checkpointed)."""
    from hpcfl.config import load_config
    from hpcfl.runner import run_experiment

    cfg = _client_cfg(
        tmp_path,
        algorithm=algorithm,
        privacy={"adaptive_clip": {"target_quantile": 0.5, "count_stddev": 2.0}},
        dataset_options={"n_train": 400, "n_test": 40, "seed": 3},
    )
    full = run_experiment(load_config(cfg), tmp_path / "full")
    run_experiment(load_config(cfg, ["rounds=2"]), tmp_path / "part")
    resumed = run_experiment(load_config(cfg), tmp_path / "part", resume=True)
    assert torch.equal(resumed.server.x, full.server.x)
    assert torch.equal(resumed.server.dp_clip, full.server.dp_clip)
    assert torch.equal(resumed.server.dp_steps, full.server.dp_steps) and float(full.server.dp_steps[0]) == 3
    assert [r["epsilon"] for r in _rows(tmp_path / "part")] == [
        r["epsilon"] for r in _rows(tmp_path / "full")
    ]


def test_a_round_without_participants_is_noised_and_accounted(tmp_path: Path) -> None:
    """Poisson sampling may draw nobody: the round still releases noise and counts one step."""
    from hpcfl.config import load_config
    from hpcfl.runner import run_experiment

    cfg = _client_cfg(
        tmp_path, clients_per_round=1, rounds=3, dataset_options={"n_train": 400, "n_test": 40, "seed": 3}
    )
    run_experiment(load_config(cfg), tmp_path / "run")
    rows = _rows(tmp_path / "run")
    assert [r["participants"] for r in rows][2] == []  # seed 7 draws nobody in round 3
    assert rows[2]["epsilon"] > rows[1]["epsilon"]
    assert "local_loss" not in rows[2]


def test_prv_accountant_is_opacus_prv() -> None:
    """accountant: prv gives exactly Opacus's PRVAccountant for the same (σ, q, steps)."""
    from opacus.accountants import PRVAccountant

    from hpcfl.privacy import accountant

    acc = PRVAccountant()
    acc.history = [(1.1, 0.05, 200)]
    assert accountant.epsilon(1.1, 0.05, 200, 1e-5, "prv") == acc.get_epsilon(delta=1e-5)
    assert accountant.epsilon(1.1, 0.05, 300, 1e-5, "prv") > accountant.epsilon(1.1, 0.05, 200, 1e-5, "prv")


@pytest.mark.parametrize("option", ["--sessions", "--overhead-repeats", "--steps"])
def test_privacy_benchmark_refuses_a_zero_count(tmp_path: Path, option: str) -> None:
    """A count of 0 (sessions, overhead pairs, timed steps) would leave nothing to take a median
    of: refused in one line before any worker or run starts."""
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "privacy.py"),
            option,
            "0",
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert f"{option} must be >= 1, got 0" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_privacy_benchmark_floor_covers_every_trained_layer(tmp_path: Path) -> None:
    """The floor part times every trained layer once, in the cheapest forms the cost model leaves,
    and sums the non-negative extras (the figure that bounds the Opacus ratio)."""
    import sys

    out = tmp_path / "out"
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "privacy.py"), "--parts", "floor", "--models", "simplecnn",
         "--batch", "16", "--threads", "1", "--out", str(out)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    f = json.loads((out / "privacy.json").read_text())["floor"]["simplecnn"]
    assert [r["layer"] for r in f["layers"]] == ["conv1", "conv2", "conv3", "fc1", "classifier"]
    assert all(r["extra_ms"] >= 0 and r["dp_ms"] for r in f["layers"])
    assert f["floor_ms"] == pytest.approx(sum(r["extra_ms"] for r in f["layers"]))
    assert set(f["layers"][2]["dp_ms"]) <= {"materialise", "ghost-unfold"}  # strided: no ghost-shift
    assert f["step_ms"]["nonprivate"] > 0 and f["step_ms"]["hpcfl"] > 0
