"""TCT stage 2: closed form = primal, federated = centralised standardisation, SCAFFOLD's optimum,
and the divergence check."""

from __future__ import annotations

import pytest
import torch

from hpcfl.algorithms import ClientData
from hpcfl.comm import LocalComm
from hpcfl.errors import DivergenceError
from hpcfl.tct.problem import LinearProblem, centred_one_hot, design_matrix, federated_moments
from hpcfl.tct.solvers import ClosedFormSolver, PrimalSolver
from hpcfl.tct.stage2 import Stage2, Stage2Params, check_stability, spectrum
from tests.helpers import client_ctx, server_step


def _heterogeneous_features(K=4, p=30, C=3, seed=0, dtype=torch.float64):
    """Clients whose features come from shifted distributions and whose labels are skewed."""
    g = torch.Generator().manual_seed(seed)
    raw, labels = [], []
    proj = torch.randn(p, C, generator=g, dtype=dtype)
    for k in range(K):
        n = 25 + 9 * k
        z = torch.randn(n, p, generator=g, dtype=dtype) * (1 + k) + 3 * torch.randn(
            p, generator=g, dtype=dtype
        )
        y = torch.argmax(z @ proj + torch.randn(n, C, generator=g, dtype=dtype), dim=1)
        raw.append(z)
        labels.append(y)
    return raw, labels


def _problems(raw, labels, C=3):
    moments = federated_moments(dict(enumerate(raw)), LocalComm(), p=raw[0].shape[1], clients=len(raw))
    return [
        LinearProblem(design_matrix(z, moments), centred_one_hot(y, C), y)
        for z, y in zip(raw, labels, strict=True)
    ]


@pytest.mark.parametrize(
    ("p", "form"), [(30, "kernel"), (8, "covariance"), (30, "covariance"), (8, "kernel")]
)
def test_closed_form_equals_primal_over_rounds(p, form):
    raw, labels = _heterogeneous_features(p=p)
    problems = _problems(raw, labels)
    lr = 0.5 * min(2 * pr.n / ClosedFormSolver(pr).lambda_max() for pr in problems)
    results = {}
    for kind in ("primal", "closed"):
        solvers = {
            k: (PrimalSolver(pr) if kind == "primal" else ClosedFormSolver(pr, form=form))
            for k, pr in enumerate(problems)
        }
        algo = Stage2(Stage2Params(lr=lr, local_steps=50), solvers, (p + 1, 3))
        server = algo.init_server(torch.zeros((p + 1) * 3, dtype=torch.float64))
        states = {k: algo.init_client(k, server) for k in solvers}
        for _ in range(5):
            total, weight = torch.zeros_like(server.x), 0.0
            for k, pr in enumerate(problems):
                up, states[k] = algo.client_update(
                    server, states[k], ClientData(k, pr.z, pr.y), client_ctx(None)
                )
                total += up.weight * up.sums["x"]
                weight += up.weight
            server = server_step(algo, server, total, weight)
        results[kind] = server.x
    rel = (results["closed"] - results["primal"]).abs().max() / results["primal"].abs().max()
    assert rel <= 1e-8, rel


def test_federated_moments_are_one_running_sum_in_client_order_whatever_the_chunks():
    """The moments equal, bit for bit, the one-rank running sum of the clients' float64 sums in
    client order (what stage 2 computed before the sums got per-client rows, so TCT's one-rank
    results did not move), and the column chunking of the allreduce changes no bit."""
    raw, _ = _heterogeneous_features()
    p = raw[0].shape[1]
    buf = torch.zeros(2 * p + 1, dtype=torch.float64)
    for z in raw:
        z64 = z.to(torch.float64)
        buf[:p] += z64.sum(0)
        buf[p : 2 * p] += (z64 * z64).sum(0)
        buf[-1] += z.shape[0]
    mean = buf[:p] / float(buf[-1])
    blocks = dict(enumerate(raw))
    for chunk_bytes in (8 * len(raw), 8 * len(raw) * 3, 2**26):
        m = federated_moments(blocks, LocalComm(), p=p, clients=len(raw), chunk_bytes=chunk_bytes)
        assert torch.equal(m.mean, mean)
        assert m.count == int(buf[-1])
    m_small = federated_moments(blocks, LocalComm(), p=p, clients=len(raw), chunk_bytes=8 * len(raw))
    assert torch.equal(m_small.std, m.std)


def test_federated_standardisation_equals_centralised():
    raw, _ = _heterogeneous_features()
    m = federated_moments(dict(enumerate(raw)), LocalComm(), p=raw[0].shape[1], clients=len(raw))
    allz = torch.cat(raw)
    torch.testing.assert_close(m.mean, allz.mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.std, allz.std(0, unbiased=False), rtol=1e-10, atol=1e-12)
    z = design_matrix(torch.cat(raw), m)[:, :-1]
    torch.testing.assert_close(z.mean(0), torch.zeros(z.shape[1], dtype=z.dtype), rtol=0, atol=1e-10)
    torch.testing.assert_close(
        z.std(0, unbiased=False), torch.ones(z.shape[1], dtype=z.dtype), rtol=1e-10, atol=1e-10
    )


def _solve(problems, variant, steps, rounds, lr):
    solvers = {k: ClosedFormSolver(pr) for k, pr in enumerate(problems)}
    shape = (problems[0].z.shape[1], problems[0].y.shape[1])
    algo = Stage2(Stage2Params(lr=lr, local_steps=steps, variant=variant), solvers, shape)
    server = algo.init_server(torch.zeros(shape[0] * shape[1], dtype=torch.float64))
    states = {k: algo.init_client(k, server) for k in solvers}
    for _ in range(rounds):
        total, weight = torch.zeros_like(server.x), 0.0
        for k, pr in enumerate(problems):
            up, states[k] = algo.client_update(server, states[k], ClientData(k, pr.z, pr.y), client_ctx(None))
            total += up.weight * up.sums["x"]
            weight += up.weight
        server = server_step(algo, server, total, weight)
    return server.x.view(shape)


def test_scaffold_reaches_least_squares_solution_fedavg_does_not():
    raw, labels = _heterogeneous_features(p=8)
    problems = _problems(raw, labels)
    z = torch.cat([pr.z for pr in problems])
    y = torch.cat([pr.y for pr in problems])
    w_star = torch.linalg.lstsq(z, y).solution
    lr = 0.5 * min(2 * pr.n / ClosedFormSolver(pr).lambda_max() for pr in problems)
    w_scaffold = _solve(problems, "scaffold", steps=100, rounds=2000, lr=lr)
    w_fedavg = _solve(problems, "fedavg", steps=100, rounds=2000, lr=lr)
    assert torch.linalg.norm(w_scaffold - w_star) / torch.linalg.norm(w_star) < 1e-8
    assert torch.linalg.norm(w_fedavg - w_star) / torch.linalg.norm(w_star) > 1e-2


@pytest.mark.parametrize("factor", [0.98, 1.02])
def test_divergence_check_fires_exactly_when_primal_diverges(factor):
    raw, labels = _heterogeneous_features(K=2)
    problems = _problems(raw, labels)
    primal = {k: PrimalSolver(pr) for k, pr in enumerate(problems)}
    critical = min(2 * pr.n / ClosedFormSolver(pr).lambda_max() for pr in problems)
    lr = factor * critical
    diverges = False
    for k in range(len(problems)):
        w = primal[k].local_steps(
            torch.zeros(31, 3, dtype=torch.float64), torch.zeros(31, 3, dtype=torch.float64), lr, 3000
        )
        diverges |= bool(w.norm() > 1e6 or not torch.isfinite(w).all())
    if factor > 1:
        assert diverges
        with pytest.raises(DivergenceError, match="use stage2.lr <"):
            check_stability(spectrum(primal, LocalComm()), lr)
    else:
        assert not diverges
        check_stability(spectrum(primal, LocalComm()), lr)
