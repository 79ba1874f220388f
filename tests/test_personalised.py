"""Personalised FL (issue 41): FedBN, FedPer, FedRep, FedBABU, Ditto, APFL and FedUV.

Each client step and server step against a direct transcription of its paper's algorithm box on a
small float64 model (torch.optim.SGD over the parameters the box trains, 1e-10), the settings that
must reduce to FedAvg (bit for bit), bad settings refused with one line, and the per-client
evaluation of the clients' own models. Resume, kill -9, 1 vs 2 ranks, bytes and client batching are
the contract suite's (tests/test_contract.py), which runs every personalised algorithm with
``client_eval`` and compares the per-client accuracies of their personal models too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from hpcfl.algorithms import ALGORITHMS, ClientContext, FedAvg, Trainer
from hpcfl.algorithms.base import Aggregate, ClientData, ServerContext
from hpcfl.algorithms.participation import Participation, Population
from hpcfl.cli.main import main
from hpcfl.config import config_from_dict
from hpcfl.errors import ConfigError
from hpcfl.runner import run_experiment
from hpcfl.training import FlatModel, LocalSchedule
from hpcfl.training.layout import StateLayout
from hpcfl.training.sgd import batch_indices
from tests.helpers import simulate, synthetic_config, write_config

TOL = dict(rtol=1e-10, atol=1e-10)
LR, MOMENTUM, WD = 0.05, 0.5, 1e-3


def _model() -> nn.Module:
    """Conv + BatchNorm body, a hidden Linear, and the ``classifier`` head; float64."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("conv", nn.Conv2d(1, 3, 3, padding=1))
    model.add_module("bn", nn.BatchNorm2d(3))
    model.add_module("relu", nn.ReLU())
    model.add_module("flat", nn.Flatten())
    model.add_module("fc", nn.Linear(3 * 6 * 6, 8))
    model.add_module("relu2", nn.ReLU())
    model.add_module("classifier", nn.Linear(8, 3))
    return model.double()


def _mlp() -> nn.Module:
    """No normalisation layer."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("flat", nn.Flatten())
    model.add_module("fc", nn.Linear(36, 8))
    model.add_module("relu", nn.ReLU())
    model.add_module("classifier", nn.Linear(8, 3))
    return model.double()


def _clients(K: int = 3) -> list[ClientData]:
    """Label-skewed clients of different sizes (client k mostly class k % 3)."""
    g = torch.Generator().manual_seed(5)
    out = []
    for k in range(K):
        n = 14 + 5 * k
        y = torch.where(torch.rand(n, generator=g) < 0.8, k % 3, torch.randint(0, 3, (n,), generator=g))
        x = torch.randn(n, 1, 6, 6, generator=g, dtype=torch.float64) + y.view(-1, 1, 1, 1)
        out.append(ClientData(k, x, y))
    return out


def _schedule(steps: int = 3) -> LocalSchedule:
    return LocalSchedule(lr=LR, batch_size=8, steps=steps, momentum=MOMENTUM, weight_decay=WD)


def _algo(name: str, model: nn.Module, **params):
    cls = ALGORITHMS[name]
    return cls(cls.Params(**params), layout=StateLayout.of_model(model))


def _ctx(trainer: Trainer, seed: int = 11) -> ClientContext:
    return ClientContext(0, (0,), Population((1,)), trainer, torch.Generator().manual_seed(seed))


def _state(model: nn.Module) -> torch.Tensor:
    return FlatModel(model).vector.clone()


def _reference_sgd(
    model: nn.Module, params: list[nn.Parameter], data: ClientData, steps: int, seed: int
) -> None:
    """The algorithm box's local update: ``torch.optim.SGD`` over ``params`` on the batches
    :func:`batch_indices` draws from ``seed`` (the data order is the runner's, not the method's)."""
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WD)
    model.train()
    for idx in batch_indices(data.n, _schedule(steps), torch.Generator().manual_seed(seed)):
        opt.zero_grad()
        nn.functional.cross_entropy(model(data.x[idx]), data.y[idx]).backward()
        opt.step()


def _load(model: nn.Module, x: torch.Tensor) -> nn.Module:
    FlatModel(model).load(x)
    return model


def _randomised(x: torch.Tensor, seed: int = 3) -> torch.Tensor:
    """A state vector after some rounds: every entry moved (running variances kept positive)."""
    g = torch.Generator().manual_seed(seed)
    return x + 0.1 * torch.rand(x.shape, generator=g, dtype=x.dtype)


# -- FedBN -----------------------------------------------------------------------------------------


def test_fedbn_client_step_trains_from_its_own_bn_and_uploads_the_rest():
    """Algorithm 1: the client's model is the averaged non-BN layers with its own BN layers (weight,
    bias, running statistics); it trains all of them, uploads the non-BN ones, keeps the BN ones."""
    model = _model()
    algo = _algo("fedbn", model)
    server = algo.init_server(_randomised(_state(model)))
    own = _randomised(server.x, seed=4)  # a client whose BN layers differ from the server's
    client = algo.init_client(0, server)
    client.bn = algo.split.kept_of(own)
    trainer = Trainer(FlatModel(_model()), _schedule())
    upload, new = algo.client_update(server, client, _clients()[0], _ctx(trainer))

    ref = _model()
    start = server.x.clone()
    bn = dict(ref.named_modules())["bn"]
    _load(ref, start)
    own_model = _load(_model(), own)
    bn.load_state_dict(dict(own_model.named_modules())["bn"].state_dict())
    _reference_sgd(ref, list(ref.parameters()), _clients()[0], 3, 11)
    y = _state(ref)
    torch.testing.assert_close(upload.sums["x"], algo.split.shared_of(y), **TOL)
    torch.testing.assert_close(new.bn, algo.split.kept_of(y), **TOL)
    assert upload.sums["x"].numel() == algo.state_size - 2 * 3 - 2 * 3  # BN weight, bias, mean, var


def test_fedbn_server_step_averages_the_non_bn_layers_only():
    model = _model()
    algo = _algo("fedbn", model)
    server = algo.init_server(_randomised(_state(model)))
    total = torch.randn(algo.split.shared_size, dtype=torch.float64)
    new, _ = algo.server_update(server, Aggregate({"x": total}, 4.0, 2), _server_ctx())
    torch.testing.assert_close(algo.split.shared_of(new.x), total / 4.0, **TOL)
    assert torch.equal(algo.split.kept_of(new.x), algo.split.kept_of(server.x))


@pytest.mark.parametrize("per_round", [None, 2])
def test_fedbn_on_a_model_without_normalisation_layers_is_fedavg_bit_for_bit(per_round):
    runs = []
    for cls in (ALGORITHMS["fedbn"], FedAvg):
        model = _mlp()
        algo = cls(
            cls.Params(), layout=StateLayout.of_model(model), participation=Participation(count=per_round)
        )
        server, _ = simulate(algo, _clients(), Trainer(FlatModel(model), _schedule()), 3, reduction="float64")
        runs.append(server.x)
    assert torch.equal(*runs)


def _server_ctx() -> ServerContext:
    return ServerContext(0, (0, 1), Population((5, 6, 7)), lambda t: t)


# -- FedPer / FedRep -------------------------------------------------------------------------------


def test_fedper_client_step_trains_body_and_head_together_from_its_own_head():
    """Arivazhagan et al., Algorithm 1: start from (W_B, W_{P_k}), SGD on both, send W_B back."""
    model = _model()
    algo = _algo("fedper", model)
    server = algo.init_server(_randomised(_state(model)))
    client = algo.init_client(0, server)
    client.head = algo.split.kept_of(_randomised(server.x, seed=9))
    trainer = Trainer(FlatModel(_model()), _schedule())
    upload, new = algo.client_update(server, client, _clients()[1], _ctx(trainer))

    ref = _load(_model(), algo.split.with_kept(server.x, client.head))
    _reference_sgd(ref, list(ref.parameters()), _clients()[1], 3, 11)
    y = _state(ref)
    torch.testing.assert_close(upload.sums["x"], algo.split.shared_of(y), **TOL)
    torch.testing.assert_close(new.head, algo.split.kept_of(y), **TOL)
    head_size = 8 * 3 + 3
    assert new.head.numel() == head_size and upload.sums["x"].numel() == algo.state_size - head_size


def test_fedrep_client_step_is_head_epochs_then_body_epochs():
    """Collins et al., Algorithm 1: τ_h steps on the head with the body frozen, then τ_φ steps on
    the body with the new head frozen (each with an optimiser of its own)."""
    model = _model()
    algo = _algo("fedrep", model, head_epochs=2, body_epochs=1)
    server = algo.init_server(_randomised(_state(model)))
    client = algo.init_client(0, server)
    client.head = algo.split.kept_of(_randomised(server.x, seed=9))
    trainer = Trainer(FlatModel(_model()), _schedule(steps=3))
    upload, new = algo.client_update(server, client, _clients()[2], _ctx(trainer, seed=13))

    ref = _load(_model(), algo.split.with_kept(server.x, client.head))
    gen = torch.Generator().manual_seed(13)  # both phases draw from the client's one generator
    head = list(ref.classifier.parameters())
    body = [p for name, p in ref.named_parameters() if not name.startswith("classifier")]
    for params, steps in ((head, 6), (body, 3)):
        opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WD)
        ref.train()
        for idx in batch_indices(_clients()[2].n, _schedule(steps), gen):
            opt.zero_grad()
            nn.functional.cross_entropy(ref(_clients()[2].x[idx]), _clients()[2].y[idx]).backward()
            opt.step()
    y = _state(ref)
    torch.testing.assert_close(upload.sums["x"], algo.split.shared_of(y), **TOL)
    torch.testing.assert_close(new.head, algo.split.kept_of(y), **TOL)


@pytest.mark.parametrize("name", ["fedper", "fedrep"])
def test_head_split_server_step_averages_the_body_and_keeps_the_initial_head(name):
    model = _model()
    algo = _algo(name, model)
    server = algo.init_server(_randomised(_state(model)))
    total = torch.randn(algo.split.shared_size, dtype=torch.float64)
    new, _ = algo.server_update(server, Aggregate({"x": total}, 3.0, 2), _server_ctx())
    torch.testing.assert_close(algo.split.shared_of(new.x), total / 3.0, **TOL)
    assert torch.equal(algo.split.kept_of(new.x), algo.split.kept_of(server.x))


@pytest.mark.parametrize("name", ["fedper", "fedrep"])
def test_a_client_is_judged_by_the_global_body_with_its_own_head(name):
    model = _model()
    algo = _algo(name, model)
    server = algo.init_server(_randomised(_state(model)))
    fresh = algo.init_client(0, server)
    assert torch.equal(algo.personal_model(server, fresh, _clients()[0], _ctx(None)), server.x)
    trained = algo.init_client(0, server)
    trained.head = torch.arange(algo.split.kept_size, dtype=torch.float64)
    mine = algo.personal_model(server, trained, _clients()[0], _ctx(None))
    assert torch.equal(algo.split.shared_of(mine), algo.split.shared_of(server.x))
    assert torch.equal(algo.split.kept_of(mine), trained.head)


@pytest.mark.parametrize(
    ("name", "head", "fragment"),
    [
        ("fedper", "clasifier", "unknown module 'clasifier'"),
        ("fedrep", "[fc1, classifier]", "is the whole model"),
    ],
)
def test_a_bad_head_is_one_line_before_any_round(tmp_path, capsys, name, head, fragment):
    cfg = synthetic_config(tmp_path, algorithm=name)
    code = main(["run", str(cfg), "--run-dir", str(tmp_path / "r"), "--set", f"params.head={head}"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and lines[-1].startswith("hpcfl: error:") and fragment in lines[-1], err
    assert "Traceback" not in err and not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.parametrize(("key", "value"), [("head_epochs", -1), ("body_epochs", 0)])
def test_fedrep_refuses_bad_epoch_counts(key, value):
    with pytest.raises(ConfigError, match=key):
        ALGORITHMS["fedrep"].Params(**{key: value})


# -- per-client evaluation of the personal models ---------------------------------------------------


_PERSONAL_RUN = dict(
    dataset="synthetic",
    dataset_options={"n_train": 240, "n_test": 60, "seed": 3, "input_shape": [1, 8, 8], "num_classes": 4},
    partition="dir:0.3",
    num_clients=4,
    model="mlp",
    rounds=3,
    local_steps=3,
    lr=0.1,
    batch_size=16,
    seed=5,
    threads=1,
    progress=False,
    client_eval=0.25,
)


def _personal_run(tmp_path: Path, name: str, **extra) -> tuple[list[dict], list[dict]]:
    cfg = {**_PERSONAL_RUN, "name": name, "algorithm": name, **extra}
    run_dir = tmp_path / name
    result = run_experiment(config_from_dict(cfg), run_dir)
    clients = [json.loads(line) for line in (run_dir / "client_metrics.jsonl").read_text().splitlines()]
    return result.metrics, clients


def test_personal_models_are_scored_per_client_beside_the_global_model(tmp_path):
    rows, clients = _personal_run(tmp_path, "fedper")
    last = clients[-1]["clients"]
    assert set(last) == {"0", "1", "2", "3"}
    for entry in last.values():
        assert {"accuracy", "personal_accuracy", "personal_loss"} <= set(entry)
    mean = sum(e["personal_accuracy"] for e in last.values()) / 4
    assert rows[-1]["personal_acc_mean"] == pytest.approx(mean, rel=1e-12)
    assert rows[-1]["personal_acc_p10"] == min(e["personal_accuracy"] for e in last.values())
    # on label skew the own heads beat the shared body with the initial head
    assert rows[-1]["personal_acc_mean"] > rows[-1]["client_acc_mean"]


def test_with_validation_personal_models_are_also_scored_on_each_clients_validation_share(tmp_path):
    """What a personal model's settings are chosen by: the personal model, built once, is scored on
    the client's held-out share and on its own validation share (``personal_val_acc_*``)."""
    rows, clients = _personal_run(tmp_path, "fedper", validation=0.2)
    last = clients[-1]["clients"]
    vals = [e["personal_val_accuracy"] for e in last.values()]
    assert all(0.0 <= v <= 1.0 for v in vals) and {"val_accuracy", "personal_accuracy"} <= set(last["0"])
    assert rows[-1]["personal_val_acc_mean"] == pytest.approx(sum(vals) / len(vals), rel=1e-12)
    assert rows[-1]["personal_val_acc_min"] == min(vals)
    assert rows[-1]["personal_val_acc_mean"] > rows[-1]["client_val_acc_mean"]  # own heads on label skew


def test_clients_too_small_to_hold_a_sample_out_are_named_in_a_note(tmp_path, capsys):
    """A client of one training sample holds none out (it keeps its sample to train on), so its
    per-client figures are NaN; with many such clients the columns were NaN without a word (issue
    51). One note now says how many and why; the summaries are over the others."""
    from hpcfl.comm import LocalComm
    from hpcfl.runner.federation import build_federation

    extra = {"partition": "iid", "num_clients": 12, "rounds": 1, "local_steps": 1}
    extra["dataset_options"] = {**_PERSONAL_RUN["dataset_options"], "n_train": 18}
    cfg = config_from_dict({**_PERSONAL_RUN, "name": "tiny", "algorithm": "fedavg", **extra})
    empty = [k for k, share in enumerate(build_federation(cfg, LocalComm()).client_eval) if not share.numel()]
    assert 0 < len(empty) < 12
    capsys.readouterr()
    rows, clients = _personal_run(tmp_path, "fedavg", **extra)
    notes = [line for line in capsys.readouterr().err.splitlines() if "client_eval:" in line]
    assert len(notes) == 1 and notes[0].startswith(f"hpcfl: note: client_eval: {len(empty)} of 12 clients")
    last = clients[-1]["clients"]
    # no figure is written null (valid JSON: issue 61), never the NaN literal
    assert [k for k in range(12) if last[str(k)]["accuracy"] is None] == empty
    assert not math.isnan(rows[-1]["client_acc_mean"])


@pytest.mark.parametrize(
    ("name", "client_eval", "says"), [("fedper", 0.0, True), ("fedper", 0.25, False), ("fedavg", 0.0, False)]
)
def test_a_personalised_run_without_client_eval_says_it_judges_the_server_model(
    tmp_path, capsys, name, client_eval, says
):
    """Without ``client_eval`` a personalised method's own models are never scored and every figure
    is the server model's (FedPer's: the shared body with the initial head); that was silent (issue
    51). One note says so when the run starts."""
    cfg = {**_PERSONAL_RUN, "name": name, "algorithm": name, "client_eval": client_eval, "rounds": 1}
    assert main(["run", str(write_config(tmp_path / "c.yaml", **cfg)), "--run-dir", str(tmp_path / "r")]) == 0
    notes = [ln for ln in capsys.readouterr().err.splitlines() if "without client_eval" in ln]
    assert notes == (
        [
            f"hpcfl: note: {name} is personalised, but without client_eval every figure judges the server "
            "model, not the clients' own models; set client_eval: 0.2 to score each client's model on its "
            "held-out share (personal_acc_*)"
        ]
        if says
        else []
    )


def test_status_of_a_personalised_run_shows_its_clients_own_models(tmp_path, capsys):
    """``hpcfl status`` showed only the server model's test accuracy, which for FedPer is the shared
    body with the initial head (issue 51); it shows the personal mean beside it (and in ``--json``)."""
    rows, _ = _personal_run(tmp_path, "fedper", rounds=2)
    capsys.readouterr()
    assert main(["status", str(tmp_path / "fedper")]) == 0
    progress = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("rounds"))
    assert progress.startswith(
        f"rounds   2/2  test accuracy {rows[-1]['test_accuracy']:.4f}  "
        f"personal accuracy {rows[-1]['personal_acc_mean']:.4f} (client mean)"
    )
    assert main(["status", str(tmp_path / "fedper"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["personal_accuracy"] == rows[-1]["personal_acc_mean"]
    _personal_run(tmp_path, "fedavg", rounds=1)
    capsys.readouterr()
    assert main(["status", str(tmp_path / "fedavg")]) == 0
    assert "personal accuracy" not in capsys.readouterr().out


def test_global_algorithms_have_no_personal_columns(tmp_path):
    rows, clients = _personal_run(tmp_path, "fedavg")
    assert "personal_acc_mean" not in rows[-1]
    assert "personal_accuracy" not in clients[-1]["clients"]["0"]


def test_personal_evaluation_reads_the_on_disk_store_as_memory(tmp_path):
    _, memory = _personal_run(tmp_path / "m", "fedper")
    _, disk = _personal_run(tmp_path / "d", "fedper", client_state_memory="disk")
    assert memory == disk


@pytest.mark.parametrize("name", ["fedper", "fedrep", "fedbabu"])
def test_only_the_body_is_downloaded_as_only_the_body_is_uploaded(tmp_path, name):
    """The head never travels after the start: each participant downloads the body (the state
    without the head's slices), the bytes it uploads, not the whole state vector."""
    from hpcfl.comm import LocalComm
    from hpcfl.runner.federation import build_federation

    rows, _ = _personal_run(tmp_path, name, clients_per_round=3)
    cfg = config_from_dict({**_PERSONAL_RUN, "name": name, "algorithm": name})
    fed = build_federation(cfg, LocalComm())
    server = fed.flat.vector
    body = fed.algorithm.split.shared_size * server.element_size()
    assert 0 < fed.algorithm.split.shared_size < server.numel()
    for row in rows:
        n = len(row["participants"])
        assert n == 3
        assert row["bytes_down"] == row["bytes_up"] == n * body < n * server.numel() * server.element_size()


# -- Ditto -----------------------------------------------------------------------------------------


def test_ditto_client_step_is_fedavg_then_the_proximal_personal_update():
    """Li et al. 2021, Algorithm 1: w_k by FedAvg's local SGD from w^t, then s local iterations
    v_k ← v_k − η(∇F_k(v_k) + λ(v_k − w^t)) (here the gradient of F_k + λ/2‖v − w^t‖²)."""
    lam = 0.7
    model = _model()
    algo = _algo("ditto", model, lam=lam)
    server = algo.init_server(_randomised(_state(model)))
    client = algo.init_client(0, server)
    client.v = _randomised(server.x, seed=8)
    data = _clients()[1]
    trainer = Trainer(FlatModel(_model()), _schedule())
    upload, new = algo.client_update(server, client, data, _ctx(trainer, seed=21))

    gen = torch.Generator().manual_seed(21)
    ref_w = _load(_model(), server.x)
    anchor = [p.detach().clone() for p in ref_w.parameters()]
    ref_v = _load(_model(), client.v)
    for ref, prox in ((ref_w, 0.0), (ref_v, lam)):
        opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
        ref.train()
        for idx in batch_indices(data.n, _schedule(), gen):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ref(data.x[idx]), data.y[idx])
            loss = loss + prox / 2 * sum(
                ((p - a) ** 2).sum() for p, a in zip(ref.parameters(), anchor, strict=True)
            )
            loss.backward()
            opt.step()
    torch.testing.assert_close(upload.sums["x"], _state(ref_w), **TOL)
    torch.testing.assert_close(new.v, _state(ref_v), **TOL)


@pytest.mark.parametrize("lam", [0.0, 0.5, 5.0])
def test_dittos_global_model_is_fedavg_for_any_lambda(lam):
    runs = []
    for name, params in (("ditto", {"lam": lam}), ("fedavg", {})):
        model = _model()
        cls = ALGORITHMS[name]
        algo = cls(
            cls.Params(**params), layout=StateLayout.of_model(model), participation=Participation(count=2)
        )
        server, _ = simulate(algo, _clients(), Trainer(FlatModel(model), _schedule()), 3, reduction="float64")
        runs.append(server.x)
    assert torch.equal(*runs)


def test_ditto_judges_a_client_by_its_personal_model():
    model = _model()
    algo = _algo("ditto", model)
    w0 = _state(model)
    server = algo.init_server(_randomised(w0))
    fresh = algo.init_client(0, algo.init_server(w0))
    assert torch.equal(algo.personal_model(server, fresh, _clients()[0], _ctx(None)), w0)  # v_k^0 = w^0


@pytest.mark.parametrize(("key", "value"), [("lam", -0.1), ("personal_epochs", 0)])
def test_ditto_refuses_bad_settings(key, value):
    with pytest.raises(ConfigError, match=key):
        ALGORITHMS["ditto"].Params(**{key: value})


# -- APFL ------------------------------------------------------------------------------------------


def test_apfl_client_step_is_the_papers_joint_update():
    """Deng et al. 2020, Algorithm 1 with adaptive α, per mini-batch ξ: w ← w − η∇f(w; ξ),
    v ← v − η α∇f(v̄; ξ), α ← clip(α − η_α⟨v − w, ∇f(v̄; ξ)⟩, 0, 1), v̄ = αv + (1 − α)w."""
    model = _mlp()
    algo = _algo("apfl", model, alpha=0.4, alpha_lr=0.3)
    server = algo.init_server(_randomised(_state(model)))
    client = algo.init_client(0, server)
    client.v = _randomised(server.x, seed=8)
    data = _clients()[2]
    sched = LocalSchedule(lr=LR, batch_size=8, steps=4, momentum=MOMENTUM, weight_decay=WD)
    trainer = Trainer(FlatModel(_mlp()), sched)
    upload, new = algo.client_update(server, client, data, _ctx(trainer, seed=4))

    w_model, v_model, mix = _load(_mlp(), server.x), _load(_mlp(), client.v), _mlp()
    opt_w = torch.optim.SGD(w_model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    opt_v = torch.optim.SGD(v_model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    alpha = 0.4
    for idx in batch_indices(data.n, sched, torch.Generator().manual_seed(4)):
        xb, yb = data.x[idx], data.y[idx]
        with torch.no_grad():
            for pm, pv, pw in zip(mix.parameters(), v_model.parameters(), w_model.parameters(), strict=True):
                pm.copy_(alpha * pv + (1 - alpha) * pw)
        mix.zero_grad()
        nn.functional.cross_entropy(mix(xb), yb).backward()
        grads = [p.grad.clone() for p in mix.parameters()]
        diff = sum(
            ((pv - pw) * g).sum()
            for pv, pw, g in zip(v_model.parameters(), w_model.parameters(), grads, strict=True)
        )
        opt_w.zero_grad()
        nn.functional.cross_entropy(w_model(xb), yb).backward()
        opt_w.step()
        for p, g in zip(v_model.parameters(), grads, strict=True):
            p.grad = alpha * g
        opt_v.step()
        alpha = min(1.0, max(0.0, alpha - 0.3 * float(diff.detach())))
    torch.testing.assert_close(upload.sums["x"], _state(w_model), **TOL)
    torch.testing.assert_close(new.v, _state(v_model), **TOL)
    assert new.alpha.item() == pytest.approx(alpha, abs=1e-10) and new.alpha.item() != 0.4
    mixed = algo.personal_model(server, new, data, _ctx(None))
    torch.testing.assert_close(mixed, new.alpha.item() * new.v + (1 - new.alpha.item()) * server.x, **TOL)


def test_apfls_global_model_is_fedavg():
    """w's local steps never read v or α: the global model is FedAvg's, bit for bit."""
    runs = []
    for name in ("apfl", "fedavg"):
        model = _model()
        cls = ALGORITHMS[name]
        algo = cls(cls.Params(), layout=StateLayout.of_model(model), participation=Participation(count=2))
        server, _ = simulate(algo, _clients(), Trainer(FlatModel(model), _schedule()), 3, reduction="float64")
        runs.append(server.x)
    assert torch.equal(*runs)


@pytest.mark.parametrize(("key", "value"), [("alpha", 1.5), ("alpha_lr", 0.0)])
def test_apfl_refuses_bad_settings(key, value):
    with pytest.raises(ConfigError, match=key):
        ALGORITHMS["apfl"].Params(**{key: value})


# -- FedBABU ---------------------------------------------------------------------------------------


def test_fedbabu_client_step_trains_the_body_with_the_head_at_its_initialisation():
    """Oh et al. 2022, Algorithm 1: the head's learning rate is 0 in federated training; the body
    is trained and uploaded."""
    model = _model()
    algo = _algo("fedbabu", model)
    server = algo.init_server(_randomised(_state(model)))
    data = _clients()[0]
    trainer = Trainer(FlatModel(_model()), _schedule())
    upload, _ = algo.client_update(server, algo.init_client(0, server), data, _ctx(trainer))

    ref = _load(_model(), server.x)
    _reference_sgd(ref, [p for n, p in ref.named_parameters() if not n.startswith("classifier")], data, 3, 11)
    torch.testing.assert_close(upload.sums["x"], algo.split.shared_of(_state(ref)), **TOL)
    assert torch.equal(algo.split.kept_of(_state(ref)), algo.split.kept_of(server.x))


def test_fedbabus_head_never_leaves_its_initialisation():
    model = _model()
    algo = _algo("fedbabu", model)
    x0 = _state(model)
    server, _ = simulate(algo, _clients(), Trainer(FlatModel(model), _schedule()), 3, reduction="float64")
    assert torch.equal(algo.split.kept_of(server.x), algo.split.kept_of(x0))
    assert not torch.equal(algo.split.shared_of(server.x), algo.split.shared_of(x0))


@pytest.mark.parametrize("part", ["full", "head"])
def test_fedbabu_personal_model_is_the_global_model_fine_tuned_for_tau_f_epochs(part):
    model = _model()
    algo = _algo("fedbabu", model, finetune_epochs=2, finetune=part)
    server = algo.init_server(_randomised(_state(model)))
    data = _clients()[1]
    trainer = Trainer(FlatModel(_model()), _schedule())
    tuned = algo.personal_model(server, algo.init_client(0, server), data, _ctx(trainer, seed=6))

    ref = _load(_model(), server.x)
    params = list(ref.parameters()) if part == "full" else list(ref.classifier.parameters())
    epochs = LocalSchedule(lr=LR, batch_size=8, epochs=2, momentum=MOMENTUM, weight_decay=WD)
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WD)
    ref.train()
    for idx in batch_indices(data.n, epochs, torch.Generator().manual_seed(6)):
        opt.zero_grad()
        nn.functional.cross_entropy(ref(data.x[idx]), data.y[idx]).backward()
        opt.step()
    torch.testing.assert_close(tuned, _state(ref), **TOL)
    zero = _algo("fedbabu", model, finetune_epochs=0)
    assert torch.equal(
        zero.personal_model(server, zero.init_client(0, server), data, _ctx(trainer)), server.x
    )


@pytest.mark.parametrize(("key", "value"), [("finetune_epochs", -1), ("finetune", "body")])
def test_fedbabu_refuses_bad_settings(key, value):
    with pytest.raises(ConfigError, match=key):
        ALGORITHMS["fedbabu"].Params(**{key: value})


# -- FedUV -----------------------------------------------------------------------------------------


def _variance_reference(probs: torch.Tensor, target: float) -> torch.Tensor:
    """The authors' ``UVReg`` (sonhamin/FedUV algs/feduv.py): relu(γ − p.std(dim=0)).mean()."""
    return torch.relu(target - probs.std(dim=0)).mean()


def _uniformity_reference(z: torch.Tensor) -> torch.Tensor:
    """The authors' ``UVReg``: d = pdist(z)², σ = median of the nonzero d, mean exp(−d/σ)."""
    d = torch.pdist(z, p=2).pow(2)
    sigma = torch.median(d[d != 0])
    return d.mul(-1 / sigma).exp().mean()


def test_feduv_regularisers_are_the_authors_terms():
    from hpcfl.algorithms.feduv import iid_variance_target, uniformity_loss, variance_loss

    g = torch.Generator().manual_seed(2)
    probs = torch.randn(9, 4, generator=g, dtype=torch.float64).softmax(dim=1).requires_grad_()
    ours, ref = variance_loss(probs, 0.4), _variance_reference(probs, 0.4)
    torch.testing.assert_close(ours, ref, **TOL)
    torch.testing.assert_close(*(torch.autograd.grad(v, probs)[0] for v in (ours, ref)), **TOL)
    for B in (7, 8):  # an odd and an even number of pairs (21, 28): the median is the lower one
        z = torch.randn(B, 5, generator=g, dtype=torch.float64).requires_grad_()
        ours, ref = uniformity_loss(z), _uniformity_reference(z)
        torch.testing.assert_close(ours, ref, **TOL)
        torch.testing.assert_close(*(torch.autograd.grad(v, z)[0] for v in (ours, ref)), **TOL)
    # duplicated representations (zero distances) are left out of the median, as in the code
    z = torch.randn(5, 3, generator=g, dtype=torch.float64)[[0, 1, 1, 2, 3, 3, 4]]
    torch.testing.assert_close(uniformity_loss(z), _uniformity_reference(z), **TOL)
    # degenerate batches: a constant, no NaN
    assert uniformity_loss(torch.ones(4, 3, dtype=torch.float64)) == 1
    assert uniformity_loss(torch.ones(1, 3, dtype=torch.float64)) == 0
    assert variance_loss(torch.ones(1, 3, dtype=torch.float64) / 3, 0.5) == 0
    # γ is the code's torch.eye(C).std(dim=0).mean(); an IID-like batch (every class once,
    # confident) is at it, a one-class batch is γ below it
    C = 4
    gamma = iid_variance_target(C)
    assert gamma == pytest.approx(float(torch.eye(C, dtype=torch.float64).std(dim=0).mean()), rel=1e-15)
    assert variance_loss(torch.eye(C, dtype=torch.float64), gamma) == 0
    one_class = torch.eye(C, dtype=torch.float64)[[0] * 12].requires_grad_()
    loss = variance_loss(one_class, gamma)
    # every column has zero spread, counted as the 1e-6 floor (the code's std has a NaN gradient there)
    torch.testing.assert_close(loss, torch.tensor(gamma - 1e-6, dtype=torch.float64), **TOL)
    assert torch.isfinite(torch.autograd.grad(loss, one_class)[0]).all()


def test_feduv_client_step_is_sgd_on_the_regularised_objective():
    """ℓ = CE + λ·ℓ_V(softmax(logits)) + μ·ℓ_U(z), z the classifier's input, by torch.optim.SGD."""
    lam, mu = 0.6, 0.3
    model = _model()
    algo = _algo("feduv", model, variance_weight=lam, uniformity_weight=mu)
    server = algo.init_server(_randomised(_state(model)))
    data = _clients()[2]
    trainer = Trainer(FlatModel(_model()), _schedule())
    upload, _ = algo.client_update(server, algo.init_client(0, server), data, _ctx(trainer))

    ref = _load(_model(), server.x)
    body = nn.Sequential(*list(ref.children())[:-1])
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    ref.train()
    gamma = float(torch.eye(3, dtype=torch.float64).std(dim=0).mean())  # the code's batch_gamma
    for idx in batch_indices(data.n, _schedule(), torch.Generator().manual_seed(11)):
        opt.zero_grad()
        z = body(data.x[idx])
        logits = ref.classifier(z)
        loss = nn.functional.cross_entropy(logits, data.y[idx])
        loss = loss + lam * _variance_reference(logits.softmax(dim=1), gamma) + mu * _uniformity_reference(z)
        loss.backward()
        opt.step()
    torch.testing.assert_close(upload.sums["x"], _state(ref), **TOL)


@pytest.mark.parametrize("per_round", [None, 2])
def test_feduv_with_both_weights_zero_is_fedavg_bit_for_bit(per_round):
    runs = []
    for name, params in (("feduv", {"variance_weight": 0.0, "uniformity_weight": 0.0}), ("fedavg", {})):
        model = _model()
        cls = ALGORITHMS[name]
        algo = cls(
            cls.Params(**params),
            layout=StateLayout.of_model(model),
            participation=Participation(count=per_round),
        )
        server, _ = simulate(algo, _clients(), Trainer(FlatModel(model), _schedule()), 3, reduction="float64")
        runs.append(server.x)
    assert torch.equal(*runs)


@pytest.mark.parametrize(
    ("key", "value"), [("variance_weight", -1.0), ("uniformity_weight", -0.5), ("variance_target", 0.0)]
)
def test_feduv_refuses_bad_settings(key, value):
    with pytest.raises(ConfigError, match=key):
        ALGORITHMS["feduv"].Params(**{key: value})
