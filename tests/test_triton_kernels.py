"""The eNTK gather kernels: references against brute-force per-sample gradients, and the Triton
kernels (compiled on CUDA tensors where a GPU exists, else run by the interpreter on CPU tensors,
TRITON_INTERPRET=1 from conftest) against the references.

Shapes are small and odd (nothing a multiple of a block size) because the interpreter is slow.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import triton_kernels as tk
from triton_kernels.entk_linear import walks_runs

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}

needs_triton = pytest.mark.skipif(not tk.HAS_TRITON, reason="triton is not installed")
#: where the Triton tests put their tensors: compiled kernels need CUDA ones
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _choose(numel: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(numel, generator=gen)[:n].sort().values


def _per_sample_conv_weight_grad(delta, x, weight_shape, stride, padding, dilation, groups):
    """(B, O, C/G, kh, kw) by differentiating <δ_b, conv(x_b, W)> w.r.t. W, one sample at a time."""
    grads = []
    for b in range(x.shape[0]):
        w = torch.zeros(weight_shape, dtype=x.dtype, requires_grad=True)
        y = F.conv2d(x[b : b + 1], w, None, stride, padding, dilation, groups)
        (g,) = torch.autograd.grad((y * delta[b : b + 1]).sum(), w)
        grads.append(g)
    return torch.stack(grads)


def _conv_case(dtype, groups=1, stride=(2, 1), padding=(1, 2), dilation=(1, 2), seed=0, n=37):
    gen = torch.Generator().manual_seed(seed)
    batch, channels, out_channels, kh, kw = 3, 4, 6, 3, 2
    x = torch.randn(batch, channels, 7, 5, generator=gen, dtype=dtype)
    weight_shape = (out_channels, channels // groups, kh, kw)
    h_out = (7 + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    w_out = (5 + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    delta = torch.randn(batch, out_channels, h_out, w_out, generator=gen, dtype=dtype)
    numel = torch.Size(weight_shape).numel()
    sel = _choose(numel, n, seed)
    o, rem = sel // (numel // out_channels), sel % (numel // out_channels)
    c_local, rem = rem // (kh * kw), rem % (kh * kw)
    ky, kx = rem // kw, rem % kw
    chan = (o // (out_channels // groups)) * (channels // groups) + c_local
    full = _per_sample_conv_weight_grad(delta, x, weight_shape, stride, padding, dilation, groups)
    expected = full.reshape(batch, -1)[:, sel]
    geometry = dict(stride=stride, padding=padding, dilation=dilation)
    return (delta, x, o, chan, ky, kx), geometry, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("batch", "rows", "cols", "n"),
    [(5, 7, 11, 23), (5, 3, 200, 450), (64, 3, 400, 600)],
    ids=["row-tiles", "long-runs-few-samples", "runs"],
)
def test_linear_reference_equals_outer_product(dtype, batch, rows, cols, n):
    """Short runs of equal output row, or long runs of few samples, take the row-tile path; long
    runs of many samples the per-run path (``walks_runs``). Every path writes the outer product."""
    gen = torch.Generator().manual_seed(1)
    delta = torch.randn(batch, rows, generator=gen, dtype=dtype)
    act = torch.randn(batch, cols, generator=gen, dtype=dtype)
    sel = _choose(rows * cols, n, 1)
    distinct = torch.unique(sel // cols).numel()
    assert walks_runs(batch, n, distinct) == (batch == 64)
    expected = (delta[:, :, None] * act[:, None, :]).reshape(batch, -1)[:, sel]
    got = tk.linear_gather_reference(delta, act, sel // cols, sel % cols)
    torch.testing.assert_close(got, expected, **TOL[dtype], msg="linear reference != outer product")
    half = torch.zeros(batch, n + 3, dtype=torch.float16)
    tk.linear_gather_reference(delta, act, sel // cols, sel % cols, out=half[:, 1 : n + 1])
    torch.testing.assert_close(half[:, 1 : n + 1], expected.half(), msg="half output slice")


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("n", [37, 130], ids=["distinct-windows", "shared-windows"])
@pytest.mark.parametrize("tile", [None, 7], ids=["one-chunk", "many-chunks"])
def test_conv_reference_equals_autograd(groups, n, tile, monkeypatch):
    """Few coordinates per input window gather each coordinate's window; many gather each window
    once and pick its rows; a small tile walks the coordinates in several chunks."""
    import triton_kernels.entk_conv as conv

    if tile is not None:
        monkeypatch.setattr(conv, "_TILE_ELEMS", tile)
    args, geometry, expected = _conv_case(torch.float64, groups=groups, n=n)
    got = tk.conv2d_gather_reference(*args, **geometry)
    torch.testing.assert_close(got, expected, **TOL[torch.float64], msg="conv reference != autograd")
    delta, x, *index = args
    channels_last = [t.contiguous(memory_format=torch.channels_last) for t in (delta, x)]
    got = tk.conv2d_gather_reference(*channels_last, *index, **geometry)
    torch.testing.assert_close(got, expected, **TOL[torch.float64], msg="channels-last inputs")


def test_norm_references_equal_formula():
    gen = torch.Generator().manual_seed(2)
    delta, x = (
        torch.randn(3, 5, 9, generator=gen, dtype=torch.float64),
        torch.randn(3, 5, 9, generator=gen, dtype=torch.float64),
    )
    mean, rstd = (
        torch.randn(5, generator=gen, dtype=torch.float64),
        torch.rand(5, generator=gen, dtype=torch.float64) + 0.5,
    )
    index = torch.tensor([4, 0, 2])
    xhat = (x - mean[None, :, None]) * rstd[None, :, None]
    got_w = tk.norm_weight_gather_reference(delta, x, mean.expand(3, 5), rstd.expand(3, 5), index)
    torch.testing.assert_close(got_w, (delta * xhat).sum(2)[:, index], msg="norm weight reference != Σ δ·x̂")
    got_b = tk.channel_sum_gather_reference(delta, index)
    torch.testing.assert_close(got_b, delta.sum(2)[:, index], msg="channel sum reference != Σ δ")


def test_reference_writes_into_strided_half_view():
    gen = torch.Generator().manual_seed(3)
    delta, act = torch.randn(4, 3, generator=gen), torch.randn(4, 5, generator=gen)
    sel = _choose(15, 6, 3)
    big = torch.zeros(4, 10, dtype=torch.float16)
    tk.linear_gather_reference(delta, act, sel // 5, sel % 5, out=big[:, 2:8])
    expected = (delta[:, :, None] * act[:, None, :]).reshape(4, -1)[:, sel].half()
    torch.testing.assert_close(big[:, 2:8], expected, msg="half output slice")
    assert big[:, :2].abs().sum() == 0 and big[:, 8:].abs().sum() == 0, "wrote outside its slice"


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linear_triton_equals_reference(dtype):
    gen = torch.Generator().manual_seed(4)
    delta, act = (
        torch.randn(19, 7, generator=gen, dtype=dtype),
        torch.randn(19, 13, generator=gen, dtype=dtype),
    )
    sel = _choose(91, 45, 4)
    o, i = sel // 13, sel % 13
    ref = tk.linear_gather_reference(delta, act, o, i)
    d, a, o, i = (t.to(DEVICE) for t in (delta, act, o, i))
    got = tk.linear_gather_triton(d, a, o.int(), i.int())
    torch.testing.assert_close(got.cpu(), ref, **TOL[dtype], msg="linear_gather_triton != reference")
    big = torch.zeros(19, 50, dtype=dtype, device=DEVICE)
    tk.linear_gather_triton(d.t().contiguous().t(), a, o, i, out=big[:, 3:48])
    torch.testing.assert_close(big[:, 3:48].cpu(), ref, **TOL[dtype], msg="strided inputs / output view")


@needs_triton
@pytest.mark.parametrize("groups", [1, 2])
def test_conv_triton_equals_reference(groups):
    args, geometry, _ = _conv_case(torch.float32, groups=groups, seed=5)
    ref = tk.conv2d_gather_reference(*args, **geometry)
    got = tk.conv2d_gather_triton(*(t.to(DEVICE) for t in args), **geometry).cpu()
    torch.testing.assert_close(got, ref, **TOL[torch.float32], msg="conv2d_gather_triton != reference")


@needs_triton
def test_norm_triton_equals_reference():
    gen = torch.Generator().manual_seed(6)
    delta, x = torch.randn(3, 5, 37, generator=gen), torch.randn(3, 5, 37, generator=gen)
    mean, rstd = torch.randn(3, 5, generator=gen), torch.rand(5, generator=gen).expand(3, 5) + 0.5
    index = torch.tensor([4, 1, 3])
    ref_w = tk.norm_weight_gather_reference(delta, x, mean, rstd, index)
    on = [t.to(DEVICE) for t in (delta, x, mean, rstd, index)]
    got_w = tk.norm_weight_gather_triton(*on).cpu()
    torch.testing.assert_close(
        got_w, ref_w, **TOL[torch.float32], msg="norm_weight_gather_triton != reference"
    )
    ref_b = tk.channel_sum_gather_reference(delta, index)
    got_b = tk.channel_sum_gather_triton(on[0], on[4]).cpu()
    torch.testing.assert_close(
        got_b, ref_b, **TOL[torch.float32], msg="channel_sum_gather_triton != reference"
    )


def test_dispatchers_use_reference_on_cpu(monkeypatch):
    import triton_kernels.entk_linear as lg

    called = []
    monkeypatch.setattr(lg, "linear_gather_triton", lambda *a, **k: called.append(1))
    delta, act = torch.randn(2, 3), torch.randn(2, 4)
    got = tk.linear_gather(delta, act, torch.tensor([0, 2]), torch.tensor([3, 1]))
    assert not called, "dispatcher launched Triton on CPU tensors"
    torch.testing.assert_close(got, delta[:, [0, 2]] * act[:, [3, 1]], msg="dispatcher result")


def test_package_imports_and_dispatches_without_triton():
    """A CPU-only install without Triton: the package imports and the dispatchers use the references."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, triton_kernels as tk\n"
        "assert not tk.HAS_TRITON\n"
        "d, a = torch.randn(2, 3), torch.randn(2, 4)\n"
        "g = tk.linear_gather(d, a, torch.tensor([1]), torch.tensor([2]))\n"
        "assert torch.equal(g, d[:, [1]] * a[:, [2]])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("span", [40, 10_000], ids=["marker", "sort"])
def test_distinct_windows_equal_torch_unique(span):
    from triton_kernels.entk_conv import _distinct

    keys = torch.randint(0, span, (50,), generator=torch.Generator().manual_seed(7))
    values, inverse = _distinct(keys, span)
    ref_values, ref_inverse = torch.unique(keys, return_inverse=True)
    assert torch.equal(values, ref_values) and torch.equal(inverse, ref_inverse)


@needs_triton
@pytest.mark.parametrize("kernel", ["linear", "conv"])
def test_autotuned_gathers_equal_reference_in_every_config(monkeypatch, kernel):
    """With ``AUTOTUNE`` on, the launch goes through ``triton.autotune``: every tile config is run
    once while tuning (each one's output checked here against the reference), then the chosen one."""
    import triton_kernels._triton as tt
    import triton_kernels.entk_conv as conv
    import triton_kernels.entk_linear as lin

    monkeypatch.setattr(tt, "AUTOTUNE", True)
    if kernel == "linear":
        gen = torch.Generator().manual_seed(8)
        delta, act = torch.randn(21, 9, generator=gen), torch.randn(21, 14, generator=gen)
        sel = _choose(9 * 14, 61, 8)
        args, kwargs = (delta, act, sel // 14, sel % 14), {}
        ref = tk.linear_gather_reference(*args)
        fn, tuned, configs = tk.linear_gather_triton, lin._linear_gather_tuned, lin.LINEAR_TILES
    else:
        args, kwargs, _ = _conv_case(torch.float32, groups=2, seed=9)
        ref = tk.conv2d_gather_reference(*args, **kwargs)
        fn, tuned, configs = tk.conv2d_gather_triton, conv._conv2d_gather_tuned, conv.CONV_TILES
    assert tuned is not None, "this Triton's autotune takes no do_bench: autotuning is unavailable"
    tuned.cache.clear()
    out = torch.full(tuple(ref.shape), float("nan"), device=DEVICE)
    checked = []
    original = tt.bench_config

    def bench_and_check(run, quantiles=None):
        timing = original(run, quantiles)
        torch.testing.assert_close(out.cpu(), ref, **TOL[torch.float32], msg=f"config {len(checked)}")
        checked.append(1)
        return timing

    monkeypatch.setattr(tt, "bench_config", bench_and_check)
    fn(*(t.to(DEVICE) for t in args), **kwargs, out=out)
    assert len(checked) == len(configs), f"{len(checked)} configs run while tuning, {len(configs)} declared"
    torch.testing.assert_close(out.cpu(), ref, **TOL[torch.float32], msg="autotuned launch != reference")
