"""FedPVR, FedDyn, FedNova, FedAdam, FedYogi and FedAdagrad against the algorithms they reduce to (bit for bit where the
arithmetic allows), against direct computations of their steps, on the heterogeneous least-squares
problem, and through checkpoint / resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hpcfl.algorithms import FedAdam, FedAvg, FedDyn, FedNova, FedPVR, Scaffold, Trainer
from hpcfl.algorithms.base import ClientData, ServerState
from hpcfl.algorithms.participation import Participation
from hpcfl.errors import ConfigError
from hpcfl.training import FlatModel, LocalSchedule
from hpcfl.training.layout import StateLayout
from tests.helpers import simulate
from tests.test_algorithms import _least_squares_clients, _mse, _run


def _model() -> nn.Module:
    """Conv + BatchNorm feature extractor, then two Linear layers (the default FedPVR mask)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 8 * 8, 8),
        nn.ReLU(),
        nn.Linear(8, 3),
    )


def _clients(K: int = 4) -> list[ClientData]:
    """Non-IID classification: client k mostly sees class k % 3; sizes differ."""
    g = torch.Generator().manual_seed(5)
    out = []
    for k in range(K):
        n = 12 + 5 * k
        y = torch.where(torch.rand(n, generator=g) < 0.8, k % 3, torch.randint(0, 3, (n,), generator=g))
        x = torch.randn(n, 1, 8, 8, generator=g) + y.view(-1, 1, 1, 1).float()
        out.append(ClientData(k, x, y))
    return out


def _simulate(cls, params, *, rounds=3, momentum=0.0, steps: int | None = 3, per_round=None, clients=None):
    """``rounds`` rounds of ``cls`` on :func:`_clients` through the real round loop."""
    model = _model()
    flat = FlatModel(model)
    sched = LocalSchedule(lr=0.05, batch_size=8, steps=steps, momentum=momentum, weight_decay=1e-4)
    algo = cls(params, layout=StateLayout.of_model(model), participation=Participation(count=per_round))
    server, states = simulate(algo, clients or _clients(), Trainer(flat, sched), rounds, reduction="float64")
    return server, states


# -- FedPVR --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("momentum", "on_corrected", "per_round"),
    [(0.0, False, None), (0.0, False, 2), (0.9, True, None), (0.9, True, 2)],
)
def test_fedpvr_full_mask_is_scaffold_control_variates_bit_for_bit(momentum, on_corrected, per_round):
    pvr, pvr_states = _simulate(
        FedPVR,
        FedPVR.Params(start_param=0, momentum_on_corrected=on_corrected),
        momentum=momentum,
        per_round=per_round,
    )
    sc, sc_states = _simulate(
        Scaffold, Scaffold.Params(form="control_variates"), momentum=momentum, per_round=per_round
    )
    assert torch.equal(pvr.x, sc.x)
    assert torch.equal(pvr.c, sc.c)
    assert pvr_states.states.keys() == sc_states.states.keys()
    for k, state in pvr_states.states.items():
        assert torch.equal(state.c, sc_states.states[k].h), k


def test_fedpvr_full_mask_without_momentum_on_corrected_is_scaffold_at_momentum_zero():
    """Paper-code momentum handling: every parameter corrected, so none takes momentum."""
    pvr, _ = _simulate(FedPVR, FedPVR.Params(start_param=0), momentum=0.9, per_round=2)
    sc, _ = _simulate(Scaffold, Scaffold.Params(form="control_variates"), momentum=0.0, per_round=2)
    assert torch.equal(pvr.x, sc.x) and torch.equal(pvr.c, sc.c)


@pytest.mark.parametrize(("momentum", "per_round"), [(0.0, None), (0.9, None), (0.9, 2)])
def test_fedpvr_empty_mask_is_fedavg_bit_for_bit(momentum, per_round):
    """With FedAvg's n_k-weighted mean (``weighting: samples``; FedPVR's default is uniform)."""
    n_tensors = sum(1 for _ in _model().parameters())
    params = FedPVR.Params(start_param=n_tensors, weighting="samples")
    pvr, _ = _simulate(FedPVR, params, momentum=momentum, per_round=per_round)
    avg, _ = _simulate(FedAvg, FedAvg.Params(), momentum=momentum, per_round=per_round)
    assert torch.equal(pvr.x, avg.x)
    assert pvr.c.numel() == 0
    algo = FedPVR(params, layout=StateLayout.of_model(_model()))
    assert [s.name for s in algo.exchange().sums] == ["x"]


def test_fedpvr_momentum_only_on_the_plain_sgd_part_matches_torch_sgd_param_groups():
    """Round 1 (c = c_k = 0): the masked Linear layers take plain SGD steps, the rest momentum SGD;
    the reference is ``torch.optim.SGD`` with one parameter group per treatment."""
    data = _clients(1)[0]
    sched = LocalSchedule(lr=0.05, batch_size=1000, steps=4, momentum=0.9, weight_decay=1e-4)
    model = _model()
    algo = FedPVR(FedPVR.Params(), layout=StateLayout.of_model(model))
    new, _ = simulate(algo, [data], Trainer(FlatModel(model), sched), rounds=1)

    ref = _model()
    masked = [p for name, p in ref.named_parameters() if name.split(".")[0] in ("4", "6")]
    others = [p for name, p in ref.named_parameters() if name.split(".")[0] not in ("4", "6")]
    opt = torch.optim.SGD(
        [{"params": others, "momentum": 0.9}, {"params": masked, "momentum": 0.0}], lr=0.05, weight_decay=1e-4
    )
    ref.train()
    for _ in range(4):
        opt.zero_grad()
        nn.functional.cross_entropy(ref(data.x), data.y).backward()
        opt.step()
    expected = torch.cat([p.detach().flatten() for p in ref.parameters()])
    torch.testing.assert_close(new.x[: expected.numel()], expected, rtol=1e-5, atol=1e-6)


def test_fedpvr_server_step_is_eq_8_and_9():
    """x ← (1 − η_g)x + η_g·mean y_i; c ← c + Σ_S Δc_i / N (Eq. 9 under full participation)."""
    from hpcfl.algorithms.base import Aggregate, ServerContext
    from hpcfl.algorithms.participation import Population

    layout = StateLayout.of_model(_model())
    algo = FedPVR(FedPVR.Params(server_lr=0.5), layout=layout)
    g = torch.Generator().manual_seed(0)
    server = algo.init_server(torch.randn(layout.size, generator=g))
    server.c = torch.randn(algo.mask_size, generator=g)
    total, dc = torch.randn(layout.size, generator=g), torch.randn(algo.mask_size, generator=g)
    ctx = ServerContext(0, (0, 2), Population((5, 6, 7, 8)), lambda t: t)
    new, _ = algo.server_update(server, Aggregate({"x": total, "dc": dc}, 12.0, 2), ctx)
    torch.testing.assert_close(new.x, 0.5 * server.x + 0.5 * total / 12.0)
    torch.testing.assert_close(new.c, server.c + dc / 4)


def test_fedpvr_mask_rules():
    from hpcfl.models import build_model

    vgg = StateLayout.of_model(build_model("vgg11", (3, 32, 32), 10))
    assert (
        FedPVR(FedPVR.Params(), layout=vgg).spans == FedPVR(FedPVR.Params(start_param=16), layout=vgg).spans
    )
    assert [e.module for e in vgg.entries if e.kind == "param"][16:] == ["fc1", "fc1", "fc2", "fc2"] + [
        "classifier"
    ] * 2
    resnet = StateLayout.of_model(build_model("resnet8", (3, 32, 32), 10))
    default = FedPVR(FedPVR.Params(), layout=resnet)
    classifier = resnet.params_of(["classifier"])
    assert default.mask_size == sum(e.size for e in classifier)
    assert default.spans == FedPVR(FedPVR.Params(layers=("classifier",)), layout=resnet).spans
    assert default.spans == FedPVR(FedPVR.Params(start_param=-2), layout=resnet).spans
    tiny = StateLayout.of_model(_model())
    assert FedPVR(FedPVR.Params(), layout=tiny).spans == ((tiny.entries[4].start, tiny.num_params),)
    with pytest.raises(ConfigError, match="exclude each other"):
        FedPVR.Params(layers=("fc1",), start_param=3)
    with pytest.raises(ConfigError, match="start_param"):
        FedPVR(FedPVR.Params(start_param=99), layout=tiny)
    conv_last = StateLayout.of_model(nn.Sequential(nn.Linear(4, 4), nn.Conv1d(1, 1, 1)))
    with pytest.raises(ConfigError, match="params.layers"):
        FedPVR(FedPVR.Params(), layout=conv_last)


def test_fedpvr_with_the_full_mask_reaches_the_least_squares_optimum_like_scaffold():
    """10 of 50 clients per round (the SCAFFOLD test's problem): the mask covering everything (the
    default for a single Linear layer) reaches the optimum of (1/N)Σ f_i; SCAFFOLD ends identical."""
    clients = _least_squares_clients(K=50, d=4, seed=1)
    hess = sum(c.x.T @ c.x / c.n for c in clients)
    w_star = torch.linalg.solve(hess, sum(c.x.T @ c.y / c.n for c in clients))
    lr = 0.1 / float(max(torch.linalg.eigvalsh(c.x.T @ c.x / c.n).max() for c in clients))
    w_pvr = _run(FedPVR, FedPVR.Params(), clients, rounds=200, steps=10, lr=lr, per_round=10)
    w_sc = _run(Scaffold, Scaffold.Params(), clients, rounds=200, steps=10, lr=lr, per_round=10)
    assert float(torch.linalg.norm(w_pvr - w_star) / torch.linalg.norm(w_star)) < 1e-6
    assert torch.equal(w_pvr, w_sc)


def test_fedpvr_full_mask_equals_scaffold_one_model_only_with_the_uniform_mean():
    """Full participation, momentum 0, equal step counts: the control-variate form (FedPVR's) and
    TCT's one-model form agree in exact arithmetic when the server mean is the uniform one (both
    defaults), so up to rounding, on clients of unequal sizes; with the n_k-weighted mean
    (``weighting: samples``) they are different algorithms unless all sizes are equal."""
    unequal = _least_squares_clients(K=4)
    equal = [ClientData(c.k, c.x[:20], c.y[:20]) for c in unequal]
    for clients, weighting, same in (
        (unequal, "uniform", True),
        (equal, "samples", True),
        (unequal, "samples", False),
    ):
        w_pvr = _run(FedPVR, FedPVR.Params(weighting=weighting), clients, rounds=20, steps=5, lr=0.01)
        w_one = _run(
            Scaffold,
            Scaffold.Params(form="one_model", weighting=weighting),
            clients,
            rounds=20,
            steps=5,
            lr=0.01,
        )
        gap = float(torch.linalg.norm(w_pvr - w_one) / torch.linalg.norm(w_one))
        assert (gap < 1e-12) if same else (gap > 1e-6), (weighting, same, gap)
        assert not torch.equal(w_pvr, w_one)


# -- FedNova -------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_round", [None, 2])
def test_fednova_with_equal_power_of_two_steps_is_fedavg_bit_for_bit(per_round):
    nova, _ = _simulate(FedNova, FedNova.Params(), steps=4, per_round=per_round)
    avg, _ = _simulate(FedAvg, FedAvg.Params(), steps=4, per_round=per_round)
    assert torch.equal(nova.x, avg.x)


def test_fednova_with_equal_steps_is_fedavg_up_to_rounding():
    nova, _ = _simulate(FedNova, FedNova.Params(), steps=5, momentum=0.5)
    avg, _ = _simulate(FedAvg, FedAvg.Params(), steps=5, momentum=0.5)
    torch.testing.assert_close(nova.x, avg.x, rtol=1e-5, atol=1e-6)


def test_fednova_normalises_unequal_step_counts_as_the_paper():
    """Epoch mode, clients of different sizes take different τ_k; the server step equals
    x − τ_eff Σ p_k (x − y_k)/‖a_k‖₁ computed from each client's own local model."""
    from hpcfl.algorithms.fednova import local_norm

    clients = _least_squares_clients(K=3)
    sched = LocalSchedule(lr=0.01, batch_size=8, epochs=1, momentum=0.5, weight_decay=0.0)
    model = nn.Linear(6, 1, bias=False).double()
    nn.init.zeros_(model.weight)
    flat = FlatModel(model)
    trainer = Trainer(flat, sched, loss_fn=_mse)
    x0 = flat.vector.clone()
    algo = FedNova(FedNova.Params(), layout=StateLayout.of_model(model))
    new, _ = simulate(algo, clients, trainer, rounds=1, server=ServerState(x=x0.clone()), reduction="float64")
    taus = [sched.num_steps(c.n) for c in clients]
    assert len(set(taus)) == 3
    norms = [local_norm(t, 0.5) for t in taus]
    ys = [trainer.train(x0, c, torch.Generator())[0] for c in clients]
    p = [c.n / sum(c.n for c in clients) for c in clients]
    tau_eff = sum(pk * a for pk, a in zip(p, norms, strict=True))
    expected = x0 - tau_eff * sum(pk * (x0 - y) / a for pk, y, a in zip(p, ys, norms, strict=True))
    torch.testing.assert_close(new.x, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9])
def test_fednova_local_norm_is_the_momentum_sgd_step_sum(momentum):
    """Under a constant gradient c, τ steps of momentum SGD move the weights by lr·‖a‖₁·c."""
    from hpcfl.algorithms.fednova import local_norm
    from tests.helpers import local_sgd

    model = nn.Linear(3, 1, bias=False).double()
    nn.init.zeros_(model.weight)
    flat = FlatModel(model)
    c = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64)
    sched = LocalSchedule(lr=0.1, batch_size=4, steps=7, momentum=momentum, weight_decay=0.0)
    data = torch.zeros(4, 3, dtype=torch.float64)
    local_sgd(
        flat, data, torch.zeros(4), sched, torch.Generator(), loss_fn=lambda m, x, y: (m.weight * c).sum()
    )
    torch.testing.assert_close(flat.vector, -0.1 * local_norm(7, momentum) * c.flatten(), rtol=1e-12, atol=0)


# -- FedAdam -------------------------------------------------------------------------------------


def test_fedadam_server_step_is_adam_on_the_pseudo_gradients():
    """Each round's pseudo-gradient Δ_t = FedAvg(x_t) − x_t is recomputed with FedAvg's own round
    from x_t; Adam without bias correction (Algorithm 2, v₋₁ = τ²) is applied by hand."""
    clients = _least_squares_clients(K=3)
    params = FedAdam.Params(server_lr=0.05, beta1=0.8, beta2=0.95, tau=1e-2)

    def setup(cls, p):
        model = nn.Linear(6, 1, bias=False).double()
        nn.init.zeros_(model.weight)
        flat = FlatModel(model)
        sched = LocalSchedule(lr=0.01, batch_size=10_000, steps=5, weight_decay=0.0)
        return cls(p, layout=StateLayout.of_model(model)), Trainer(flat, sched, loss_fn=_mse), flat

    algo, trainer, flat = setup(FedAdam, params)
    rounds = 4
    adam, _ = simulate(algo, clients, trainer, rounds, reduction="float64")

    avg, trainer, _ = setup(FedAvg, FedAvg.Params())
    x = flat.vector.clone() * 0
    m = torch.zeros_like(x)
    v = torch.full_like(x, params.tau**2)
    for _ in range(rounds):
        averaged, _ = simulate(avg, clients, trainer, 1, server=ServerState(x=x.clone()), reduction="float64")
        delta = averaged.x - x
        m = params.beta1 * m + (1 - params.beta1) * delta
        v = params.beta2 * v + (1 - params.beta2) * delta**2
        x = x + params.server_lr * m / (torch.sqrt(v) + params.tau)
    torch.testing.assert_close(adam.x, x, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(adam.m, m, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(adam.v, v, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", ["fedyogi", "fedadagrad"])
def test_fedyogi_and_fedadagrad_server_steps_are_algorithm_2_on_the_pseudo_gradients(name):
    """As FedAdam's test: each round's Δ_t = FedAvg(x_t) − x_t from FedAvg's own round, and the
    second moment of Reddi et al. (2021) Algorithm 2 applied by hand in float64 (v₋₁ = τ²)."""
    from hpcfl.registry import ALGORITHMS

    cls = ALGORITHMS[name]
    clients = _least_squares_clients(K=3)
    if name == "fedyogi":
        params = cls.Params(server_lr=0.05, beta1=0.8, beta2=0.5, tau=1e-2)
    else:
        params = cls.Params(server_lr=0.05, beta1=0.8, tau=1e-2)

    def setup(c, p):
        model = nn.Linear(6, 1, bias=False).double()
        nn.init.zeros_(model.weight)
        flat = FlatModel(model)
        sched = LocalSchedule(lr=0.01, batch_size=10_000, steps=5, weight_decay=0.0)
        return c(p, layout=StateLayout.of_model(model)), Trainer(flat, sched, loss_fn=_mse), flat

    algo, trainer, flat = setup(cls, params)
    rounds = 6
    opt, _ = simulate(algo, clients, trainer, rounds, reduction="float64")

    avg, trainer, _ = setup(FedAvg, FedAvg.Params())
    x = flat.vector.clone() * 0
    m = torch.zeros_like(x)
    v = torch.full_like(x, params.tau**2)
    signs = set()
    for _ in range(rounds):
        averaged, _ = simulate(avg, clients, trainer, 1, server=ServerState(x=x.clone()), reduction="float64")
        delta = averaged.x - x
        m = params.beta1 * m + (1 - params.beta1) * delta
        if name == "fedyogi":
            sign = torch.sign(v - delta**2)
            signs |= set(sign.tolist())
            v = v - (1 - params.beta2) * delta**2 * sign
        else:
            v = v + delta**2
        x = x + params.server_lr * m / (torch.sqrt(v) + params.tau)
    if name == "fedyogi":
        assert signs >= {-1.0, 1.0}  # both branches of Yogi's sign were taken
    torch.testing.assert_close(opt.x, x, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(opt.m, m, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(opt.v, v, rtol=1e-12, atol=1e-14)


def test_yogi_and_adagrad_steps_on_hand_computed_numbers():
    """One step of each rule on three entries, worked out by hand (float64): Yogi's v moves up by
    (1 − β2)Δ² where v < Δ², down where v > Δ², and not at all where v = Δ²."""
    from hpcfl.algorithms.server_opt import adagrad_step, yogi_step

    m = torch.tensor([0.5, -1.0, 0.0], dtype=torch.float64)
    v = torch.tensor([1.0, 0.25, 4.0], dtype=torch.float64)
    delta = torch.tensor([2.0, 1.0, -2.0], dtype=torch.float64)  # Δ² = 4, 1, 4
    # m = 0.5·m + 0.5·Δ = [1.25, 0, -1]
    step, m1, v1 = yogi_step(m, v, delta, lr=0.1, beta1=0.5, beta2=0.75, tau=1.0)
    # v = v − 0.25·Δ²·sign(v − Δ²) = [1 + 1, 0.25 + 0.25, 4 − 0] = [2, 0.5, 4]
    torch.testing.assert_close(m1, torch.tensor([1.25, 0.0, -1.0], dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(v1, torch.tensor([2.0, 0.5, 4.0], dtype=torch.float64), rtol=0, atol=0)
    expected = 0.1 * torch.tensor([1.25 / (2**0.5 + 1), 0.0, -1.0 / 3], dtype=torch.float64)
    torch.testing.assert_close(step, expected, rtol=1e-15, atol=0)
    v = torch.tensor([5.0, 0.25, 5.0], dtype=torch.float64)  # now v > Δ² on the first and last
    _, _, v2 = yogi_step(m, v, delta, lr=0.1, beta1=0.5, beta2=0.75, tau=1.0)
    torch.testing.assert_close(v2, torch.tensor([4.0, 0.5, 4.0], dtype=torch.float64), rtol=0, atol=0)

    step, m3, v3 = adagrad_step(m, v, delta, lr=0.1, beta1=0.5, tau=1.0)
    # v = v + Δ² = [9, 1.25, 9]
    torch.testing.assert_close(m3, torch.tensor([1.25, 0.0, -1.0], dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(v3, torch.tensor([9.0, 1.25, 9.0], dtype=torch.float64), rtol=0, atol=0)
    expected = 0.1 * torch.tensor([1.25 / 4, 0.0, -1.0 / 4], dtype=torch.float64)
    torch.testing.assert_close(step, expected, rtol=1e-15, atol=0)


@pytest.mark.parametrize(
    ("name", "key", "value"),
    [
        ("fedyogi", "beta2", 1.0),
        ("fedyogi", "server_lr", 0.0),
        ("fedadagrad", "beta1", -0.1),
        ("fedadagrad", "tau", 0.0),
        ("fedadagrad", "server_lr", -1.0),
    ],
)
def test_fedyogi_and_fedadagrad_refuse_bad_params_in_one_line(name, key, value):
    from hpcfl.registry import ALGORITHMS

    with pytest.raises(ConfigError, match=rf"^config key 'params\.{key}' must be"):
        ALGORITHMS[name].Params(**{key: value})


# -- FedDyn --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("momentum", "per_round"), [(0.0, None), (0.9, 2)])
def test_feddyn_alpha_zero_is_fedavg_bit_for_bit(momentum, per_round):
    dyn, states = _simulate(
        FedDyn, FedDyn.Params(alpha=0.0, weighting="samples"), momentum=momentum, per_round=per_round
    )
    avg, _ = _simulate(FedAvg, FedAvg.Params(), momentum=momentum, per_round=per_round)
    assert torch.equal(dyn.x, avg.x)
    assert not torch.any(dyn.h)


def test_feddyn_small_alpha_tends_to_the_closed_form_limit_not_fedavg():
    """α → 0⁺: clients become FedAvg's, and the server model tends to
    θ^t = mean θ_k^t + (1/N)Σ_{s≤t}Σ_k(θ_k^s − θ^{s−1}) (the h/α of Algorithm 1 does not vanish)."""
    clients = _least_squares_clients(K=3)
    model = nn.Linear(6, 1, bias=False).double()
    nn.init.zeros_(model.weight)
    flat = FlatModel(model)
    trainer = Trainer(
        flat, LocalSchedule(lr=0.01, batch_size=10_000, steps=5, weight_decay=0.0), loss_fn=_mse
    )
    x0 = flat.vector.clone()
    algo = FedDyn(FedDyn.Params(alpha=1e-9), layout=StateLayout.of_model(model))
    rounds = 3
    dyn, _ = simulate(algo, clients, trainer, rounds, server=algo.init_server(x0), reduction="float64")

    theta, drift = x0.clone(), torch.zeros_like(x0)
    for _ in range(rounds):
        ys = [trainer.train(theta, c, torch.Generator())[0] for c in clients]
        drift = drift + sum(y - theta for y in ys) / len(clients)
        theta = sum(ys) / len(clients) + drift
    avg = _run(FedAvg, FedAvg.Params(), clients, rounds=rounds, steps=5, lr=0.01)
    torch.testing.assert_close(dyn.x, theta, rtol=1e-6, atol=1e-8)
    assert float(torch.linalg.norm(dyn.x - avg)) > 1e-2 * float(torch.linalg.norm(avg))


@pytest.mark.parametrize(("weighting", "per_round"), [("uniform", None), ("samples", None), ("uniform", 2)])
def test_feddyn_reaches_the_least_squares_optimum(weighting, per_round):
    """FedDyn's fixed point is the optimum of (1/N)Σ L_k (uniform) or of Σ n_k L_k (samples), also
    with inexact local solves (5 full-batch steps) and partial participation; FedAvg's is not."""
    clients = _least_squares_clients(K=4)
    if weighting == "uniform":
        hess = sum(c.x.T @ c.x / c.n for c in clients)
        w_star = torch.linalg.solve(hess, sum(c.x.T @ c.y / c.n for c in clients))
    else:
        a, b = torch.cat([c.x for c in clients]), torch.cat([c.y for c in clients])
        w_star = torch.linalg.lstsq(a, b.unsqueeze(1)).solution.squeeze(1)
    L = float(max(torch.linalg.eigvalsh(c.x.T @ c.x / c.n).max() for c in clients))
    params = FedDyn.Params(alpha=0.1 * L, weighting=weighting)
    w_dyn = _run(FedDyn, params, clients, rounds=300, steps=5, lr=0.5 / L, per_round=per_round)
    w_avg = _run(FedAvg, FedAvg.Params(), clients, rounds=300, steps=5, lr=0.5 / L, per_round=per_round)
    err = lambda w: float(torch.linalg.norm(w - w_star) / torch.linalg.norm(w_star))  # noqa: E731
    assert err(w_dyn) < 1e-6, err(w_dyn)
    assert err(w_avg) > 1e-3, err(w_avg)


# -- states, bytes, resume -----------------------------------------------------------------------


def _partial_cfg(tmp_path: Path, algorithm: str, **extra):
    from tests.helpers import synthetic_config

    keys = dict(
        num_clients=9,
        clients_per_round=5,
        algorithm=algorithm,
        rounds=5,
        local_steps=3,
        dataset_options={"n_train": 900, "n_test": 100, "seed": 3},
    )
    keys.update(extra)
    return synthetic_config(tmp_path, **keys)


def test_fedpvr_counted_bytes_are_model_plus_masked_slice(tmp_path: Path):
    from hpcfl.config import load_config
    from hpcfl.runner import run_experiment

    cfg = load_config(_partial_cfg(tmp_path, "fedpvr", rounds=2, params={"layers": ["classifier"]}))
    res = run_experiment(cfg, tmp_path / "pvr")
    L = res.server.x.numel()
    v = res.server.c.numel()
    mlp_classifier = 100 * 10 + 10  # 100 hidden units -> 10 classes
    assert 0 < v < L and v == mlp_classifier
    row = res.metrics[-1]
    assert row["bytes_up"] == 5 * (L + v) * 4
    assert row["bytes_down"] == 5 * (L + v) * 4


def test_fednova_uploads_its_three_scalars_beside_the_model(tmp_path: Path):
    """FedAvg's traffic plus FedNova's three scalars up; only the model down. (Every algorithm's
    bytes_down, weights-only checkpoint and stop/resume are checked by tests/test_contract.py.)"""
    from hpcfl.config import load_config
    from hpcfl.runner import run_experiment

    res = run_experiment(load_config(_partial_cfg(tmp_path, "fednova", rounds=1)), tmp_path / "fednova")
    L = res.server.x.numel()
    row = res.metrics[-1]
    assert row["bytes_up"] == 5 * (L + 3) * 4
    assert row["bytes_down"] == 5 * L * 4


# -- FedAvgM -------------------------------------------------------------------------------------


def test_fedavgm_without_momentum_and_unit_step_is_fedavg_to_rounding():
    from hpcfl.algorithms.fedavgm import FedAvgM

    m, _ = _simulate(FedAvgM, FedAvgM.Params(beta=0.0, server_lr=1.0), momentum=0.5, per_round=2)
    avg, _ = _simulate(FedAvg, FedAvg.Params(), momentum=0.5, per_round=2)
    torch.testing.assert_close(m.x, avg.x, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(m.v) > 0  # v = Δ of the last round, kept server-side


def test_fedavgm_server_steps_are_heavy_ball_momentum_on_the_pseudo_gradient():
    """Two server steps against a direct computation: v ← βv + Δ, x ← x + ηv on the trainable
    parameters; the BatchNorm buffers take the mean; v is server-only (not in bytes_down)."""
    from hpcfl.algorithms.base import Aggregate, ServerContext
    from hpcfl.algorithms.fedavgm import FedAvgM, FedAvgMServerState
    from hpcfl.algorithms.participation import Population

    layout = StateLayout.of_model(_model())
    P, L = layout.num_params, layout.size
    assert P < L  # the model has BatchNorm buffers after its parameters
    algo = FedAvgM(FedAvgM.Params(server_lr=0.7, beta=0.9), layout=layout)
    g = torch.Generator().manual_seed(1)
    server = algo.init_server(torch.randn(L, generator=g))
    x, v = server.x.clone(), torch.zeros(P)
    ctx = ServerContext(0, (0, 1), Population((3, 4)), lambda t: t)
    for _ in range(2):
        total = torch.randn(L, generator=g) * 7.0
        server, _ = algo.server_update(server, Aggregate({"x": total}, 7.0, 2), ctx)
        mean = total / 7.0
        v = 0.9 * v + (mean[:P] - x[:P])
        x = torch.cat([x[:P] + 0.7 * v, mean[P:]])
        torch.testing.assert_close(server.v, v)
        torch.testing.assert_close(server.x, x)
    assert FedAvgMServerState.server_only == ("v",)
