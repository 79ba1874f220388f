"""SCAFFOLD and FedPVR as their authors' code runs them (issues 25 and 33): control variates that
stay consistent under local momentum, the form ``auto`` picks, server weighting, the last partial
batch, per-slice weight decay; FedDyn's reported model and its official-code options."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from hpcfl.algorithms import FedAvg, FedDyn, FedProx, FedPVR, Scaffold, Trainer
from hpcfl.algorithms.base import ClientData, upload_weight
from hpcfl.algorithms.participation import Participation, Population
from hpcfl.algorithms.scaffold import ScaffoldClientState, choose_form
from hpcfl.errors import ConfigError
from hpcfl.training import FlatModel, LocalSchedule
from hpcfl.training.batched import ClientJob, batched_local_sgd
from hpcfl.training.layout import StateLayout
from hpcfl.training.sgd import batch_indices, local_norm
from tests.helpers import local_sgd
from tests.test_algorithms import _least_squares_clients, _mse


def _linear() -> nn.Module:
    """A float64 linear model with a bias (two parameter tensors), started at zero."""
    model = nn.Linear(6, 1).double()
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    return model


def _mean_objective_optimum(clients: list[ClientData]) -> torch.Tensor:
    """argmin of (1/N)Σ_k f_k, f_k = mean squared error of client k, for the model [w, b]."""
    hess, rhs = 0, 0
    for c in clients:
        a = torch.cat([c.x, torch.ones(c.n, 1, dtype=torch.float64)], dim=1)
        hess = hess + a.T @ a / c.n
        rhs = rhs + a.T @ c.y / c.n
    return torch.linalg.solve(hess, rhs)


def _simulate(algo, clients, schedule, rounds, *, client_batch=1, model=None, loss_fn=_mse, states=None):
    """``rounds`` rounds through the real round loop, one by one or in vectorised groups."""
    from hpcfl.algorithms import RoundPlan
    from hpcfl.comm import LocalComm
    from hpcfl.runner.rounds import MemoryStates, run_rounds

    flat = FlatModel(model if model is not None else _linear())
    trainer = Trainer(flat, schedule, loss_fn=loss_fn)
    by_id = {c.k: c for c in clients}
    server = algo.init_server(flat.vector)
    states = states or MemoryStates(lambda k: algo.init_client(k, server))
    plan = RoundPlan(
        algorithm=algo,
        comm=LocalComm(),
        data=by_id.__getitem__,
        trainer=trainer,
        population=Population(tuple(by_id[k].n for k in sorted(by_id))),
        generator=lambda rnd, k: torch.Generator().manual_seed(1000 * rnd + k),
        evaluate=lambda s, joint: {},
        seed=0,
        reduction="float64",
        eval_every=10**9,
        client_batch=client_batch,
    )
    server, _ = run_rounds(plan, server, states, 0, rounds)
    return server, states


def _algo(cls, params, model=None, per_round=None):
    layout = StateLayout.of_model(model if model is not None else _linear())
    return cls(params, layout=layout, participation=Participation(count=per_round))


# -- issue 25 item 1: momentum-consistent control variates ----------------------------------------


def test_local_norm_is_k_at_momentum_zero_and_the_step_sum_otherwise():
    assert local_norm(10, 0.0) == 10.0 and isinstance(local_norm(10, 0.0), float)
    assert local_norm(10, 0.9) == pytest.approx(41.4, abs=0.05)  # issue 25's figure
    assert local_norm(10, 0.9) == pytest.approx(sum((1 - 0.9 ** (s + 1)) / 0.1 for s in range(10)))


QUADRATIC = dict(rounds=150, steps=10, momentum=0.9)


@pytest.mark.parametrize("client_batch", [1, 4], ids=["sequential", "batched"])
@pytest.mark.parametrize("form", ["control_variates", "one_model"])
def test_scaffold_with_momentum_reaches_the_optimum_of_the_mean_objective(form, client_batch):
    """Exact (full-batch) gradients, β = 0.9, unequal clients: SCAFFOLD converges to
    argmin (1/N)Σ f_k. With the (x − y)/(Kη) variates of the papers it diverged (‖x − x*‖ grew
    ~3× per round, issue 25); the variates now divide by η‖a‖₁."""
    clients = _least_squares_clients(K=4, d=6, seed=2)
    x_star = _mean_objective_optimum(clients)
    L = max(float(torch.linalg.eigvalsh(c.x.T @ c.x / c.n).max()) for c in clients)
    sched = LocalSchedule(
        lr=0.3 / L,
        batch_size=10_000,
        steps=QUADRATIC["steps"],
        momentum=QUADRATIC["momentum"],
        weight_decay=0.0,
    )
    algo = _algo(Scaffold, Scaffold.Params(form=form, weighting="uniform"))
    server, _ = _simulate(algo, clients, sched, QUADRATIC["rounds"], client_batch=client_batch)
    assert float(torch.linalg.norm(server.x - x_star) / torch.linalg.norm(x_star)) < 1e-6


def test_the_papers_k_eta_denominator_diverges_on_that_problem(monkeypatch):
    """The same problem with the variates divided by Kη (the code before issue 25): the error grows
    ~2.8× per round (relative error 28 after 10 rounds, 9.5e5 after 20)."""
    import hpcfl.algorithms.scaffold as scaffold

    monkeypatch.setattr(scaffold, "local_norm", lambda steps, momentum: float(steps))
    clients = _least_squares_clients(K=4, d=6, seed=2)
    x_star = _mean_objective_optimum(clients)
    L = max(float(torch.linalg.eigvalsh(c.x.T @ c.x / c.n).max()) for c in clients)
    sched = LocalSchedule(lr=0.3 / L, batch_size=10_000, steps=10, momentum=0.9, weight_decay=0.0)
    algo = _algo(Scaffold, Scaffold.Params(form="control_variates", weighting="uniform"))
    server, _ = _simulate(algo, clients, sched, 10)
    assert float(torch.linalg.norm(server.x - x_star) / torch.linalg.norm(x_star)) > 10


@pytest.mark.parametrize("client_batch", [1, 4], ids=["sequential", "batched"])
def test_fedpvr_momentum_on_the_corrected_slice_reaches_the_optimum(client_batch):
    """FedPVR's corrected slice (here every parameter) with momentum 0.9 on it: same recursion as
    SCAFFOLD, same fix; converges to argmin (1/N)Σ f_k."""
    clients = _least_squares_clients(K=4, d=6, seed=2)
    x_star = _mean_objective_optimum(clients)
    L = max(float(torch.linalg.eigvalsh(c.x.T @ c.x / c.n).max()) for c in clients)
    sched = LocalSchedule(lr=0.3 / L, batch_size=10_000, steps=10, momentum=0.9, weight_decay=0.0)
    algo = _algo(FedPVR, FedPVR.Params(start_param=0, momentum_on_corrected=True))
    server, _ = _simulate(algo, clients, sched, QUADRATIC["rounds"], client_batch=client_batch)
    assert float(torch.linalg.norm(server.x - x_star) / torch.linalg.norm(x_star)) < 1e-6


def test_scaffold_local_step_and_variate_equal_the_fedpvr_authors_client_at_momentum_zero():
    """A transcription of the FedPVR authors' client (``_update_batch_tr``: grad of the batch's mean
    loss, ``p.grad += c − c_k``, ``SGD.step()`` at momentum 0 and weight decay 0;
    ``_get_ci_plus_option_two``: c_k⁺ = c_k − c + (1/(η·E·len(loader)))·(x − y), loaders dropping
    the last partial batch), on the same batches, float64: equal to hpcfl's control-variate form."""
    g = torch.Generator().manual_seed(3)
    n, B, E, lr = 70, 16, 2, 0.05
    data = ClientData(
        0,
        torch.randn(n, 6, generator=g, dtype=torch.float64),
        torch.randn(n, generator=g, dtype=torch.float64),
    )
    c = torch.randn(7, generator=g, dtype=torch.float64)
    c_k = torch.randn(7, generator=g, dtype=torch.float64)
    x0 = torch.randn(7, generator=g, dtype=torch.float64)
    sched = LocalSchedule(lr=lr, batch_size=B, epochs=E, weight_decay=0.0, drop_last=True)
    model = _linear()
    FlatModel(model).load(x0)
    algo = _algo(Scaffold, Scaffold.Params(form="control_variates"), model=model, per_round=None)

    from hpcfl.runner.rounds import MemoryStates

    states = MemoryStates(lambda k: ScaffoldClientState(h=c_k.clone()))
    init = algo.init_server

    def init_server(x: torch.Tensor):
        s = init(x)
        s.c = c.clone()
        return s

    algo.init_server = init_server  # type: ignore[method-assign]
    server, states = _simulate(algo, [data], sched, 1, model=model, states=states)

    # the authors' client, transcribed
    ref = _linear()
    FlatModel(ref).load(x0)
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.0, weight_decay=0.0)
    corr = {"weight": (c - c_k)[:6].view(1, 6), "bias": (c - c_k)[6:]}
    batches = batch_indices(n, sched, torch.Generator().manual_seed(0))
    assert len(batches) == E * (n // B) and all(len(b) == B for b in batches)
    for idx in batches:
        opt.zero_grad()
        loss = 0.5 * ((ref(data.x[idx]).squeeze(1) - data.y[idx]) ** 2).sum() / len(idx)
        loss.backward()
        for name, p in ref.named_parameters():
            p.grad.data += corr[name]
        opt.step()
    y = torch.cat([ref.weight.detach().flatten(), ref.bias.detach()])
    ci_plus = c_k - c + (1.0 / (lr * E * (n // B))) * (x0 - y)
    torch.testing.assert_close(server.x, y, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(states.get(0).h, ci_plus, rtol=1e-11, atol=1e-11)
    # the server step of a single full participant: c ← c + Δc / N
    torch.testing.assert_close(server.c, c + (ci_plus - c_k), rtol=1e-11, atol=1e-11)


def test_after_step_placement_equals_a_transcription_of_niid_bench():
    """``correction: after_step`` at momentum 0.9 on one client (float64, full batch): NIID-Bench's
    client — ``optimizer.step()`` (momentum SGD on the loss gradient), then w ← w − η(c − c_k); after
    K steps c_k⁺ = c_k − c + (x − y)/(Kη) — equals hpcfl's in-buffer form of the same placement."""
    g = torch.Generator().manual_seed(8)
    data = ClientData(
        0,
        torch.randn(30, 6, generator=g, dtype=torch.float64),
        torch.randn(30, generator=g, dtype=torch.float64),
    )
    c, c_k, x0 = (torch.randn(7, generator=g, dtype=torch.float64) for _ in range(3))
    K, lr = 6, 0.05
    sched = LocalSchedule(lr=lr, batch_size=10_000, steps=K, momentum=0.9, weight_decay=0.0)
    model = _linear()
    FlatModel(model).load(x0)
    algo = _algo(Scaffold, Scaffold.Params(form="control_variates", correction="after_step"), model=model)

    from hpcfl.runner.rounds import MemoryStates

    init = algo.init_server

    def init_server(x: torch.Tensor):
        s = init(x)
        s.c = c.clone()
        return s

    algo.init_server = init_server  # type: ignore[method-assign]
    states = MemoryStates(lambda k: ScaffoldClientState(h=c_k.clone()))
    server, states = _simulate(algo, [data], sched, 1, model=model, states=states)

    ref = _linear()
    FlatModel(ref).load(x0)
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9, weight_decay=0.0)
    for _ in range(K):
        opt.zero_grad()
        _mse(ref, data.x, data.y).backward()
        opt.step()
        with torch.no_grad():
            ref.weight -= lr * (c - c_k)[:6].view(1, 6)
            ref.bias -= lr * (c - c_k)[6:]
    y = torch.cat([ref.weight.detach().flatten(), ref.bias.detach()])
    torch.testing.assert_close(server.x, y, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(states.get(0).h, c_k - c + (x0 - y) / (K * lr), rtol=1e-10, atol=1e-10)


def test_after_step_placement_is_biased_under_momentum_and_the_buffer_form_at_momentum_zero():
    """NIID-Bench's placement stalls off the optimum at β = 0.9 (O(η) bias, module docstring) on
    the problem the in-buffer form solves to 1e-6; at β = 0 the two are one algorithm, bit for bit."""
    clients = _least_squares_clients(K=4, d=6, seed=2)
    x_star = _mean_objective_optimum(clients)
    L = max(float(torch.linalg.eigvalsh(c.x.T @ c.x / c.n).max()) for c in clients)
    sched = LocalSchedule(lr=0.3 / L, batch_size=10_000, steps=10, momentum=0.9, weight_decay=0.0)
    after = _algo(Scaffold, Scaffold.Params(form="control_variates", correction="after_step"))
    buffer = _algo(Scaffold, Scaffold.Params(form="control_variates"))
    rel = [
        float(torch.linalg.norm(_simulate(a, clients, sched, 150)[0].x - x_star) / torch.linalg.norm(x_star))
        for a in (after, buffer)
    ]
    assert rel[0] > 0.1 and rel[1] < 1e-6, rel
    plain = dataclasses.replace(sched, momentum=0.0)
    assert torch.equal(_simulate(after, clients, plain, 3)[0].x, _simulate(buffer, clients, plain, 3)[0].x)


# -- issue 33: the form auto picks, weighting, drop_last, weight decay ---------------------------


def test_auto_picks_one_model_only_where_it_is_option_ii():
    full, part = Participation(), Participation(count=2)
    equal, unequal = Population((40, 40, 40)), Population((40, 70, 160))
    steps = LocalSchedule(lr=0.1, batch_size=16, steps=5)
    epochs = LocalSchedule(lr=0.1, batch_size=16, epochs=1)
    uniform, samples = Scaffold.Params(weighting="uniform"), Scaffold.Params(weighting="samples")
    assert choose_form(uniform, full, unequal, steps) == "one_model"  # equal K, uniform mean
    assert choose_form(uniform, full, equal, epochs) == "one_model"
    assert choose_form(uniform, full, unequal, epochs) == "control_variates"  # K_k differ
    assert choose_form(samples, full, equal, steps) == "control_variates"  # weighted mean
    assert choose_form(uniform, part, equal, steps) == "control_variates"  # stale θ̂_k
    assert choose_form(Scaffold.Params(form="one_model"), part, unequal, epochs) == "one_model"


def _unequal_clients() -> list[ClientData]:
    """Four least-squares clients of 20, 27, 34, 41 samples."""
    return _least_squares_clients(K=4, d=6, seed=4)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("weighting", ["uniform", "samples"])
@pytest.mark.parametrize("schedule", ["steps", "epochs"])
def test_the_form_auto_picks_equals_control_variates_on_unequal_clients(schedule, weighting, momentum):
    """Full participation, clients of unequal sizes, 3 rounds in float64: whatever ``auto`` resolves
    to equals the control-variate form to 1e-6, with both weightings and with ``local_epochs``
    (unequal step counts); where auto picks ``one_model`` (uniform, equal steps) that is a
    non-trivial equality."""
    clients = _unequal_clients()
    if schedule == "steps":
        sched = LocalSchedule(lr=0.01, batch_size=8, steps=6, momentum=momentum, weight_decay=0.0)
    else:
        sched = LocalSchedule(lr=0.01, batch_size=8, epochs=2, momentum=momentum, weight_decay=0.0)
    population = Population(tuple(c.n for c in clients))
    auto = _algo(Scaffold, Scaffold.Params(weighting=weighting)).resolved(population, sched)
    expected = "one_model" if (schedule, weighting) == ("steps", "uniform") else "control_variates"
    assert auto.params.form == expected
    cv = _algo(Scaffold, Scaffold.Params(form="control_variates", weighting=weighting))
    x_auto, _ = _simulate(auto, clients, sched, 3)
    x_cv, _ = _simulate(cv, clients, sched, 3)
    gap = float(torch.linalg.norm(x_auto.x - x_cv.x) / torch.linalg.norm(x_cv.x))
    assert gap < 1e-6, gap


def test_one_model_is_another_algorithm_with_weighted_means_or_unequal_steps():
    """Why ``auto`` refuses it there: forced ``one_model`` drifts away from Option II."""
    clients = _unequal_clients()
    for weighting, sched in (
        ("samples", LocalSchedule(lr=0.01, batch_size=8, steps=6, weight_decay=0.0)),
        ("uniform", LocalSchedule(lr=0.01, batch_size=8, epochs=2, weight_decay=0.0)),
    ):
        one = _algo(Scaffold, Scaffold.Params(form="one_model", weighting=weighting))
        cv = _algo(Scaffold, Scaffold.Params(form="control_variates", weighting=weighting))
        x_one, _ = _simulate(one, clients, sched, 3)
        x_cv, _ = _simulate(cv, clients, sched, 3)
        assert float(torch.linalg.norm(x_one.x - x_cv.x) / torch.linalg.norm(x_cv.x)) > 1e-4, weighting


@pytest.mark.parametrize(
    "cls, params",
    [
        (Scaffold, Scaffold.Params(form="control_variates")),
        (Scaffold, Scaffold.Params(form="one_model")),
        (FedPVR, FedPVR.Params(start_param=1)),
        (FedAvg, FedAvg.Params()),
        (FedProx, FedProx.Params(mu=0.0)),
    ],
    ids=["scaffold-cv", "scaffold-one", "fedpvr", "fedavg", "fedprox"],
)
def test_uniform_weighting_is_the_plain_mean_of_the_client_models(cls, params):
    """Round 1 (every variate 0): the new x is the plain mean of the clients' local models, which
    are each client's plain local SGD from x0; ``samples`` gives the n_k-weighted mean."""
    clients = _unequal_clients()
    sched = LocalSchedule(lr=0.01, batch_size=8, steps=4, weight_decay=0.0)
    x0 = FlatModel(_linear()).vector
    local = []
    for c in clients:
        flat = FlatModel(_linear())
        local_sgd(flat, c.x, c.y, sched, torch.Generator().manual_seed(c.k), loss_fn=_mse)
        local.append(flat.vector.clone())
    assert not torch.equal(local[0], x0)
    for weighting in ("uniform", "samples"):
        algo = _algo(cls, dataclasses.replace(params, weighting=weighting))
        server, _ = _simulate(algo, clients, sched, 1)
        w = torch.tensor([upload_weight(c, weighting) for c in clients], dtype=torch.float64)
        expected = sum(wk * y for wk, y in zip(w, local, strict=True)) / w.sum()
        torch.testing.assert_close(server.x, expected, rtol=1e-14, atol=1e-15)
    assert upload_weight(clients[1], "uniform") == 1.0 and upload_weight(clients[1], "samples") == 27.0


def test_fedpvr_empty_mask_with_uniform_weighting_is_the_plain_mean_not_fedavg():
    clients = _unequal_clients()
    sched = LocalSchedule(lr=0.01, batch_size=8, steps=4, weight_decay=0.0)
    pvr, _ = _simulate(_algo(FedPVR, FedPVR.Params(start_param=2)), clients, sched, 2)
    avg, _ = _simulate(_algo(FedAvg, FedAvg.Params()), clients, sched, 2)
    pvr_s, _ = _simulate(_algo(FedPVR, FedPVR.Params(start_param=2, weighting="samples")), clients, sched, 2)
    assert torch.equal(pvr_s.x, avg.x) and not torch.equal(pvr.x, avg.x)


@pytest.mark.parametrize("drop_last", [True, False])
def test_drop_last_gives_e_floor_n_over_b_steps_in_both_trainers(drop_last):
    """n = 70, 16, 33 with B = 16 and E = 2: E·⌊n/B⌋ full batches with ``drop_last`` (one batch of
    all n < B samples), E·⌈n/B⌉ without, sequential and batched alike, with equal results."""
    g = torch.Generator().manual_seed(0)
    sizes = [70, 16, 33, 9]
    clients = [
        ClientData(
            k,
            torch.randn(n, 6, generator=g, dtype=torch.float64),
            torch.randn(n, generator=g, dtype=torch.float64),
        )
        for k, n in enumerate(sizes)
    ]
    sched = LocalSchedule(lr=0.01, batch_size=16, epochs=2, drop_last=drop_last, weight_decay=0.0)
    expect = [2 * (max(1, n // 16) if drop_last else -(-n // 16)) for n in sizes]
    assert [sched.num_steps(n) for n in sizes] == expect
    if drop_last:
        assert expect == [8, 2, 4, 2]
        batches = batch_indices(70, sched, torch.Generator())
        assert [len(b) for b in batches] == [16] * 8
        assert all(len(set(torch.cat(batches[e * 4 : e * 4 + 4]).tolist())) == 64 for e in range(2))
    flat = FlatModel(_linear())
    x0 = flat.vector.clone()
    seq = []
    for c in clients:
        flat.load(x0)
        r = local_sgd(flat, c.x, c.y, sched, torch.Generator().manual_seed(c.k), loss_fn=_mse)
        seq.append((flat.vector.clone(), r.steps))
    jobs = [ClientJob(x0, c.x, c.y, torch.Generator().manual_seed(c.k)) for c in clients]
    W, results = batched_local_sgd(flat, jobs, sched, _mse)
    assert [r.steps for r in results] == [s for _, s in seq] == expect
    for i, (y, _) in enumerate(seq):
        torch.testing.assert_close(W[i], y, rtol=1e-12, atol=1e-14)


def test_drop_last_is_a_top_level_config_key(tmp_path: Path):
    from hpcfl.config import config_from_dict
    from hpcfl.runner.federation import schedule_of

    assert schedule_of(config_from_dict({"drop_last": True})).drop_last is True
    assert schedule_of(config_from_dict({})).drop_last is False
    with pytest.raises(ConfigError, match="drop_last"):
        config_from_dict({"drop_last": "often"})


def test_fedpvr_corrected_weight_decay_zero_matches_torch_parameter_groups():
    """Round 1 (c = c_k = 0), run-wide weight decay 0.05, ``corrected_weight_decay: 0``: the masked
    bias takes steps without decay, the weight with it: ``torch.optim.SGD`` with two groups."""
    clients = _unequal_clients()[:1]
    sched = LocalSchedule(lr=0.01, batch_size=10_000, steps=5, weight_decay=0.05)
    algo = _algo(FedPVR, FedPVR.Params(start_param=1, corrected_weight_decay=0.0))
    server, _ = _simulate(algo, clients, sched, 1)
    ref = _linear()
    opt = torch.optim.SGD(
        [{"params": [ref.weight], "weight_decay": 0.05}, {"params": [ref.bias], "weight_decay": 0.0}], lr=0.01
    )
    for _ in range(5):
        opt.zero_grad()
        _mse(ref, clients[0].x, clients[0].y).backward()
        opt.step()
    expected = torch.cat([ref.weight.detach().flatten(), ref.bias.detach()])
    torch.testing.assert_close(server.x, expected, rtol=1e-13, atol=1e-15)
    plain, _ = _simulate(_algo(FedPVR, FedPVR.Params(start_param=1)), clients, sched, 1)
    assert not torch.equal(plain.x, server.x)


@pytest.mark.parametrize(
    "algorithm, params, key",
    [
        ("scaffold", {"weighting": "sizes"}, "params.weighting"),
        ("fedpvr", {"weighting": "n_k"}, "params.weighting"),
        ("feddyn", {"weighting": "equal"}, "params.weighting"),
        ("feddyn", {"max_grad_norm": 0}, "params.max_grad_norm"),
        ("fedpvr", {"corrected_weight_decay": -1}, "params.corrected_weight_decay"),
        ("fedavg", {"weighting": "n"}, "params.weighting"),
        ("fedprox", {"weighting": "n"}, "params.weighting"),
        ("scaffold", {"correction": "later"}, "params.correction"),
    ],
)
def test_bad_params_are_one_clear_line(algorithm, params, key):
    from hpcfl.config import config_from_dict

    with pytest.raises(ConfigError) as err:
        config_from_dict({"algorithm": algorithm, "params": params})
    assert key in str(err.value) and "\n" not in str(err.value)


# -- issue 25 item 2: FedDyn as its authors report it ---------------------------------------------


def test_feddyn_reports_the_client_mean_and_the_corrected_model(tmp_path: Path):
    """``test_accuracy`` is a direct evaluation of the plain mean of the client models, which the
    server keeps as ``mean``; ``test_accuracy_corrected`` evaluates θ = mean − h/α."""
    from hpcfl.config import config_from_dict
    from hpcfl.data import load_dataset
    from hpcfl.models import build_model
    from hpcfl.runner import run_experiment
    from hpcfl.training.evaluate import evaluate

    cfg = config_from_dict(
        dict(
            dataset="synthetic",
            dataset_options={"n_train": 600, "n_test": 200, "seed": 3},
            partition="dir:0.5",
            num_clients=3,
            model="mlp",
            algorithm="feddyn",
            params={"alpha": 0.1},
            rounds=2,
            local_steps=3,
            lr=0.05,
            batch_size=32,
            seed=7,
            threads=1,
            progress=False,
        )
    )
    result = run_experiment(cfg, tmp_path / "run")
    server, row = result.server, result.metrics[-1]
    ds = load_dataset(cfg.dataset, cfg.data_root, download=False, **cfg.dataset_options)
    model = build_model(cfg.model, ds.input_shape, ds.num_classes, **cfg.model_options)
    from hpcfl.comm import LocalComm

    for vec, col in ((server.mean, "test_accuracy"), (server.x, "test_accuracy_corrected")):
        FlatModel(model).load(vec)
        acc, _ = evaluate(model, ds.test.x, ds.test.y, LocalComm())
        assert row[col] == acc, col
    assert not torch.equal(server.mean, server.x)
    P = StateLayout.of_model(model).num_params
    torch.testing.assert_close(server.x[:P], server.mean[:P] - server.h / 0.1)


def test_feddyn_uniform_mean_is_the_plain_mean_of_the_uploads():
    from hpcfl.algorithms.base import Aggregate, ServerContext

    algo = _algo(FedDyn, FedDyn.Params(alpha=0.1))
    server = algo.init_server(torch.zeros(7, dtype=torch.float64))
    ys = [torch.randn(7, dtype=torch.float64, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    new, _ = algo.server_update(
        server,
        Aggregate({"x": sum(ys)}, 3.0, 3),
        ServerContext(0, (0, 1, 2), Population((5, 9, 20)), lambda t: t),
    )
    torch.testing.assert_close(new.mean, sum(ys) / 3)
    assert new.evaluated()[""] is new.mean and new.evaluated()["_corrected"] is new.x


def test_feddyn_clipping_and_per_client_alpha_follow_the_official_code():
    """One client, one local step: the clipped direction is clip(∇L − g_k − α_k·θ) + (α_k + wd)·w
    (the official ``clip_grad_norm_`` on the loss and linear terms, α_k·w and wd·w from the
    optimiser's weight decay); α_k = α/(n_k·N/Σn)."""
    from hpcfl.algorithms.feddyn import client_alpha

    params = FedDyn.Params(alpha=0.1, max_grad_norm=0.01, alpha_per_client=True)
    population = Population((10, 30))
    assert client_alpha(params, 0, population) == pytest.approx(0.1 / 0.5)
    assert client_alpha(params, 1, population) == pytest.approx(0.1 / 1.5)
    assert client_alpha(FedDyn.Params(alpha=0.1), 0, population) == 0.1

    clients = _unequal_clients()[:2]
    sched = LocalSchedule(lr=0.01, batch_size=10_000, steps=1, weight_decay=1e-3)
    algo = _algo(FedDyn, params)
    server, _ = _simulate(algo, clients, sched, 1)
    ys = []
    for c in clients:
        ref = _linear()
        ref.zero_grad()
        _mse(ref, c.x, c.y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.01)  # g_k = 0, θ = 0 in round 1
        grad = torch.cat([ref.weight.grad.flatten(), ref.bias.grad])
        ys.append(-0.01 * grad)  # w = 0: the α_k·w and wd·w terms vanish
    torch.testing.assert_close(server.mean, (ys[0] + ys[1]) / 2, rtol=1e-12, atol=1e-15)
    assert float(torch.linalg.norm(ys[0])) == pytest.approx(0.01 * 0.01, rel=1e-5)


def test_resnet8_for_fedpvr_comparisons_is_groupnorm_2_through_model_options():
    """``model_options: {norm: gn}``: the FedPVR authors' ResNet-8 (GroupNorm, 2 groups, no
    BatchNorm buffers to average); the default stays BatchNorm."""
    from hpcfl.config import config_from_dict
    from hpcfl.models import build_model

    cfg = config_from_dict({"model": "resnet8", "model_options": {"norm": "gn"}, "dataset": "cifar10"})
    gn = build_model(cfg.model, (3, 32, 32), 10, **cfg.model_options)
    norms = [m for m in gn.modules() if isinstance(m, (nn.GroupNorm, nn.BatchNorm2d))]
    assert norms and all(isinstance(m, nn.GroupNorm) and m.num_groups == 2 for m in norms)
    assert not list(gn.buffers())
    bn = build_model("resnet8", (3, 32, 32), 10)
    assert any(isinstance(m, nn.BatchNorm2d) for m in bn.modules())
