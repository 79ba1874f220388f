"""Linear CKA (Kornblith et al. 2019), its debiased estimator, the Triton kernel, and FedCKA's loss.

The torch reference is checked against independent formulas (the feature form of Kornblith et al.,
a brute-force U-statistic for the debiased HSIC) and finite differences; the Triton kernel (under
the interpreter on CPU) is checked against the reference, forward and every gradient, on odd
shapes with per-dtype tolerances.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
from torch import Tensor

import triton_kernels.cka as tk
from hpcfl.metrics import cka_per_layer, fedcka_loss, linear_cka
from triton_kernels.cka import LinearCKATriton, linear_cka_reference, linear_cka_triton

F64 = torch.float64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(
    not tk.HAS_TRITON or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs triton and a GPU or TRITON_INTERPRET=1",
)
# kernel vs reference, per dtype (inputs are identical, so these bound the kernel's own rounding)
TOL: dict[torch.dtype, dict[str, float]] = {
    torch.float64: {"atol": 1e-12, "rtol": 1e-10},
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _cka_feature_form(x: Tensor, y: Tensor) -> Tensor:
    """Kornblith et al. 2019, Eq. (3): ‖YᵀX‖²_F / (‖XᵀX‖_F ‖YᵀY‖_F) on column-centred data."""
    x = x.reshape(x.shape[0], -1)
    y = y.reshape(y.shape[0], -1)
    x = x - x.mean(dim=0)  # (n, d1)
    y = y - y.mean(dim=0)  # (n, d2)
    return (y.T @ x).pow(2).sum() / (torch.linalg.norm(x.T @ x) * torch.linalg.norm(y.T @ y))


def _hsic_u_statistic(k: Tensor, l: Tensor) -> Tensor:
    """HSIC as the plain U-statistic over ordered distinct quadruples (Song et al. 2012, Thm 2)."""
    n = k.shape[0]
    i, j, q, r = torch.tensor(list(itertools.permutations(range(n), 4))).unbind(1)  # (P,) each
    h = k[i, j] * l[i, j] + k[i, j] * l[q, r] - 2.0 * k[i, j] * l[i, q]
    return h.mean()


def _cka_u_statistic(x: Tensor, y: Tensor) -> Tensor:
    k, l = x @ x.T, y @ y.T
    return _hsic_u_statistic(k, l) / torch.sqrt(_hsic_u_statistic(k, k) * _hsic_u_statistic(l, l))


# ------------------------------------------------------------------------------------------------
# reference: value, invariances, gradients
# ------------------------------------------------------------------------------------------------


def test_reference_equals_feature_form() -> None:
    g = _gen(0)
    x = torch.randn(17, 6, 5, generator=g, dtype=F64) + 2.0  # (n, ...) with a mean offset
    y = torch.randn(17, 9, generator=g, dtype=F64) - 1.0
    expected = _cka_feature_form(x, y)
    torch.testing.assert_close(linear_cka_reference(x, y), expected, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(linear_cka(x, y), expected, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("debiased", [False, True], ids=["biased", "debiased"])
def test_invariant_to_orthogonal_scaling_and_translation(debiased: bool) -> None:
    g = _gen(1)
    x = torch.randn(12, 7, generator=g, dtype=F64)
    y = torch.randn(12, 4, generator=g, dtype=F64) + x[:, :4]
    q, _ = torch.linalg.qr(torch.randn(7, 7, generator=g, dtype=F64))  # random orthogonal (7, 7)
    base = linear_cka_reference(x, y, debiased=debiased)
    for name, x2, y2 in [
        ("orthogonal", x @ q, y),
        ("scaling", 3.7 * x, 0.01 * y),
        ("translation", x + 5.0, y - torch.randn(4, generator=g, dtype=F64)),
    ]:
        torch.testing.assert_close(
            linear_cka_reference(x2, y2, debiased=debiased),
            base,
            atol=1e-10,
            rtol=1e-10,
            msg=lambda m, name=name: f"CKA not invariant to {name}: {m}",
        )


@pytest.mark.parametrize("debiased", [False, True], ids=["biased", "debiased"])
def test_self_similarity_is_one(debiased: bool) -> None:
    x = torch.randn(9, 3, 4, generator=_gen(2), dtype=F64)
    torch.testing.assert_close(linear_cka_reference(x, x, debiased=debiased), torch.tensor(1.0, dtype=F64))


def test_constant_representation_gives_zero_and_finite_gradient() -> None:
    x = torch.ones(6, 4, dtype=F64, requires_grad=True)
    y = torch.randn(6, 3, generator=_gen(3), dtype=F64, requires_grad=True)
    c = linear_cka_reference(x, y)
    c.backward()
    assert c.item() == 0.0
    assert torch.isfinite(x.grad).all() and torch.isfinite(y.grad).all()


def test_reference_gradient_matches_feature_form() -> None:
    g = _gen(4)
    x = torch.randn(10, 6, generator=g, dtype=F64, requires_grad=True)
    y = torch.randn(10, 3, generator=g, dtype=F64, requires_grad=True)
    gx, gy = torch.autograd.grad(linear_cka_reference(x, y), (x, y))
    ex, ey = torch.autograd.grad(_cka_feature_form(x, y), (x, y))
    torch.testing.assert_close(gx, ex, atol=1e-12, rtol=1e-10, msg=lambda m: f"dCKA/dx: {m}")
    torch.testing.assert_close(gy, ey, atol=1e-12, rtol=1e-10, msg=lambda m: f"dCKA/dy: {m}")


@pytest.mark.parametrize("debiased", [False, True], ids=["biased", "debiased"])
def test_reference_gradcheck(debiased: bool) -> None:
    g = _gen(5)
    x = torch.randn(6, 2, 2, generator=g, dtype=F64, requires_grad=True)
    y = torch.randn(6, 3, generator=g, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: linear_cka_reference(a, b, debiased=debiased), (x, y))


def test_debiased_equals_u_statistic() -> None:
    g = _gen(6)
    x = torch.randn(7, 4, generator=g, dtype=F64) + 1.5  # uncentred on purpose
    y = torch.randn(7, 3, generator=g, dtype=F64)
    torch.testing.assert_close(
        linear_cka_reference(x, y, debiased=True), _cka_u_statistic(x, y), atol=1e-12, rtol=1e-10
    )


def test_input_errors() -> None:
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="at least 4 samples"):
        linear_cka(x, x, debiased=True)
    with pytest.raises(ValueError, match="same samples"):
        linear_cka(x, torch.randn(4, 4))
    with pytest.raises(ValueError, match="at least one layer"):
        fedcka_loss([], [], [])
    with pytest.raises(ValueError, match="one activation per regularised layer"):
        fedcka_loss([x], [x, x], [x])


def test_linear_cka_uses_reference_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import hpcfl.metrics.cka as mc

    def boom(*args: object, **kwargs: object) -> Tensor:
        raise AssertionError("the Triton path must not run on CPU tensors")

    monkeypatch.setattr(mc, "linear_cka_triton", boom)
    x = torch.randn(8, 5, generator=_gen(7))
    torch.testing.assert_close(linear_cka(x, 2 * x), torch.tensor(1.0))


def test_triton_wrapper_falls_back_without_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tk, "_triton_usable", lambda t: False)
    g = _gen(8)
    x, y = torch.randn(9, 4, generator=g), torch.randn(9, 6, generator=g)
    torch.testing.assert_close(linear_cka_triton(x, y), linear_cka_reference(x, y), atol=0.0, rtol=0.0)


# ------------------------------------------------------------------------------------------------
# Triton kernel vs reference (interpreter on CPU: keep shapes tiny)
# ------------------------------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(7, 5, 5), (13, 33, 9)], ids=lambda s: "n{}-d{}-d{}".format(*s))
@pytest.mark.parametrize("debiased", [False, True], ids=["biased", "debiased"])
def test_triton_matches_reference(dtype: torch.dtype, shape: tuple[int, int, int], debiased: bool) -> None:
    n, d1, d2 = shape
    g = _gen(10 + n)
    x = (torch.randn(n, d1, generator=g) + 0.5).to(DEVICE, dtype).requires_grad_()  # (n, d1)
    y = (torch.randn(n, d2, generator=g) - x[:, :1].detach().cpu()).to(DEVICE, dtype).requires_grad_()
    assert tk._triton_usable(x), "the kernel would silently fall back to the reference"
    ref = linear_cka_reference(x, y, debiased=debiased)
    out = linear_cka_triton(x, y, debiased=debiased)
    tol = TOL[dtype]
    torch.testing.assert_close(out, ref, **tol, msg=lambda m: f"forward CKA: {m}")
    rgx, rgy = torch.autograd.grad(ref, (x, y))
    ogx, ogy = torch.autograd.grad(out, (x, y))
    torch.testing.assert_close(ogx, rgx, **tol, msg=lambda m: f"dCKA/dx: {m}")
    torch.testing.assert_close(ogy, rgy, **tol, msg=lambda m: f"dCKA/dy: {m}")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_triton_statistics_multi_tile(dtype: torch.dtype) -> None:
    """Forced 16-row tiles on n = 37: 3×3 tiles (6 visited, mirrored), several feature steps."""
    g = _gen(20)
    x = torch.randn(37, 33, generator=g).to(DEVICE, dtype).requires_grad_()  # (n, d1)
    y = torch.randn(37, 5, generator=g).to(DEVICE, dtype).requires_grad_()  # (n, d2)
    upstream = torch.tensor([0.7, -1.3, 0.4], dtype=dtype, device=DEVICE)  # (3,)
    stats = LinearCKATriton.apply(x, y, 16, 16)  # (3,)
    k, l = x @ x.T, y @ y.T
    expected = torch.stack([(k * l).sum(), (k * k).sum(), (l * l).sum()])
    scale = expected.detach().abs()  # statistics are large sums: compare relatively
    torch.testing.assert_close(
        stats / scale, expected.detach() / scale, **TOL[dtype], msg=lambda m: f"Gram statistics: {m}"
    )
    gx, gy = torch.autograd.grad(stats, (x, y), upstream)
    ex, ey = torch.autograd.grad(expected, (x, y), upstream)
    for name, got, want in [("d/dx", gx, ex), ("d/dy", gy, ey)]:
        s = want.abs().max()
        torch.testing.assert_close(
            got / s, want / s, **TOL[dtype], msg=lambda m, name=name: f"statistics {name}: {m}"
        )


@needs_kernel
@pytest.mark.parametrize("debiased", [False, True], ids=["biased", "debiased"])
def test_triton_gradcheck(debiased: bool) -> None:
    g = _gen(30)
    x = torch.randn(5, 3, generator=g, dtype=F64).to(DEVICE).requires_grad_()
    y = torch.randn(5, 4, generator=g, dtype=F64).to(DEVICE).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: linear_cka_triton(a, b, debiased=debiased), (x, y))


# ------------------------------------------------------------------------------------------------
# FedCKA loss (Son et al., Eq. 2)
# ------------------------------------------------------------------------------------------------


def _layers(seed: int, n: int = 6) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    g = _gen(seed)
    shapes = [(n, 2, 3), (n, 4)]  # a conv-like and a dense layer
    local = [torch.randn(*s, generator=g, dtype=F64, requires_grad=True) for s in shapes]
    glob = [torch.randn(*s, generator=g, dtype=F64, requires_grad=True) for s in shapes]
    prev = [torch.randn(*s, generator=g, dtype=F64, requires_grad=True) for s in shapes]
    return local, glob, prev


def test_fedcka_loss_equals_formula() -> None:
    local, glob, prev = _layers(40)
    loss = fedcka_loss(local, glob, prev)
    terms = []
    for a, b, c in zip(local, glob, prev, strict=True):
        cg, cp = linear_cka(a, b).item(), linear_cka(a, c).item()
        terms.append(-math.log(math.exp(cg) / (math.exp(cg) + math.exp(cp))))
    assert loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-12)


def test_fedcka_loss_gradient_reaches_local_activations() -> None:
    local, glob, prev = _layers(41)
    loss = fedcka_loss(local, glob, prev)
    assert loss.requires_grad, "ℓ_cka fell off the autograd graph"
    loss.backward()
    for i, a in enumerate(local):
        assert a.grad is not None and a.grad.abs().max() > 0, f"no gradient on local layer {i}"
    assert all(t.grad is None for t in glob + prev), "global / previous activations must be detached"


@pytest.mark.parametrize("debiased", [False, True], ids=["biased", "debiased"])
def test_fedcka_loss_gradcheck(debiased: bool) -> None:
    local, glob, prev = _layers(42)
    assert torch.autograd.gradcheck(lambda *a: fedcka_loss(a, glob, prev, debiased=debiased), tuple(local))


def test_cka_per_layer() -> None:
    local, glob, _ = _layers(43)
    values = cka_per_layer(local, glob)
    assert all(isinstance(v, float) for v in values)
    expected = [linear_cka(a, b).item() for a, b in zip(local, glob, strict=True)]
    assert values == pytest.approx(expected, rel=1e-12)
    assert cka_per_layer([], []) == []
