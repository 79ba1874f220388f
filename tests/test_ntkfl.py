"""NTK-FL and CP-NTK-FL: the Jacobians, the closed-form evolution against explicit gradient descent,
the kernel across ranks, the shuffling invariance, CP-NTK-FL's reduction to NTK-FL, the memory
guard, resume, and a short Fashion-MNIST check against FedAvg."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hpcfl.algorithms import ClientData, Trainer
from hpcfl.algorithms.base import Aggregate, ServerContext
from hpcfl.algorithms.cp_ntkfl import CPNTKFL, CPNTKFLParams, densify, sparsify
from hpcfl.algorithms.ntkfl import NTKFL, NTKFLParams
from hpcfl.algorithms.participation import Population
from hpcfl.entk.jacobian import (
    FactoredJacobian,
    JacobianMethod,
    factored_jacobian,
    per_sample_jacobian,
    resolve_method,
)
from hpcfl.errors import ConfigError
from hpcfl.models.mlp import MLP
from hpcfl.ntk.evolution import evolve, kernel, weight_updates
from hpcfl.ntk.memory import RoundShape, check_round_memory, round_memory_bytes
from hpcfl.runner.rounds import _nbytes
from hpcfl.training.flat import FlatModel
from hpcfl.training.layout import StateLayout
from hpcfl.training.sgd import LocalSchedule
from tests.helpers import REPO, client_ctx, run_mpi_program, simulate, synthetic_config


def _mlp(d_in: int = 6, classes: int = 3, dtype: torch.dtype = torch.float64, seed: int = 0) -> FlatModel:
    torch.manual_seed(seed)
    model = MLP((1, 1, d_in), classes).to(dtype)
    return FlatModel(model)


def _clients(
    sizes: list[int], d_in: int = 6, classes: int = 3, dtype=torch.float64, seed: int = 1
) -> list[ClientData]:
    g = torch.Generator().manual_seed(seed)
    return [
        ClientData(
            k, torch.randn(n, d_in, generator=g, dtype=dtype), torch.randint(0, classes, (n,), generator=g)
        )
        for k, n in enumerate(sizes)
    ]


def _algo(cls, flat: FlatModel, **params):
    algo = cls(cls.Params(**params), layout=StateLayout.of_model(flat.model))
    algo.attach(flat.model)
    return algo


def _trainer(flat: FlatModel) -> Trainer:
    return Trainer(flat, LocalSchedule(lr=0.1, batch_size=10, epochs=1))


# -- Jacobians -----------------------------------------------------------------------------------


def test_fused_jacobian_equals_vmap_jacrev_for_every_output_and_parameter():
    flat = _mlp(d_in=7, classes=4)
    x = torch.randn(9, 7, dtype=torch.float64)
    fused = per_sample_jacobian(flat.model, x, method="fused", batch_size=4)
    base = per_sample_jacobian(flat.model, x, method="vmap")
    assert fused.shape == (9, 4, flat.num_params)
    assert torch.allclose(fused, base, rtol=1e-12, atol=1e-14)
    # row b is ∂f(x_b)/∂θ in the flat vector's order
    grads = torch.autograd.grad(flat.model(x[2:3])[0, 1], list(flat.model.parameters()))
    assert torch.allclose(fused[2, 1], torch.cat([g.flatten() for g in grads]), rtol=1e-12, atol=1e-14)


def test_jacobian_methods_are_an_enum_and_a_config_string_converts_at_the_edge():
    """Issue 55: the methods that exist are :class:`JacobianMethod`; the strings of configs and the
    CLI still select them, an unknown one is one line naming the choices, and ``auto`` resolves by
    the model (fused for an all-Linear model, vmap otherwise)."""
    flat = _mlp(d_in=5, classes=3)
    x = torch.randn(4, 5, dtype=torch.float64)
    by_string = per_sample_jacobian(flat.model, x, method="vmap")
    assert torch.equal(per_sample_jacobian(flat.model, x, method=JacobianMethod.VMAP), by_string)
    assert resolve_method(flat.model, "auto") is JacobianMethod.FUSED
    conv = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Flatten(), torch.nn.Linear(8, 3))
    assert resolve_method(conv, JacobianMethod.AUTO) is JacobianMethod.VMAP
    with pytest.raises(ConfigError, match="nn.Linear"):
        resolve_method(conv, "fused")
    with pytest.raises(ConfigError) as err:
        per_sample_jacobian(flat.model, x, method="fusd")
    assert (
        str(err.value)
        == "unknown Jacobian method 'fusd' (did you mean 'fused'?); choose one of: auto, fused, vmap"
    )
    with pytest.raises(ConfigError, match="config key 'params.jacobian' must be one of auto, fused, vmap"):
        NTKFLParams(jacobian="jacrev")
    assert NTKFLParams(jacobian="vmap").jacobian_method is JacobianMethod.VMAP


def test_factored_jacobian_is_the_dense_one_and_its_products_are_exact():
    """The Linear-layer factors expand to vmap(jacrev)'s Jacobian; the Gram matrix and the
    transposed product computed from the factors equal the dense ones; rows/cat/split regroup."""
    flat = _mlp(d_in=7, classes=4)
    g = torch.Generator().manual_seed(5)
    xa, xb = (
        torch.randn(6, 7, generator=g, dtype=torch.float64),
        torch.randn(4, 7, generator=g, dtype=torch.float64),
    )
    fa, fb = factored_jacobian(flat.model, xa), factored_jacobian(flat.model, xb)
    Ja, Jb = (
        per_sample_jacobian(flat.model, xa, method="vmap"),
        per_sample_jacobian(flat.model, xb, method="vmap"),
    )
    assert fa.shape == Ja.shape == (6, 4, flat.num_params)
    assert torch.allclose(fa.dense(), Ja, rtol=1e-12, atol=1e-14)
    assert torch.allclose(fa.gram(fb), Ja.reshape(6, -1) @ Jb.reshape(4, -1).T, rtol=1e-12, atol=1e-12)
    S = torch.randn(3, 6, 4, generator=g, dtype=torch.float64)
    assert torch.allclose(
        fa.transposed_product(S), S.reshape(3, 24) @ Ja.reshape(24, -1), rtol=1e-12, atol=1e-12
    )
    both = FactoredJacobian.cat([fa, fb])
    perm = torch.randperm(10, generator=g)
    assert torch.equal(both.rows(perm).dense(), torch.cat([fa.dense(), fb.dense()])[perm])
    back = both.split([6, 4])
    assert torch.equal(back[1].dense(), fb.dense())
    # ~C·P / (Σ in + C·Σ out) fewer numbers on the wire
    assert _nbytes(fa) < Ja.nbytes / 5


def test_factored_and_dense_uploads_give_the_same_round():
    flat = _mlp()
    clients = _clients([7, 4, 9])
    x0 = flat.vector.clone()
    common = dict(grid=(5, 50, 200), eta=0.5, kernel_cond=True)
    dense, m_dense = _round(_algo(NTKFL, flat, upload="dense", **common), flat, clients)
    flat.load(x0)
    fact, m_fact = _round(_algo(NTKFL, flat, upload="factored", **common), flat, clients)
    assert torch.allclose(fact.x, dense.x, rtol=1e-10, atol=1e-12)
    assert m_fact["t_star"] == m_dense["t_star"]
    assert m_fact["kernel_cond"] == pytest.approx(m_dense["kernel_cond"], rel=1e-8)
    assert not torch.equal(fact.x, x0)


# -- the closed form -----------------------------------------------------------------------------


def test_closed_form_evolution_equals_gradient_descent_of_the_linearised_network():
    """One output (C = 1): the kernel is the full NTK, and ``discrete`` MSE evolution with the weight
    update Δw(t) is exactly t steps of gradient descent on ½·mean (f_lin − y)², float64."""
    flat = _mlp(d_in=5, classes=1)
    x = torch.randn(12, 5, dtype=torch.float64)
    y = torch.randn(12, 1, dtype=torch.float64)
    J3 = per_sample_jacobian(flat.model, x)  # (N, 1, P)
    J = J3[:, 0]  # (N, P)
    with torch.no_grad():
        f0 = flat.model(x)
    N, eta, grid = 12, 0.3, [0, 1, 7, 40]
    H = kernel([J3[:5], J3[5:]], 0, 1, lambda t: t)
    evo = evolve(H, f0, y, lr=eta, grid=grid, mode="discrete", loss="mse")
    dw = weight_updates([J3[:5], J3[5:]], evo.sums, [0, 1], lr=eta)
    w0 = flat.params.clone()
    w = w0.clone()
    for t in range(max(grid) + 1):
        if t in grid:
            i = grid.index(t)
            f_lin = f0 + (J @ (w - w0)).unsqueeze(1)
            assert torch.allclose(w0 + dw[i], w, rtol=1e-10, atol=1e-12), t
            assert torch.allclose(evo.outputs[i], f_lin, rtol=1e-10, atol=1e-12), t
        f_lin = f0 + (J @ (w - w0)).unsqueeze(1)
        w = w - (eta / N) * J.T @ (f_lin - y).squeeze(1)


def test_mse_flow_is_the_closed_form_of_the_linearised_gradient_flow_of_hpcfls_loss():
    """Tiny MLP, C = 1 (H is the full NTK): the ``flow`` outputs are Y + exp(−ηtH/(N·C))(f₀ − Y),
    the gradient flow of hpcfl's loss (1/N)Σ(1/C)Σ½(f − y)² on the linearised model, and the weights
    it returns realise it: J·Δw(t) = f(t) − f(0)."""
    flat = _mlp(d_in=5, classes=1)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(10, 5, generator=g, dtype=torch.float64)
    y = torch.randn(10, 1, generator=g, dtype=torch.float64)
    J3 = per_sample_jacobian(flat.model, x)
    with torch.no_grad():
        f0 = flat.model(x)
    H = kernel([J3], 0, 1, lambda t: t)
    eta, grid = 0.2, [0.0, 3.0, 25.0, 400.0]
    evo = evolve(H, f0, y, lr=eta, grid=grid, mode="flow", loss="mse")
    dw = weight_updates([J3], evo.sums, [0], lr=eta)
    for i, t in enumerate(grid):
        expm = torch.linalg.matrix_exp(-eta * t * H / 10)
        assert torch.allclose(evo.outputs[i], y + expm @ (f0 - y), rtol=1e-9, atol=1e-11), t
        assert torch.allclose(J3[:, 0] @ dw[i], (evo.outputs[i] - f0)[:, 0], rtol=1e-9, atol=1e-10), t


def _linear_round(classes: int = 3, n: int = 14, d: int = 4, seed: int = 6):
    """A linear model (its NTK is exactly H ⊗ I_C), float64 data, its Jacobian and outputs."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(d, classes).double()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    labels = torch.randint(0, classes, (n,), generator=g)
    J = per_sample_jacobian(model, x, method="vmap")  # (n, C, P)
    with torch.no_grad():
        f0 = model(x)
    return model, x, labels, J, f0


@pytest.mark.parametrize("loss", ["mse", "ce"])
@pytest.mark.parametrize("mode", ["discrete", "flow"])
def test_weight_update_realises_the_evolution_on_a_linear_model(loss: str, mode: str):
    """Where linearisation is exact (a linear model, C = 3), J·Δw(t) = f(t) − f(0) of the evolution
    to 1e-10, for both losses and both modes: the evolution runs on the update's own time scale."""
    model, x, labels, J, f0 = _linear_round()
    Y = F.one_hot(labels, 3).double()
    H = kernel([J[:6], J[6:]], 0, 1, lambda t: t)
    grid = [0, 1, 30, 200, 1000]
    evo = evolve(H, f0, Y, lr=0.3, grid=grid, mode=mode, loss=loss)
    dw = weight_updates([J[:6], J[6:]], evo.sums, [0, 1], lr=0.3, per_output=loss == "mse")
    for i in range(len(grid)):
        moved = torch.einsum("ncp,p->nc", J, dw[i])
        assert torch.allclose(moved, evo.outputs[i] - f0, rtol=0, atol=1e-10), (i, loss, mode)
    assert float((evo.outputs[-1] - f0).abs().max()) > 0.1


@pytest.mark.parametrize("loss", ["mse", "ce"])
def test_discrete_evolution_is_gradient_descent_on_hpcfls_loss(loss: str):
    """On a linear model (the linearisation is the model) ``discrete`` with step 1 is t steps of
    gradient descent with lr η on hpcfl's own loss, by autograd: (1/N)Σ(1/C)Σ½(f − y)² for MSE
    (hence the time scale η·t/(N·C)), the mean cross entropy for CE; the sum runs u = 0..t−1."""
    model, x, labels, J, f0 = _linear_round()
    Y = F.one_hot(labels, 3).double()
    H = kernel([J], 0, 1, lambda t: t)
    eta, grid = 0.4, [0, 1, 5, 60]
    evo = evolve(H, f0, Y, lr=eta, grid=grid, mode="discrete", loss=loss)
    dw = weight_updates([J], evo.sums, [0], lr=eta, per_output=loss == "mse")
    flat = FlatModel(model)
    w0 = flat.vector.clone()
    w = w0.clone()
    for t in range(max(grid) + 1):
        if t in grid:
            assert torch.allclose(w0 + dw[grid.index(t)], w, rtol=1e-10, atol=1e-12), (t, loss)
        flat.load(w)
        f = model(x)
        value = 0.5 * ((f - Y) ** 2).mean() if loss == "mse" else F.cross_entropy(f, labels)
        grads = torch.autograd.grad(value, list(model.parameters()))
        w = w - eta * torch.cat([gr.flatten() for gr in grads]).detach()


def test_multi_output_evolution_is_the_kernel_flow_on_the_updates_time_scale():
    """C > 1: f evolves under H ⊗ I (the paper's Eq. 6 kernel) at the rate η/(N·C) of Eq. 10's
    update: ``discrete`` equals iterating f ← f − (η/(N·C))H(f − Y), S ← S + (f − Y), and ``flow``
    equals Y + exp(−ηtH/(N·C))(f₀ − Y)."""
    g = torch.Generator().manual_seed(3)
    A = torch.randn(10, 10, generator=g, dtype=torch.float64)
    H = A @ A.T
    f0 = torch.randn(10, 4, generator=g, dtype=torch.float64)
    Y = F.one_hot(torch.arange(10) % 4, 4).double()
    eta, grid, NC = 0.05, [3, 20], 40
    disc = evolve(H, f0, Y, lr=eta, grid=grid, mode="discrete", loss="mse")
    flow = evolve(H, f0, Y, lr=eta, grid=grid, mode="flow", loss="mse")
    f, acc = f0.clone(), torch.zeros_like(f0)
    for t in range(max(grid) + 1):
        if t in grid:
            i = grid.index(t)
            assert torch.allclose(disc.outputs[i], f, rtol=1e-10, atol=1e-12)
            assert torch.allclose(disc.sums[i], acc, rtol=1e-10, atol=1e-12)
            expm = torch.linalg.matrix_exp(-eta * t * H / NC)
            assert torch.allclose(flow.outputs[i], Y + expm @ (f0 - Y), rtol=1e-9, atol=1e-11)
        acc = acc + (f - Y)
        f = f - (eta / NC) * H @ (f - Y)


def test_ce_discrete_evolution_is_gradient_descent_on_the_softmax_residual():
    g = torch.Generator().manual_seed(4)
    A = torch.randn(6, 6, generator=g, dtype=torch.float64)
    H, f0 = A @ A.T, torch.randn(6, 3, generator=g, dtype=torch.float64)
    Y = F.one_hot(torch.arange(6) % 3, 3).double()
    evo = evolve(H, f0, Y, lr=0.2, grid=[0, 4, 9], loss="ce", mode="discrete")
    assert evo.steps == 9 and evo.eigenvalues is None
    f, acc = f0.clone(), torch.zeros_like(f0)
    for step in range(10):
        if step in (0, 4, 9):
            i = (0, 4, 9).index(step)
            assert torch.allclose(evo.outputs[i], f) and torch.allclose(evo.sums[i], acc)
        r = torch.softmax(f, 1) - Y
        acc, f = acc + r, f - (0.2 / 6) * H @ r


def _ce_problem(eta: float):
    """A tiny MLP's kernel on float64 data with 3 classes, its outputs and one-hot labels."""
    flat = _mlp(d_in=6, classes=3)
    c = _clients([24], seed=11)[0]
    J = per_sample_jacobian(flat.model, c.x)
    with torch.no_grad():
        f0 = flat.model(c.x)
    return kernel([J], 0, 1, lambda t: t), f0, F.one_hot(c.y, 3).double()


@pytest.mark.parametrize(("eta", "grid"), [(0.01, NTKFLParams().grid), (0.5, (25, 50, 100))])
def test_ce_flow_at_shipped_settings_is_within_its_stated_tolerance(eta: float, grid, monkeypatch):
    """The cross-entropy flow at the shipped step (ce_dt 10, h·μ ≤ RK4_STEP) is within RK4_TOLERANCE
    of the movement at every grid point of an RK4 solution with 10× shorter steps: at the defaults (η 0.01, the
    12-point grid), and at η = 0.5, where the stability limit splits the step."""
    import hpcfl.ntk.evolution as ev

    H, f0, Y = _ce_problem(eta)
    shipped = ev.evolve(H, f0, Y, lr=eta, grid=grid, mode="flow", loss="ce", dt=NTKFLParams().ce_dt)
    monkeypatch.setattr(ev, "RK4_STEP", ev.RK4_STEP / 10)
    tight = ev.evolve(H, f0, Y, lr=eta, grid=grid, mode="flow", loss="ce", dt=shipped.dt / 10)
    assert tight.steps >= 10 * shipped.steps
    move = max(float((o - f0).norm()) for o in tight.outputs)
    assert move > 0.05
    for i in range(len(grid)):
        assert float((shipped.outputs[i] - tight.outputs[i]).norm()) <= ev.RK4_TOLERANCE * move, i
        assert float((shipped.sums[i] - tight.sums[i]).norm()) <= ev.RK4_TOLERANCE * float(
            tight.sums[i].norm()
        )
    # the discrete step-1 iteration is the flow's explicit Euler with h = 1: near it, not equal
    disc = ev.evolve(H, f0, Y, lr=eta, grid=grid, mode="discrete", loss="ce")
    gap = max(float((a - b).norm()) for a, b in zip(disc.outputs, tight.outputs, strict=True)) / move
    assert gap > ev.RK4_TOLERANCE


def test_ce_flow_splits_a_step_past_the_stability_limit_and_reports_it():
    """A ``ce_dt`` past h·η·ρ/(2N) ≤ RK4_STEP is cut into equal shorter steps (``Evolution.dt``,
    the round's ``evolve_dt``), and the result stays bounded and equals a run asked for that step."""
    from hpcfl.ntk.evolution import RK4_STEP, flow_step, lambda_bound

    H, f0, Y = _ce_problem(1.0)
    N = H.shape[0]
    assert lambda_bound(H) >= float(torch.linalg.eigvalsh(H)[-1])
    limit = RK4_STEP * 2 * N / (1.0 * lambda_bound(H))
    assert limit < 100
    big = evolve(H, f0, Y, lr=1.0, grid=[100, 200], mode="flow", loss="ce", dt=100.0)
    assert big.dt <= limit + 1e-12 and big.dt == pytest.approx(
        flow_step(H, N, 1.0, 100.0), rel=1e-3, abs=limit
    )
    assert torch.isfinite(big.outputs).all() and float(big.outputs.abs().max()) < 50
    same = evolve(H, f0, Y, lr=1.0, grid=[100, 200], mode="flow", loss="ce", dt=big.dt)
    assert torch.allclose(big.outputs, same.outputs, rtol=1e-12, atol=1e-12)
    flat = _mlp()
    _, metrics = _round(
        _algo(NTKFL, flat, grid=(100, 200), eta=1.0, evolution="flow", ce_dt=100.0), flat, _clients([7, 9])
    )
    assert 0 < metrics["evolve_dt"] < 100 and metrics["evolve_steps"] % 4 == 0


def test_ce_weight_update_of_one_step_is_a_cross_entropy_gradient_step():
    """With ``loss="ce"`` the first step moves the weights by −η·∇ mean_i CE(f(x_i), y_i), the
    reference code's update (no 1/C); the MSE update keeps the paper's 1/C."""
    flat = _mlp(d_in=5, classes=4)
    c = _clients([9], d_in=5, classes=4)[0]
    J = per_sample_jacobian(flat.model, c.x)
    f0 = flat.model(c.x).detach()
    Y = F.one_hot(c.y, 4).double()
    H = kernel([J], 0, 1, lambda t: t)
    evo = evolve(H, f0, Y, lr=0.3, grid=[0, 1], loss="ce", mode="discrete")
    dw = weight_updates([J], evo.sums[1:2], [0], lr=0.3, per_output=False)[0]
    grads = torch.autograd.grad(F.cross_entropy(flat.model(c.x), c.y), list(flat.model.parameters()))
    assert torch.allclose(dw, -0.3 * torch.cat([g.flatten() for g in grads]), rtol=1e-10, atol=1e-12)
    mse = weight_updates([J], evo.sums[1:2], [0], lr=0.3)[0]
    assert torch.allclose(mse * 4, dw)


@pytest.mark.parametrize("mode", ["flow", "discrete"])
def test_mse_ntkfl_on_a_linear_model_reaches_the_least_squares_solution(mode: str):
    """NTK-FL with MSE on a linear model: as t grows the new weights approach the least-squares
    fit of the round's data (one-hot targets), for each output; the error falls along the grid."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).double()
    flat = FlatModel(model)
    clients = _clients([8, 6, 10], d_in=4, seed=12)
    grid = (1, 5, 20, 3000)
    errors = []
    x = torch.cat([c.x for c in clients])
    A = torch.cat([x, torch.ones(x.shape[0], 1, dtype=torch.float64)], 1)  # [X, 1]
    Y = F.one_hot(torch.cat([c.y for c in clients]), 3).double()
    beta = torch.linalg.lstsq(A, Y).solution  # (5, 3)
    target = torch.cat([beta[:4].T.flatten(), beta[4]])  # Linear's (weight, bias) order
    x0 = flat.vector.clone()
    for t in grid:
        flat.load(x0)
        algo = _algo(
            NTKFL,
            flat,
            loss="mse",
            evolution=mode,
            eta=1.0,
            grid=(t,),
            select="kernel",
            upload="dense",
            jacobian="vmap",
        )
        new, _ = _round(algo, flat, clients)
        errors.append(float((new.x - target).norm()))
    assert errors[0] > errors[1] > errors[2] > 1e-6, errors
    assert errors[-1] < 1e-10 * float(target.norm()), errors


def test_default_run_is_cross_entropy_at_eta_001_with_no_eigendecomposition(monkeypatch):
    """Issue 25 item 5: the defaults are the reference code's (CE, η 0.01, its 12-point grid), and a
    round does no eigendecomposition unless ``kernel_cond`` asks (then it reports λ_max/λ_min)."""
    p = NTKFLParams()
    assert (p.loss, p.eta, p.evolution, p.kernel_cond) == ("ce", 0.01, "discrete", False)
    assert p.grid == (100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1500, 2000)
    flat = _mlp()
    clients = _clients([7, 4, 9])
    x0 = flat.vector.clone()

    def refuse(*args, **kwargs):
        raise AssertionError("an eigendecomposition ran")

    with monkeypatch.context() as m:
        for name in ("eigh", "eigvalsh", "eig", "eigvals"):
            m.setattr(torch.linalg, name, refuse)
        out, metrics = _round(_algo(NTKFL, flat), flat, clients)
    assert "kernel_cond" not in metrics and metrics["evolve_steps"] == 2000 and metrics["eigh_s"] == 0
    flat.load(x0)
    asked, m2 = _round(_algo(NTKFL, flat, kernel_cond=True), flat, clients)
    assert torch.equal(asked.x, out.x)
    flat.load(x0)
    J = per_sample_jacobian(flat.model, torch.cat([c.x for c in clients]))
    lam = torch.linalg.eigvalsh(kernel([J], 0, 1, lambda t: t))
    assert m2["kernel_lambda_max"] == pytest.approx(float(lam[-1]), rel=1e-9)
    assert m2["kernel_cond"] == pytest.approx(float(lam[-1] / lam[0]), rel=1e-6)


# -- across ranks --------------------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_kernel_and_shared_step_on_two_and_three_ranks_equal_the_single_process_ones(ranks: int):
    run_mpi_program("ntk_kernel.py", ranks=ranks)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("product", ["auto", "int8"])
def test_ntkfl_run_is_bit_identical_on_1_2_and_3_ranks(tmp_path: Path, product: str):
    """A 4-round NTK-FL run at the defaults (CE evolution on rank 0, shared) ends with the same
    parameters and the same t* on 1, 2 and 3 ranks, with the float32 product ``auto`` picks at this
    size and with the int8 product it picks at the paper's."""
    import json
    import subprocess

    from hpcfl.config import load_config
    from hpcfl.runner import run_experiment
    from tests.helpers import final_state, mpiexec_cmd

    cfg = _small_cfg(tmp_path, "ntkfl", params={"kernel_product": product})
    one = run_experiment(load_config(cfg), tmp_path / "r1")
    assert {r["evolve_product"] for r in one.metrics} == {"float32" if product == "auto" else "int8"}
    for n in (2, 3):
        proc = subprocess.run(
            mpiexec_cmd(n, "run", str(cfg), "--run-dir", str(tmp_path / f"r{n}")),
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        assert torch.equal(final_state(tmp_path / f"r{n}"), one.server.x), n
        rows = [json.loads(line) for line in (tmp_path / f"r{n}" / "metrics.jsonl").read_text().splitlines()]
        assert [r["t_star"] for r in rows] == [r["t_star"] for r in one.metrics], n


def test_kernel_blocks_shared_among_ranks_sum_to_the_kernel():
    """Three simulated ranks each fill their blocks; the sum is the one-process kernel exactly."""
    g = torch.Generator().manual_seed(2)
    jac = [torch.randn(n, 2, 15, generator=g, dtype=torch.float64) for n in (3, 5, 4, 6)]
    parts = [kernel(jac, r, 3, lambda t: t) for r in range(3)]
    assert all(p.count_nonzero() > 0 for p in parts)
    assert torch.equal(parts[0] + parts[1] + parts[2], kernel(jac, 0, 1, lambda t: t))
    J = torch.cat(jac).reshape(18, -1)
    assert torch.allclose(kernel(jac, 0, 1, lambda t: t), J @ J.T / 2)


# -- algorithm steps -----------------------------------------------------------------------------


def _round(algo, flat, clients, rnd=0):
    """One round by hand: every client's upload, gathered in participant order, then the server."""
    server = algo.init_server(flat.vector.clone())
    trainer = _trainer(flat)
    gathered: dict[str, list] = {}
    for c in clients:
        up, _ = algo.client_update(
            server, None, c, client_ctx(trainer, torch.Generator().manual_seed(c.k), rnd=rnd)
        )
        for key, value in up.gathered.items():
            gathered.setdefault(key, []).append(value)
    agg = Aggregate(sums={}, weight=float(sum(c.n for c in clients)), count=len(clients), gathered=gathered)
    ctx = ServerContext(
        rnd, tuple(c.k for c in clients), Population(tuple(c.n for c in clients)), lambda t: t
    )
    return algo.server_update(server, agg, ctx)


def test_weight_update_is_invariant_to_the_shuffling_permutation():
    flat = _mlp()
    x0 = flat.vector.clone()
    clients = _clients([7, 4, 9])
    common = dict(beta=1.0, projection_dim=0, keep=1.0, grid=(5, 50, 200), eta=0.5)
    plain, m0 = _round(_algo(CPNTKFL, flat, shuffle=False, **common), flat, clients)
    for seed in (0, 1, 2):
        flat.load(x0)
        shuffled, m1 = _round(_algo(CPNTKFL, flat, shuffle=True, shuffle_seed=seed, **common), flat, clients)
        assert torch.allclose(shuffled.x, plain.x, rtol=1e-9, atol=1e-12)
        assert m1["t_star"] == m0["t_star"]
    assert not torch.equal(plain.x, x0)


def test_validation_select_holds_clients_out_and_picks_t_by_their_loss():
    """select: validation: the held-out clients never train, and t* is the grid point whose
    candidate has the smallest real-network loss on their samples."""
    from hpcfl.algorithms.ntkfl import batched_losses
    from hpcfl.runner.rounds import round_generator

    flat = _mlp()
    algo = _algo(NTKFL, flat, select="validation", validation_clients=3, grid=(5, 50, 200, 800), eta=0.5)
    population = Population((10,) * 12)
    held = algo.held_out(population)
    assert len(held) == 3 and held == algo.held_out(population)  # a pure function of the seed
    algo.participation = type(algo.participation)(count=4)
    for rnd in range(50):
        who = algo.participants(rnd, population, round_generator(0, 0, rnd))
        assert len(who) == 4 and not set(who) & set(held)
    val = _clients([15], seed=9)[0]
    algo.attach(flat.model, (val.x, val.y))
    x0 = flat.vector.clone()
    clients = _clients([7, 4, 9])
    out, metrics = _round(algo, flat, clients)
    assert "input" not in algo.exchange().gathers  # nothing but J, f and Y leaves the clients
    flat.load(x0)
    plain, _ = _round(_algo(NTKFL, flat, grid=(5, 50, 200, 800), eta=0.5, select="kernel"), flat, clients)
    # the kernel selection picks the last grid point; rebuild every candidate from it to compare
    candidates = []
    for t in (5, 50, 200, 800):
        flat.load(x0)
        c, _ = _round(_algo(NTKFL, flat, grid=(t,), eta=0.5, select="kernel"), flat, clients)
        candidates.append(c.x)
    losses = batched_losses(flat.model, torch.stack(candidates), val.x, F.one_hot(val.y, 3).double(), "mse")
    best = int(torch.argmin(losses))
    assert metrics["t_star"] == (5, 50, 200, 800)[best]
    assert torch.allclose(out.x, candidates[best], rtol=1e-9, atol=1e-12)
    assert torch.allclose(plain.x, candidates[-1], rtol=1e-9, atol=1e-12)


def test_cp_ntkfl_without_its_tools_is_ntkfl_bit_for_bit():
    flat = _mlp(dtype=torch.float32)
    clients = _clients([6, 9, 5, 8], dtype=torch.float32)
    off = dict(beta=1.0, projection_dim=0, keep=1.0, shuffle=False)
    ntk = _algo(NTKFL, flat, grid=(10, 100, 300))
    cp = _algo(CPNTKFL, flat, grid=(10, 100, 300), **off)
    x0 = flat.vector.clone()  # the clients load each round's model into the shared one
    a, _ = simulate(ntk, clients, _trainer(flat), 2, server=ntk.init_server(x0), reduction="float64")
    b, _ = simulate(cp, clients, _trainer(flat), 2, server=cp.init_server(x0), reduction="float64")
    assert torch.equal(a.x, b.x)
    assert not torch.equal(a.x, x0)


def test_cp_ntkfl_subsamples_beta_of_each_client_and_sparsifies_with_counted_bytes():
    flat = _mlp(dtype=torch.float32)
    algo = _algo(CPNTKFL, flat, beta=0.4, projection_dim=0, keep=0.1)
    c = _clients([20], dtype=torch.float32)[0]
    server = algo.init_server(flat.vector)
    up, _ = algo.client_update(server, None, c, client_ctx(_trainer(flat), torch.Generator().manual_seed(0)))
    assert up.gathered["output"].shape[0] == 8 and up.weight == 8.0
    sparse = up.gathered["jacobian"]
    dense = densify(sparse)
    assert dense.shape == (8, 3, flat.num_params)
    kept = int(sparse["value"].numel())
    assert kept == -(-dense.numel() // 10) and sparse["index"].dtype == torch.int32
    assert _nbytes(sparse) < 0.25 * dense.nbytes  # 8 bytes per kept entry (+ the pickled shape)
    full = per_sample_jacobian(
        flat.model, c.x[torch.randperm(20, generator=torch.Generator().manual_seed(0))[:8].sort().values]
    )
    assert torch.equal(dense[dense != 0], full[dense != 0])
    assert dense.abs().count_nonzero() <= kept
    assert full.abs().flatten().kthvalue(full.numel() - kept + 1).values <= dense.abs().max()


def test_sparsify_roundtrip_keeps_the_largest_entries():
    J = torch.tensor([[0.1, -5.0, 0.2], [3.0, 0.0, -0.3]])
    s = sparsify(J, 0.5)
    assert torch.equal(densify(s), torch.tensor([[0.0, -5.0, 0.0], [3.0, 0.0, -0.3]]))
    # more entries kept than nonzeros: ties at |0| fill up to exactly k, every nonzero kept
    Z = torch.tensor([0.0, 2.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0])
    z = sparsify(Z, 0.5)
    assert z["value"].numel() == 4 and torch.equal(densify(z), Z)
    assert z["index"].tolist() == [0, 1, 2, 4]


def test_hyper_parameters_are_validated():
    with pytest.raises(ConfigError, match="params.grid"):
        NTKFLParams(grid=(10, 5))
    with pytest.raises(ConfigError, match="params.beta"):
        CPNTKFLParams(beta=0.0)
    with pytest.raises(ConfigError, match="params.select"):
        NTKFLParams(select="test")
    with pytest.raises(ConfigError, match="ce_dt"):
        NTKFLParams(ce_dt=0)
    with pytest.raises(ConfigError, match="kernel_cond"):
        NTKFLParams(kernel_cond="yes")
    with pytest.raises(ConfigError, match="params.validation_clients"):
        NTKFLParams(select="validation")
    with pytest.raises(ConfigError, match="params.validation_clients"):
        NTKFLParams(validation_clients=3)
    with pytest.raises(ConfigError, match="leaves no client"):
        _algo(NTKFL, _mlp(), select="validation", validation_clients=4).held_out(Population((5,) * 4))
    with pytest.raises(ConfigError, match="params.upload"):
        NTKFLParams(upload="zip")
    with pytest.raises(ConfigError, match="params.upload"):
        CPNTKFLParams(upload="factored", keep=0.5)
    assert NTKFLParams(grid=[1, 2]).grid == (1, 2)


# -- the memory guard ----------------------------------------------------------------------------


def test_memory_guard_refuses_an_oversized_round_naming_what_fits():
    shape = RoundShape(samples=4000, outputs=10, params=79510, grid=20)
    assert round_memory_bytes(shape) > 24e9  # 2·N·C·P·4 bytes of Jacobians dominate
    with pytest.raises(ConfigError) as err:
        check_round_memory(
            "cp-ntkfl",
            shape,
            4 * 2**30,
            sizes=[200] * 300,
            per_round=20,
            beta=1.0,
            input_dim=784,
            first_layer=(100, 1110),
        )
    msg = str(err.value)
    assert (
        "\n" not in msg
        and "params.beta: " in msg
        and "params.projection_dim: " in msg
        and "clients_per_round: " in msg
    )
    beta = float(msg.split("params.beta: ")[1].split()[0])
    fits = RoundShape(samples=20 * round(200 * beta + 0.5), outputs=10, params=79510, grid=20)
    assert round_memory_bytes(fits) <= 4 * 2**30
    check_round_memory(
        "ntkfl",
        RoundShape(100, 10, 1000, 20),
        2**30,
        sizes=[5] * 20,
        per_round=20,
        beta=1.0,
        input_dim=8,
        first_layer=None,
    )


def test_memory_guard_counts_factored_uploads_by_their_factors():
    """The paper's round (20 × 200 samples, MLP-100 on 784 inputs) needs ~25 GB dense but fits
    a laptop when the Jacobians travel as layer factors."""
    dense = RoundShape(samples=4000, outputs=10, params=79510, grid=20)
    factored = RoundShape(samples=4000, outputs=10, params=79510, grid=20, per_sample=784 + 100 + 10 * 110)
    assert round_memory_bytes(dense) > 24e9
    assert round_memory_bytes(factored) < 2**30
    common = dict(sizes=[200] * 300, per_round=20, beta=1.0, input_dim=784, first_layer=None)
    check_round_memory("ntkfl", factored, 2**30, **common)
    with pytest.raises(ConfigError):
        check_round_memory("ntkfl", dense, 2**30, **common)


def test_memory_guard_fires_before_the_first_round(tmp_path: Path):
    from hpcfl.config import load_config
    from hpcfl.runner import run_experiment

    cfg = synthetic_config(tmp_path, algorithm="ntkfl", params={"memory_budget": "2GB", "upload": "dense"})
    with pytest.raises(ConfigError, match="params.beta|clients_per_round"):
        run_experiment(load_config(cfg), tmp_path / "run")
    assert (
        not (tmp_path / "run" / "metrics.jsonl").exists()
        or not (tmp_path / "run" / "metrics.jsonl").read_text()
    )


# -- runs ----------------------------------------------------------------------------------------


def _small_cfg(tmp_path: Path, algorithm: str, **extra) -> Path:
    params = {"grid": [20, 100, 400], "eta": 0.1}
    params.update(extra.pop("params", {}))
    return synthetic_config(
        tmp_path,
        algorithm=algorithm,
        dataset_options={"n_train": 300, "n_test": 100, "seed": 3},
        num_clients=6,
        clients_per_round=3,
        rounds=4,
        checkpoint_every=1,
        params=params,
        **extra,
    )


@pytest.mark.parametrize(
    ("algorithm", "params"),
    [
        ("ntkfl", {}),
        ("ntkfl", {"select": "validation", "validation_clients": 2}),
        ("cp-ntkfl", {"beta": 0.5, "projection_dim": 30, "keep": 0.2}),
    ],
)
def test_stopped_and_resumed_run_equals_an_uninterrupted_one(tmp_path: Path, algorithm: str, params: dict):
    from hpcfl.config import load_config
    from hpcfl.runner import run_experiment

    cfg_path = _small_cfg(tmp_path, algorithm, params=params)
    reference = run_experiment(load_config(cfg_path), tmp_path / "ref")
    run = tmp_path / "stopped"
    run_experiment(load_config(cfg_path, ["rounds=2"]), run)
    resumed = run_experiment(load_config(cfg_path), run, resume=True)
    assert torch.equal(resumed.server.x, reference.server.x)
    rows = reference.metrics
    assert [r["t_star"] for r in resumed.metrics] == [r["t_star"] for r in rows]
    assert all(r["bytes_up"] > 0 and r["evolve_steps"] == 400 and "kernel_cond" not in r for r in rows)
    if algorithm == "cp-ntkfl":  # the model takes d₁′ = 30 projected inputs
        assert reference.server.x.numel() == 30 * 100 + 100 + 100 * 10 + 10


def test_projection_needs_a_flat_input_model(tmp_path: Path):
    from hpcfl.config import load_config
    from hpcfl.runner import run_experiment

    cfg = _small_cfg(tmp_path, "cp-ntkfl", model="simplecnn", params={"projection_dim": 20})
    with pytest.raises(ConfigError, match="projection_dim"):
        run_experiment(load_config(cfg), tmp_path / "run")


@pytest.mark.slow
def test_ntkfl_beats_fedavg_after_a_few_rounds_on_fashion_mnist(tmp_path: Path):
    """Fashion-MNIST, Dirichlet 0.3 over 300 clients, 3 per round, MLP-100, 3 rounds: NTK-FL's test
    accuracy (cross-entropy evolution) is above FedAvg's (the best of 1 and 10 local steps)."""
    from hpcfl.config import config_from_dict
    from hpcfl.runner import run_experiment

    data_root = os.environ.get("HPCFL_DATA", str(REPO.parent / "shared" / "datasets"))
    if not Path(data_root, "fashion-mnist").exists():
        pytest.skip("Fashion-MNIST not available (set HPCFL_DATA)")
    base = dict(
        dataset="fashion-mnist",
        data_root=data_root,
        partition="dir:0.3",
        min_client_size=1,
        num_clients=300,
        clients_per_round=3,
        model="mlp",
        rounds=3,
        lr=0.05,
        batch_size=50,
        seed=0,
        threads=1,
        progress=False,
    )

    def final(name: str, **keys) -> float:
        cfg = config_from_dict({**base, "name": name, **keys})
        return run_experiment(cfg, tmp_path / name).metrics[-1]["test_accuracy"]

    # the reference code's cross-entropy evolution: with the MSE flow NTK-FL was at 0.393 here
    ntk = final("ntk", algorithm="ntkfl", params={"memory_budget": str(12 * 2**30), "loss": "ce"})
    fedavg = max(final(f"avg{s}", algorithm="fedavg", local_steps=s) for s in (1, 10))
    assert ntk > fedavg, (ntk, fedavg)


@pytest.mark.parametrize(
    ("name", "cls"), [("fmnist_ntkfl_paper.yaml", NTKFLParams), ("fmnist_cp_ntkfl_paper.yaml", CPNTKFLParams)]
)
def test_paper_configs_are_the_authors_run(name: str, cls):
    """The authors' Fashion-MNIST run (reference code's config_fmnist.yaml): 300 clients on
    client-dir 0.1, 21 per round (part_rate 0.07), Kaiming init, CE at lr 0.01, the 12-point grid."""
    from hpcfl.config import load_config

    cfg = load_config(REPO / "configs" / name)
    assert (cfg.dataset, cfg.partition, cfg.num_clients, cfg.clients_per_round) == (
        "fashion-mnist",
        "client-dir:0.1",
        300,
        21,
    )
    assert cfg.model == "mlp" and cfg.model_options == {"init": "kaiming"}
    params = cfg.params
    assert type(params) is cls
    assert (params.loss, params.eta, params.select) == ("ce", 0.01, "train")
    assert params.grid == (100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1500, 2000)
    if cls is CPNTKFLParams:
        assert (params.beta, params.projection_dim, params.keep) == (0.3, 200, 0.1)


@pytest.mark.parametrize(("step", "message"), [("3", "must divide every grid point"), ("0", "must be >= 1")])
def test_reproduction_refuses_an_euler_step_it_cannot_run_exactly(tmp_path: Path, step: str, message: str):
    """``--euler-step K`` runs the old Euler evolution exactly only where K divides the grid: any
    other K is refused in one line, before a run starts."""
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "ntkfl_reproduction.py"),
            "--euler-step",
            step,
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({}, "NTK-FL: the weight update of round 1 made the model or its loss NaN/inf; lower params.eta"),
        ({"kernel_product": "int8", "select": "kernel"}, "NTK-FL: the kernel H of round 2 holds NaN/inf"),
    ],
)
def test_a_diverging_evolution_stops_the_run_with_one_line(tmp_path: Path, capsys, extra: dict, words: str):
    """Issue 44: with η = 1e30 every parameter ended NaN and the run exited 0 as if finished; with
    kernel_product: int8 it died in eigh. Now one line naming params.eta, and the run is not done."""
    from hpcfl.cli.main import main

    cfg = _small_cfg(tmp_path, "ntkfl", params={"eta": 1e30, "grid": [1, 2, 5], **extra})
    code = main(["run", str(cfg), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code not in (0, 75) and "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith(f"hpcfl: error: {words}"), err
    assert not (tmp_path / "run" / "DONE").exists()


def test_a_grid_of_a_million_steps_is_announced_not_run_silently():
    """Issue 44: a 10⁶-step grid ran silently for minutes a round; the cross-entropy evolution's
    product count is named up front (the closed-form MSE evolution costs the same for any t)."""
    from hpcfl.ntk.stage import long_evolution_note

    assert long_evolution_note(NTKFLParams()) is None  # the reference grid, up to t = 2000
    note = long_evolution_note(NTKFLParams(grid=(10, 10**6)))
    assert note is not None and note.startswith("hpcfl: note: params.grid reaches t=1000000: ")
    assert "1,000,000 products" in note
    flow = long_evolution_note(NTKFLParams(grid=(10**6,), evolution="flow", ce_dt=10.0))
    assert flow is not None and "400,000 products" in flow
    assert long_evolution_note(NTKFLParams(grid=(10**6,), loss="mse")) is None
