"""The cross-entropy evolution's products of the kernel (hpcfl/ntk/product.py, issue 32): the int8
and float32 products against the float64 iteration on a real Fashion-MNIST MLP kernel, at the
paper's η and grid, and what ``auto`` resolves to."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hpcfl.algorithms.ntkfl import NTKFLParams
from hpcfl.entk.jacobian import factored_jacobian
from hpcfl.errors import ConfigError
from hpcfl.models import build_model
from hpcfl.ntk import product as kp
from hpcfl.ntk.evolution import evolve, kernel


@pytest.fixture(scope="module", params=["images", "gaussian"])
def fmnist_kernel(request, data_root: Path):
    """H (1,200 × 1,200) of the paper's MLP-100 at Kaiming init on 1,200 Fashion-MNIST training
    images (6 blocks of 200, as 6 clients), or on Gaussian inputs (a kernel whose diagonal dominates
    its rows), its outputs and one-hot labels."""
    from hpcfl.data.idx import load_idx_arrays

    x, y, _, _ = load_idx_arrays("fashion-mnist", data_root, download=False)
    idx = np.random.default_rng(0).choice(len(x), 1200, replace=False)
    xs = (torch.tensor(x[idx], dtype=torch.float32).view(-1, 1, 28, 28) / 255 - 0.2860) / 0.3530
    if request.param == "gaussian":
        xs = torch.randn(xs.shape, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = build_model("mlp", (1, 28, 28), 10, init="kaiming")
    H = kernel([factored_jacobian(model, xs[i : i + 200]) for i in range(0, 1200, 200)], 0, 1, lambda t: t)
    with torch.no_grad():
        f0 = model(xs).double()
    return H, f0, F.one_hot(torch.tensor(y[idx]).long(), 10).double()


@pytest.mark.parametrize(("precision", "tolerance"), [("int8", kp.INT8_TOLERANCE), ("float32", 1e-6)])
def test_products_in_the_evolution_are_within_their_stated_tolerance(fmnist_kernel, precision, tolerance):
    """At every grid point of the paper's 12 (η = 0.01, to 2,000 steps), f and S of the discrete
    cross-entropy evolution with the int8 (float32) product are within INT8_TOLERANCE (1e-6) of
    their largest movement from the float64 iteration's."""
    H, f0, Y = fmnist_kernel
    grid = NTKFLParams().grid
    ref = evolve(H, f0, Y, lr=0.01, grid=grid, loss="ce", mode="discrete", precision="float64")
    got = evolve(H, f0, Y, lr=0.01, grid=grid, loss="ce", mode="discrete", precision=precision)
    move = max(float((o - f0).norm()) for o in ref.outputs)
    total = max(float(s.norm()) for s in ref.sums)
    assert move > 1.0  # f really moves
    for i in range(len(grid)):
        assert float((got.outputs[i] - ref.outputs[i]).norm()) <= tolerance * move, (precision, i)
        assert float((got.sums[i] - ref.sums[i]).norm()) <= tolerance * total, (precision, i)


def test_int8_product_is_exact_integer_arithmetic_on_its_limbs(fmnist_kernel):
    """One int8 product equals the float64 product of the matrices its limbs stand for (the integer
    sums are exact), and is within 1e-4 of H v for a softmax residual."""
    H, f0, Y = fmnist_kernel
    prod = kp._Int8Product(H)
    v = torch.softmax(f0, 1) - Y
    p1, p2, t = kp._limbs(v, dim=0)
    R = (prod.q1.double() + prod.q2.double() / kp.LIMB) * prod.s
    dropped = prod.q2.double() * prod.s @ (p2 / kp.LIMB**2 * t)  # the limbs' product left out
    implied = prod.B @ (prod.U.T @ v) + prod.d[:, None] * v + R @ ((p1 + p2 / kp.LIMB) * t) - dropped
    assert torch.allclose(prod(v), implied, rtol=1e-12, atol=1e-9 * float(implied.abs().max()))
    exact = H @ v
    assert float((prod(v) - exact).norm()) <= 1e-4 * float(exact.norm())


def test_dominant_subspace_spans_the_top_eigenvectors(fmnist_kernel):
    """The deflated directions are orthonormal Ritz pairs, the dominant one H's top eigenpair (the
    others converge as fast as the spectrum's gaps allow; any U keeps the product exact)."""
    H = fmnist_kernel[0]
    U, lam = kp.dominant_subspace(H, 4)
    top = torch.linalg.eigvalsh(H)
    assert float(lam[-1]) == pytest.approx(float(top[-1]), rel=1e-8)
    assert bool((lam <= top[-1] * (1 + 1e-12)).all())
    assert torch.allclose(U.T @ U, torch.eye(4, dtype=H.dtype), atol=1e-10)
    U2, _ = kp.dominant_subspace(H, 4)
    assert torch.equal(U, U2)  # seeded: the same H gives the same bits


def test_auto_resolves_by_dtype_device_and_size():
    small, big = torch.eye(10, dtype=torch.float64), torch.eye(kp.INT8_FROM, dtype=torch.float64)
    assert kp.resolve_precision("auto", big, torch.float64) == "float64"
    assert kp.resolve_precision("auto", big, torch.float32) == "int8"
    assert kp.resolve_precision("auto", small, torch.float32) == "float32"
    assert kp.resolve_precision("float32", big, torch.float64) == "float32"


def test_an_unknown_kernel_product_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="kernel_product"):
        NTKFLParams(kernel_product="int4")
