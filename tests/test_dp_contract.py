"""The DP contract (issue 51): every way an algorithm can train is private under both DP levels, or
refused in one line before the first round; every public training entry point of the trainer is
DP-SGD under sample-level DP.

The ways a plugin can train: a declared :class:`LocalTask`; a call of the trainer inside
``local_task`` (a Ditto/FedRep-style first phase); its own ``client_update``. Each probe plugin
below does FedAvg's local work in one of these ways, so under either DP level its run must equal
FedAvg's under that level bit for bit (the same clipping, noise and accounting), and a plugin that
trains twice per round must be accounted for both phases.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import hpcfl
from hpcfl.algorithms import FedAvg
from hpcfl.algorithms.base import (
    ClientState,
    Exchange,
    LocalTask,
    Stage,
    SumSpec,
    Upload,
    model_upload,
    read_phases,
)
from hpcfl.config import config_from_dict
from hpcfl.errors import ConfigError
from hpcfl.registry import ALGORITHMS
from hpcfl.runner import run_experiment
from tests.helpers import hpcfl_cmd, repo_env, write_config

opacus = pytest.importorskip("opacus")

LEVELS = ("sample", "client")


# -- the probe plugins ------------------------------------------------------------------------------


class PhaseInLocalTask(FedAvg):
    """FedAvg's local training done by a trainer call inside ``local_task``; the declared task that
    follows takes no step (the probe's "silently not private" plugin)."""

    name = "dp_probe_phase"
    dp_levels = ("client", "sample")

    def local_task(self, server, client, data, ctx):
        y, run = ctx.trainer.train_tallies(server.x, data, ctx.generator)
        none = dataclasses.replace(ctx.trainer.schedule, steps=0)
        return LocalTask(
            y, lambda y2, _: (model_upload(y2, data, read_phases(data, run)), client), schedule=none
        )


class InClientUpdate(FedAvg):
    """FedAvg's local training in its own ``client_update`` (the probe's crash)."""

    name = "dp_probe_update"
    dp_levels = ("client", "sample")

    def local_task(self, server, client, data, ctx):
        return None

    def client_update(self, server, client, data, ctx):
        y, run = ctx.trainer.train_tallies(server.x, data, ctx.generator)
        return model_upload(y, data, read_phases(data, run)), client


class TwoPhasesInLocalTask(FedAvg):
    """A first phase through the trainer inside ``local_task``, then a declared task from its model."""

    name = "dp_probe_two_task"
    dp_levels = ("client", "sample")

    def local_task(self, server, client, data, ctx):
        y, _ = ctx.trainer.train_tallies(server.x, data, ctx.generator)
        return LocalTask(y, lambda y2, result: (model_upload(y2, data, result), client))


class TwoPhasesInClientUpdate(FedAvg):
    """:class:`TwoPhasesInLocalTask`'s work in ``client_update``: two trainer calls."""

    name = "dp_probe_two_update"
    dp_levels = ("client", "sample")

    def local_task(self, server, client, data, ctx):
        return None

    def client_update(self, server, client, data, ctx):
        y, first = ctx.trainer.train_tallies(server.x, data, ctx.generator)
        y, second = ctx.trainer.train_tallies(y, data, ctx.generator)
        return model_upload(y, data, read_phases(data, second, first)), client


@dataclass
class OwnModel(ClientState):
    v: torch.Tensor | None = None


class Personal(InClientUpdate):
    """:class:`InClientUpdate` judged by each client's own last local model."""

    name = "dp_probe_personal"
    personalised = True

    def init_client(self, k, server):
        return OwnModel(v=server.x.clone())

    def personal_model(self, server, client, data, ctx):
        return client.v

    def client_update(self, server, client, data, ctx):
        upload, _ = super().client_update(server, client, data, ctx)
        return upload, OwnModel(v=upload.sums["x"].clone())


class ExtraSum(FedAvg):
    """Uploads a second sum beside the model, which the client-level clip cannot bound."""

    name = "dp_probe_extra"
    dp_levels = ("client", "sample")

    def exchange(self, dtype=torch.float32):
        return Exchange(
            sums=(SumSpec("x", self.state_size, dtype), SumSpec("seen", 1, dtype, weighted=False))
        )

    def local_task(self, server, client, data, ctx):
        def finish(y, result):
            seen = torch.full((1,), float(data.n), dtype=y.dtype, device=y.device)
            return Upload(
                sums={"x": y, "seen": seen}, weight=float(data.n), metrics={"loss": result.loss}
            ), client

        return LocalTask(server.x, finish)


class SecondStage(FedAvg):
    """A second stage whose algorithm the stage hook builds: outside the privacy wrapper."""

    name = "dp_probe_stages"
    dp_levels = ("client", "sample")

    def stages(self):
        return (Stage("train", -1), Stage("second", 1, enter="somewhere:enter"))


PROBES = (
    PhaseInLocalTask,
    InClientUpdate,
    TwoPhasesInLocalTask,
    TwoPhasesInClientUpdate,
    Personal,
    ExtraSum,
    SecondStage,
)


@pytest.fixture(scope="module", autouse=True)
def _probes():
    for cls in PROBES:
        hpcfl.register_algorithm(cls)
    yield
    for cls in PROBES:
        ALGORITHMS._registered.pop(cls.name, None)
        ALGORITHMS._loaded.pop(cls.name, None)


def _config(level: str, algorithm: str, **over) -> dict:
    """A small synthetic run under ``level`` DP (client level: 4 of 8 clients sampled)."""
    privacy = {"level": level, "noise_multiplier": 1.1, "clip": 0.5}
    keys = dict(
        name="dp",
        dataset="synthetic",
        dataset_options={"n_train": 400, "n_test": 80, "seed": 3, "input_shape": [1, 8, 8]},
        partition="dir:0.5",
        num_clients=8 if level == "client" else 3,
        clients_per_round=4 if level == "client" else None,
        model="mlp",
        algorithm=algorithm,
        rounds=2,
        local_epochs=1,
        lr=0.05,
        momentum=0.0,
        batch_size=50,
        seed=7,
        threads=1,
        progress=False,
        privacy=privacy,
    )
    keys.update(over)
    return keys


def _run(tmp_path: Path, name: str, cfg: dict):
    result = run_experiment(config_from_dict(cfg), tmp_path / name)
    assert result.finished
    return result


def _epsilons(result) -> list[float]:
    return [r["epsilon"] for r in result.metrics]


# -- the probe's three findings -------------------------------------------------------------------


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("probe", [PhaseInLocalTask, InClientUpdate, FedAvg], ids=lambda c: c.name)
def test_each_way_of_training_fedavgs_work_is_fedavg_under_dp(tmp_path: Path, probe, level: str) -> None:
    """A trainer call inside ``local_task`` (before: no clipping, no noise, the model ``torch.equal``
    to the run without privacy while ε was reported) and a ``client_update`` (before:
    ``NotImplementedError: Private must define client_update or local_task``) are, at either level,
    FedAvg's private run: the same final model and the same ε every round."""
    reference = _run(tmp_path, "reference", _config(level, "fedavg"))
    probed = _run(tmp_path, "probed", _config(level, probe.name))
    assert torch.equal(probed.server.x, reference.server.x)
    assert _epsilons(probed) == _epsilons(reference) and len(_epsilons(probed)) == 2
    plain = _run(tmp_path, "plain", {**_config(level, probe.name), "privacy": {"level": "none"}})
    assert not torch.equal(probed.server.x, plain.server.x)  # clipped and noised


def test_a_first_phase_through_the_trainer_is_noised_and_accounted(tmp_path: Path) -> None:
    """Two local phases per round, the first through the trainer inside ``local_task``: both are
    DP-SGD (the run equals the same two phases in ``client_update``) and ε is Opacus's for every
    step taken, 2 × ⌈n_k/B⌉ per round (before: the first phase neither noised nor accounted)."""
    from opacus.accountants import RDPAccountant

    task = _run(tmp_path, "task", _config("sample", TwoPhasesInLocalTask.name))
    update = _run(tmp_path, "update", _config("sample", TwoPhasesInClientUpdate.name))
    assert torch.equal(task.server.x, update.server.x)
    sizes = [
        int(c["size"]) for c in json.loads((tmp_path / "task" / "partition.json").read_text())["clients"]
    ]
    for rnd, (a, b) in enumerate(zip(_epsilons(task), _epsilons(update), strict=True), start=1):
        expected = []
        for n in sizes:
            acc = RDPAccountant()
            acc.history = [(1.1, min(1.0, 50 / n), rnd * 2 * math.ceil(n / 50))]
            expected.append(acc.get_epsilon(delta=1e-5))
        assert a == b == max(expected)
    assert torch.equal(task.server.dp_steps, update.server.dp_steps)
    assert task.server.dp_steps.tolist() == [2 * 2 * math.ceil(n / 50) for n in sizes]


def test_a_personalised_plugin_keeps_its_personal_columns_under_client_level_dp(tmp_path: Path) -> None:
    """Before: the privacy wrapper did not forward ``personalised`` / ``personal_model``, so the
    ``personal_acc_*`` columns were silently missing. Each client's own model is scored."""
    result = _run(tmp_path, "personal", _config("client", Personal.name, client_eval=0.25))
    row = result.metrics[-1]
    assert {"personal_acc_mean", "personal_acc_p10", "client_acc_mean"} <= set(row)
    clients = [
        json.loads(line) for line in (tmp_path / "personal" / "client_metrics.jsonl").read_text().splitlines()
    ]
    scored = clients[-1]["clients"]
    assert scored and all("personal_accuracy" in entry for entry in scored.values())


# -- refusals before the first round ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("probe", "level", "words"),
    [
        (ExtraSum, "client", "its upload holds 'seen' beside the model x"),
        (SecondStage, "client", "its stage 'second' runs an algorithm of its own"),
        (SecondStage, "sample", "its stage 'second' runs an algorithm of its own"),
    ],
)
def test_what_the_wrapper_cannot_bound_is_refused_in_one_line(tmp_path: Path, probe, level, words) -> None:
    with pytest.raises(ConfigError) as err:
        run_experiment(config_from_dict(_config(level, probe.name)), tmp_path / "run")
    text = str(err.value)
    assert "\n" not in text and f"algorithm {probe.name!r}" in text and words in text, text
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_unboundable_upload_with_sample_level_dp_is_private(tmp_path: Path) -> None:
    """At sample level the upload is post-processing of DP-SGD models: a second sum is fine."""
    result = _run(tmp_path, "extra", _config("sample", ExtraSum.name))
    reference = _run(tmp_path, "reference", _config("sample", "fedavg"))
    assert torch.equal(result.server.x, reference.server.x) and _epsilons(result) == _epsilons(reference)


def test_the_refusal_is_one_line_from_the_command(tmp_path: Path) -> None:
    """``hpcfl run`` with a plugin (``imports:``) whose upload cannot be bounded at client level:
    one line naming the algorithm and the reason, a non-zero exit, no traceback, no round run."""
    (tmp_path / "unbounded.py").write_text(
        textwrap.dedent(
            """
            import torch
            import hpcfl
            from hpcfl.algorithms import FedAvg
            from hpcfl.algorithms.base import Exchange, SumSpec

            @hpcfl.register_algorithm
            class Unbounded(FedAvg):
                name = "unbounded"
                dp_levels = ("client",)

                def exchange(self, dtype=torch.float32):
                    return Exchange(sums=(SumSpec("x", self.state_size, dtype),), gathers=("labels",))
            """
        )
    )
    cfg = write_config(tmp_path / "cfg.yaml", **_config("client", "unbounded"), imports=["unbounded"])
    env = repo_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env.get('PYTHONPATH', '')}"
    proc = subprocess.run(
        hpcfl_cmd("run", str(cfg), "--run-dir", str(tmp_path / "run")),
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode not in (0, 75) and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and "algorithm 'unbounded'" in lines[0] and "gathers 'labels'" in lines[0], lines
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# -- every public training entry point of the trainer is DP-SGD ------------------------------------

CLIP, SIGMA = 0.05, 1.3  # a clip every sample's gradient exceeds


def _schedule(**over):
    from hpcfl.training.sgd import LocalSchedule

    keys = dict(lr=0.1, batch_size=10, epochs=2, momentum=0.5, weight_decay=1e-3)
    keys.update(over)
    return LocalSchedule(**keys)


def _federation():
    """A float64 MLP, its DP trainer, and two clients' data."""
    from hpcfl.algorithms.base import ClientData
    from hpcfl.models import build_model
    from hpcfl.privacy.sgd import DPTrainer
    from hpcfl.training.flat import FlatModel

    torch.manual_seed(0)
    model = build_model("mlp", (1, 6, 6), 4).double()
    pristine = copy.deepcopy(model)
    trainer = DPTrainer(FlatModel(model), _schedule(), clip=CLIP, noise_multiplier=SIGMA)
    g = torch.Generator().manual_seed(1)
    clients = [
        ClientData(
            k,
            torch.randn(n, 1, 6, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 4, (n,), generator=g),
        )
        for k, n in ((0, 40), (1, 33))
    ]
    return pristine, trainer, clients


def _opacus(pristine, data, schedule, seed: int, monkeypatch, sigma: float = SIGMA) -> torch.Tensor:
    """Opacus's DP-SGD of client ``data`` from the initial model: ``GradSampleModule`` and
    ``DPOptimizer`` over ``torch.optim.SGD`` (momentum, weight decay), on the Poisson batches the
    client's generator (seed ``seed``) draws, each sample in with q = B/n, and the noise the same
    generator draws next (a standard normal vector per step, in the flat layout; Opacus's noise
    function is handed its slices, times its σC). The final parameters, flattened."""
    import opacus.optimizers.optimizer as dp_optimizer
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    n = data.n
    q = min(1.0, schedule.batch_size / n)
    gen = torch.Generator().manual_seed(seed)
    batches = [
        torch.nonzero(torch.rand(n, generator=gen, dtype=torch.float64) < q).flatten()
        for _ in range(schedule.num_steps(n))
    ]
    model = GradSampleModule(copy.deepcopy(pristine), loss_reduction="sum")
    params = [p for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    slices: list[torch.Tensor] = []

    def noise(std, reference, generator=None, secure_mode=False):
        return slices.pop(0).view_as(reference) * std

    monkeypatch.setattr(dp_optimizer, "_generate_noise", noise)
    sgd = torch.optim.SGD(
        params, lr=schedule.lr, momentum=schedule.momentum, weight_decay=schedule.weight_decay, foreach=False
    )
    optimizer = DPOptimizer(
        sgd, noise_multiplier=sigma, max_grad_norm=CLIP, expected_batch_size=q * n, loss_reduction="mean"
    )
    clipped = False
    for idx in batches:
        assert idx.numel() > 0, "pick a seed without an empty Poisson batch"
        draw = torch.randn(total, generator=gen, dtype=torch.float64)
        slices[:] = list(draw.split([p.numel() for p in params]))
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(data.x[idx]), data.y[idx], reduction="sum").backward()
        norms = torch.cat([p.grad_sample.flatten(1) for p in params], dim=1).norm(dim=1)
        clipped |= bool((norms > CLIP).any())
        optimizer.step()
    assert clipped and not slices
    return torch.cat([p.detach().flatten() for p in params])


def _with_torch_sgd(trainer, x0, data, gen, schedule):
    """An algorithm's own loop over the trainer's steps, stepping with ``torch.optim.SGD``."""
    flat = trainer.flat
    flat.load(x0)
    sgd = torch.optim.SGD(
        flat.model.parameters(),
        lr=schedule.lr,
        momentum=schedule.momentum,
        weight_decay=schedule.weight_decay,
        foreach=False,
    )
    steps = trainer.steps(data, gen)
    for batch in steps:
        g = steps.gradient(batch)
        flat.grad.copy_(g)
        sgd.step()
    return flat.vector.clone()


def _task(x0):
    return LocalTask(x0, lambda y, result: (y, result))


#: how each public training method of the trainer is called: (trainer, x0, clients, seeds) → the
#: final state of each client trained (and the schedule it trained under)
ENTRY_POINTS = {
    "train": lambda t, x0, c, s: [t.train(x0, c[0], _gen(s[0]))[0]],
    "train_tallies": lambda t, x0, c, s: [t.train_tallies(x0, c[0], _gen(s[0]))[0]],
    "run": lambda t, x0, c, s: [t.run(_task(x0), c[0], _gen(s[0]))[0]],
    "run_many": lambda t, x0, c, s: [
        y for y, _ in t.run_many([_task(x0), _task(x0)], c, [_gen(s[0]), _gen(s[1])])
    ],
    "steps": lambda t, x0, c, s: [_with_torch_sgd(t, x0, c[0], _gen(s[0]), t.schedule)],
    "with_schedule": lambda t, x0, c, s: [
        t.with_schedule(_schedule(epochs=1)).train(x0, c[0], _gen(s[0]))[0]
    ],
    "recording": lambda t, x0, c, s: [t.recording().train(x0, c[0], _gen(s[0]))[0]],
}
#: the public methods that train nothing
NOT_TRAINING = {"can_batch"}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _public_methods(cls: type) -> set[str]:
    import inspect

    return {name for name, _ in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}


def test_every_public_training_method_of_the_trainer_is_listed() -> None:
    """Introspection: a public method added to the trainer (or to the DP trainer) fails here until
    it is listed, and so checked by the test below (or named as training nothing)."""
    from hpcfl.algorithms import Trainer
    from hpcfl.privacy.sgd import DPTrainer

    assert _public_methods(DPTrainer) == set(ENTRY_POINTS) | NOT_TRAINING
    assert _public_methods(Trainer) <= _public_methods(DPTrainer)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_each_public_training_method_is_opacus_dp_sgd(name: str, monkeypatch) -> None:
    """Under sample-level DP every public way to train (each method of the trainer, a loop of the
    algorithm's own over ``steps``, a trainer with another schedule, a recording one) is Opacus's
    DP-SGD at float64: the same Poisson batches, every per-sample gradient clipped to C, the same
    N(0, (σC)²) noise, over qn, then torch's SGD step (momentum, weight decay); the steps taken are
    counted when recording."""
    pristine, trainer, clients = _federation()
    x0 = trainer.flat.vector.clone()
    seeds = (5, 11)
    ours = ENTRY_POINTS[name](trainer, x0, clients, seeds)
    schedule = _schedule(epochs=1) if name == "with_schedule" else trainer.schedule
    for y, data, seed in zip(ours, clients[: len(ours)], seeds[: len(ours)], strict=True):
        expected = _opacus(pristine, data, schedule, seed, monkeypatch)
        torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-12)
        unnoised = _opacus(pristine, data, schedule, seed, monkeypatch, sigma=0.0)
        assert not torch.allclose(y, unnoised, rtol=1e-3, atol=1e-6)  # the noise is there
    if name == "recording":
        recording = trainer.recording()
        recording.with_schedule(_schedule(epochs=3)).train(x0, clients[1], _gen(3))
        recording.train_tallies(x0, clients[1], _gen(3))
        assert recording.ledger.steps == 3 * 4 + 2 * 4 and trainer.ledger is None


def test_a_step_that_differentiates_two_models_is_one_jointly_clipped_release() -> None:
    """``steps.gradients`` (APFL's two gradients from one mini-batch) under DP: each sample's pair of
    gradients is clipped together to C (one release of sensitivity C, accounted as one step), each
    sum noised: equal at float64 to a per-sample autograd loop."""
    from hpcfl.privacy.sgd import OPACUS_EPS

    _, trainer, clients = _federation()
    flat, data = trainer.flat, clients[0]
    a = flat.vector.clone()
    b = a + 0.3 * torch.randn(a.shape, generator=_gen(2), dtype=a.dtype)
    steps = trainer.steps(data, _gen(5))
    batch = next(iter(steps))
    (ga, sa), (gb, sb) = steps.gradients(batch, (a, b))
    per_sample = []
    for i in batch.tolist():
        pair = []
        for state in (a, b):
            flat.load(state)
            flat.grad.zero_()
            torch.nn.functional.cross_entropy(flat.model(data.x[i : i + 1]), data.y[i : i + 1]).backward()
            pair.append(flat.grad.clone())
        per_sample.append(pair)
    norms = torch.stack([torch.cat(pair).norm() for pair in per_sample])
    factor = (CLIP / (norms + OPACUS_EPS)).clamp(max=1.0)
    assert bool((norms > CLIP).all())
    replica = _gen(5)
    for _ in range(len(steps)):  # the Poisson draws come first, then the noise, state by state
        torch.rand(data.n, generator=replica, dtype=torch.float64)
    q = trainer.schedule.batch_size / data.n
    for j, got in enumerate((ga, gb)):
        clipped = sum(f * pair[j] for f, pair in zip(factor, per_sample, strict=True))
        noise = torch.randn(a.shape, generator=replica, dtype=a.dtype) * (SIGMA * CLIP)
        torch.testing.assert_close(got, (clipped + noise) / (q * data.n), rtol=1e-10, atol=1e-12)
    assert torch.equal(sa, a) and torch.equal(sb, b)
    tallies = steps.tallies(torch.tensor(True))
    assert int(tallies.finite_steps) == 1 and tallies.mean_over == sum(int(t.numel()) for t in steps.drawn)


def test_a_local_training_at_another_batch_size_is_refused_in_one_line() -> None:
    """Under DP-SGD the batch size is the accountant's sampling rate q_k = B/n_k: a trainer call
    with another one is refused (one line) instead of sampling at a rate nobody accounts."""
    _, trainer, clients = _federation()
    with pytest.raises(ConfigError) as err:
        trainer.train_tallies(
            trainer.flat.vector.clone(), clients[0], _gen(1), schedule=_schedule(batch_size=20)
        )
    text = str(err.value)
    assert "\n" not in text and "batch_size 20" in text and "(10/n_k)" in text


def test_the_budget_expects_the_steps_a_client_actually_takes(tmp_path: Path) -> None:
    """``epsilon_budget`` stops a run before a round that would exceed it, expecting each client to
    take the most steps it took in one round: two phases per round are 2 × ⌈n_k/B⌉ steps, so with a
    budget between ε after 3 and after 4 phases the run stops after its first round (expecting one
    phase, it would run a second and end above the budget)."""
    from opacus.accountants import RDPAccountant

    probe = _run(tmp_path, "probe", _config("sample", TwoPhasesInLocalTask.name, rounds=1))
    sizes = [
        int(c["size"]) for c in json.loads((tmp_path / "probe" / "partition.json").read_text())["clients"]
    ]

    def worst(phases: int) -> float:
        out = []
        for n in sizes:
            acc = RDPAccountant()
            acc.history = [(1.1, min(1.0, 50 / n), phases * math.ceil(n / 50))]
            out.append(acc.get_epsilon(delta=1e-5))
        return max(out)

    assert _epsilons(probe) == [worst(2)]
    budget = (worst(3) + worst(4)) / 2
    privacy = {"level": "sample", "noise_multiplier": 1.1, "clip": 0.5, "epsilon_budget": budget}
    result = run_experiment(
        config_from_dict(_config("sample", TwoPhasesInLocalTask.name, rounds=3, privacy=privacy)),
        tmp_path / "budget",
    )
    assert result.budget_stop is not None and _epsilons(result) == [worst(2)]
