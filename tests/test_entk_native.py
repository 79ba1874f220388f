"""The fused eNTK path's native CPU kernel (:mod:`hpcfl.entk.native`): each kernel against its
pure-torch reference (itself checked against the gather references of ``triton_kernels``), the
plans' use of it, whole feature matrices against vmap in float32, and the torch path where the
kernel cannot be built. The kernel tests skip on a CPU without AVX-512 or a C compiler."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hpcfl.entk import costs, entk_features, native
from hpcfl.entk.coords import coordinate_set, param_columns, scope_parameters
from hpcfl.entk.fused import build_plan
from hpcfl.entk.layers import ConvPlan, LinearPlan
from hpcfl.entk.settings import EntkSettings, applied
from hpcfl.models import build_model, reinit_last_layer
from tests.test_entk import _assert_close
from tests.test_entk_text import _codes, _text_model
from triton_kernels import conv2d_gather_reference, linear_gather_reference

KERNEL, WHY = native.library()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=f"native kernel not built here: {WHY}")


def _kept(rows: int, width: int, density: float, seed: int) -> native.KeptMasks:
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(rows * width, generator=gen) < density
    return native.KeptMasks.of(torch.nonzero(keep).flatten(), rows, width)


def _no_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the references raise inside the dispatchers, so a test sees the kernel itself run."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the dispatcher fell back to the torch reference")

    monkeypatch.setattr(native, "masked_product_reference", refuse)
    monkeypatch.setattr(native, "conv_masked_product_reference", refuse)


def test_kept_masks_hold_each_row_s_columns_as_lane_bits() -> None:
    local = torch.tensor([0, 3, 15, 16, 40, 2 * 41 + 40])  # rows of width 41: row 0 and row 2
    kept = native.KeptMasks.of(local, 3, 41)
    bits = kept.masks.to(torch.int32) & 0xFFFF
    assert kept.masks.shape == (3, 3) and kept.starts.tolist() == [0, 5, 5, 6]
    assert bits[0].tolist() == [(1 << 0) | (1 << 3) | (1 << 15), 1 << 0, 1 << 8]
    assert bits[1].tolist() == [0, 0, 0] and bits[2].tolist() == [0, 0, 1 << 8]
    with pytest.raises(ValueError, match="strictly increasing"):
        native.KeptMasks.of(torch.tensor([3, 3]), 3, 41)
    with pytest.raises(ValueError, match="outside a 3x41 matrix"):
        native.KeptMasks.of(torch.tensor([5, 123]), 3, 41)


def test_the_references_agree_with_the_gather_references() -> None:
    """The native kernels' references are what the torch gathers of ``triton_kernels`` compute."""
    gen = torch.Generator().manual_seed(0)
    kept = _kept(7, 50, 0.3, 1)
    delta, act = torch.randn(4, 7, generator=gen), torch.randn(4, 50, generator=gen)
    got = native.masked_product_reference(
        delta[:, :, None], act[:, None, :], kept, torch.empty(4, len(kept.index))
    )
    o, i = kept.index // 50, kept.index % 50
    assert torch.equal(got, linear_gather_reference(delta, act, o, i))
    x = torch.randn(3, 4, 9, 8, generator=gen, dtype=torch.float64)
    geometry = native.ConvGeometry((3, 2), (2, 1), (1, 0), (1, 2))
    delta = torch.randn(3, 5, 5, 6, generator=gen, dtype=torch.float64)  # (B, O, Ho, Wo)
    kept = _kept(5, 4 * 6, 0.4, 2)
    got = native.conv_masked_product_reference(
        x, delta, geometry, kept, torch.empty(3, len(kept.index), dtype=torch.float64)
    )
    o, k = kept.index // 24, kept.index % 24
    ref = conv2d_gather_reference(
        delta, x, o, k // 6, (k % 6) // 2, k % 2, stride=(2, 1), padding=(1, 0), dilation=(1, 2)
    )
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


@needs_kernel
@pytest.mark.parametrize(
    ("rows", "width", "length"),
    [(1, 1, 1), (3, 17, 1), (128, 2048, 1), (5, 70, 3), (13, 130, 16), (4, 64, 49), (9, 31, 5), (6, 300, 1)],
)
@pytest.mark.parametrize("density", [0.0, 0.05, 0.3, 1.0])
def test_masked_product_equals_its_reference(
    monkeypatch: pytest.MonkeyPatch, rows: int, width: int, length: int, density: float
) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    kept = _kept(rows, width, density, seed=width)
    batch, n = 6, len(kept.index)
    d = torch.randn(batch, length, rows, generator=gen).transpose(1, 2)  # (B, O, L), positions strided
    u = torch.randn(batch, length, width, generator=gen)
    ref = native.masked_product_reference(d, u, kept, torch.empty(batch, n))
    wide = torch.full((batch, n + 7), float("nan"))
    _no_fallback(monkeypatch)
    native.masked_product(d, u, kept, wide[:, 3 : 3 + n])  # a column slice of a wider matrix
    got = wide[:, 3 : 3 + n]
    assert wide[:, :3].isnan().all() and wide[:, 3 + n :].isnan().all(), "wrote outside its columns"
    if length == 1:  # one product per entry: the same rounding as torch's multiply
        assert torch.equal(got, ref)
    else:
        scale = float(ref.abs().max()) if ref.numel() else 1.0
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * scale)


CONVS = [
    # channels, (H, W), out channels, kernel, stride, padding, dilation
    (1, (28, 28), 32, (3, 3), (2, 2), (1, 1), (1, 1)),
    (16, (7, 7), 24, (3, 3), (2, 2), (1, 1), (1, 1)),
    (3, (9, 8), 5, (3, 2), (2, 1), (1, 0), (1, 2)),
    (8, (6, 5), 7, (1, 1), (1, 1), (0, 0), (1, 1)),
    (5, (4, 9), 9, (4, 3), (1, 2), (0, 1), (1, 1)),  # one output row
    (6, (8, 3), 4, (3, 3), (1, 1), (1, 0), (1, 1)),  # one output column
]


@needs_kernel
@pytest.mark.parametrize(("channels", "hw", "out_c", "kernel", "stride", "padding", "dilation"), CONVS)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_conv_masked_product_equals_its_reference(
    monkeypatch: pytest.MonkeyPatch, channels, hw, out_c, kernel, stride, padding, dilation, channels_last
) -> None:
    gen = torch.Generator().manual_seed(channels * 31 + out_c)
    x = torch.randn(5, channels, *hw, generator=gen)
    geometry = native.ConvGeometry(kernel, stride, padding, dilation)
    out_hw = F.conv2d(x, torch.zeros(out_c, channels, *kernel), None, stride, padding, dilation).shape[2:]
    delta = torch.randn(5, out_c, *out_hw, generator=gen)
    if channels_last:
        x, delta = x.to(memory_format=torch.channels_last), delta.to(memory_format=torch.channels_last)
    kept = _kept(out_c, channels * kernel[0] * kernel[1], 0.3, seed=channels)
    n = len(kept.index)
    ref = native.conv_masked_product_reference(x, delta, geometry, kept, torch.empty(5, n))
    _no_fallback(monkeypatch)
    got = native.conv_masked_product(x, delta, geometry, kept, torch.empty(5, n))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def _plan(name: str, p: int, **options: object):
    torch.manual_seed(0)
    shape = (1, 28, 28) if name == "simplecnn" else (3, 32, 32)
    model = build_model(name, shape, 10, **options).eval()
    named = scope_parameters(model)
    total = sum(t.numel() for _, t in named)
    return build_plan(
        model, named, param_columns(named, coordinate_set(total, min(p, total), 0)), torch.device("cpu")
    )


SIMPLECNN_DIMS = {"conv1": (1, 196), "conv2": (32, 49), "conv3": (64, 16)}  # (input channels, L)


def _forms(plan, dtype: torch.dtype = torch.float32) -> dict[str, str]:
    forms = {}
    for layer, lp in plan.layers.items():
        if isinstance(lp, ConvPlan):
            channels, length = SIMPLECNN_DIMS[layer]
            forms[layer] = lp.form(256, length, channels, dtype=dtype)
        elif isinstance(lp, LinearPlan):
            forms[layer] = lp.form(256, dtype=dtype)
    return forms


@needs_kernel
def test_the_plan_takes_the_kernel_where_the_cost_model_says_and_only_for_float32() -> None:
    """simplecnn at batch 256 (the benchmark's setting): at p = 1e5 the kernel forms conv2, conv3,
    fc1 and the classifier, not conv1 (K = 9: mostly padding); at p = 2e4 fc1 keeps too few
    coordinates for it and gathers. float64, or the setting off, keeps today's torch forms."""
    assert _forms(_plan("simplecnn", 100_000)) == {
        "conv1": "materialise",
        "conv2": "native",
        "conv3": "native",
        "fc1": "native",
        "classifier": "native",
    }
    assert _forms(_plan("simplecnn", 20_000))["fc1"] == "gather"
    torch_forms = {"conv1": "materialise", "conv2": "materialise", "conv3": "materialise", "fc1": "gather",
                   "classifier": "gather"}  # fmt: skip
    assert _forms(_plan("simplecnn", 100_000), torch.float64) == torch_forms
    with applied(EntkSettings(native=False)):
        assert _forms(_plan("simplecnn", 100_000)) == torch_forms


@needs_kernel
def test_whole_conv_weights_take_the_kernel_where_the_model_finds_it_cheaper() -> None:
    """resnet8 with every weight kept (p >= P), batch 256: the kernel for layer2.0.conv2 and the
    layer3 convolutions, materialised whole where its unfold of 1,024 positions or a 1×1 kernel's
    padding costs more (the model's estimate)."""
    plan = _plan("resnet8", 10**6, norm="bn")
    dims = {"conv1": (3, 1024), "layer1.0.conv1": (16, 1024), "layer2.0.conv2": (32, 256),
            "layer2.0.shortcut.0": (16, 256), "layer3.0.conv2": (64, 64)}  # fmt: skip
    forms = {
        layer: plan.layers[layer].form(256, length, channels) for layer, (channels, length) in dims.items()
    }
    assert forms == {"conv1": "full", "layer1.0.conv1": "full", "layer2.0.conv2": "native",
                     "layer2.0.shortcut.0": "full", "layer3.0.conv2": "native"}  # fmt: skip
    assert plan.layers["layer3.0.conv2"].form(256, 64, 64, dtype=torch.float64) == "full"
    with applied(EntkSettings(native=False)):
        assert _plan("resnet8", 10**6, norm="bn").layers["layer3.0.conv2"].form(256, 64, 64) == "full"


def test_choose_layer_form_weighs_the_native_cost_only_when_asked() -> None:
    dims = dict(batch=256, n=73_631, out_channels=128, k=2048, unfold_rows=0, length=1, device_type="cpu")
    assert costs.choose_layer_form(**dims) == "gather"
    assert costs.choose_layer_form(**dims, native=True) == "native"
    sparse = {**dims, "n": 700}  # 0.3 % of the weight: the gathers do less than a pass over it
    assert costs.choose_layer_form(**sparse, native=True) == "gather"


def _f32_model(name: str, shape: tuple[int, int, int], **options: object):
    torch.manual_seed(0)
    model = build_model(name, shape, 10, **options)
    reinit_last_layer(model, seed=1)
    return model


@needs_kernel
@pytest.mark.parametrize(
    ("name", "shape", "options", "p"),
    [
        ("simplecnn", (1, 28, 28), {}, 100_000),
        ("resnet8", (3, 32, 32), {"norm": "gn"}, 20_000),
        ("resnet8", (3, 32, 32), {"norm": "bn"}, 78_042),  # p = P: whole weights, every lane kept
    ],
)
def test_fused_features_with_the_kernel_equal_vmap_in_float32(name, shape, options, p) -> None:
    model = _f32_model(name, shape, **options)
    x = torch.randn(20, *shape, generator=torch.Generator().manual_seed(4))
    ref = entk_features(model, x, p=p, seed=7, method="vmap")
    got = entk_features(model, x, p=p, seed=7, method="fused")
    with applied(EntkSettings(native=False)):
        torch_path = entk_features(model, x, p=p, seed=7, method="fused")
    _assert_close(got, ref, f"{name} fused (native) vs vmap", rtol=1e-5)
    _assert_close(got, torch_path, f"{name} fused (native) vs fused (torch forms)", rtol=1e-5)


@needs_kernel
def test_the_transformer_s_sequence_linears_through_the_kernel_equal_vmap() -> None:
    model = _text_model("char-transformer", 12).float()
    x = _codes(6, 12)
    total = sum(t.numel() for t in model.parameters())
    ref = entk_features(model, x, p=total // 2, seed=7, method="vmap")
    got = entk_features(model, x, p=total // 2, seed=7, method="fused")
    _assert_close(got, ref, "char-transformer fused (native) vs vmap", rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 3])
def test_the_kernel_s_features_do_not_depend_on_the_thread_count(threads: int) -> None:
    """Each task forms whole samples, so any split of the batch gives the same bits."""
    model = _f32_model("simplecnn", (1, 28, 28))
    x = torch.randn(37, 1, 28, 28, generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    ref = entk_features(model, x, p=100_000, seed=7, method="fused")
    torch.set_num_threads(threads)
    try:
        got = entk_features(model, x, p=100_000, seed=7, method="fused")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, ref)


def test_without_a_compiler_the_torch_forms_run_and_the_record_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """A failed build leaves no library behind (nothing half-written under the final name), says why
    in one line, and the fused path computes the same features by the torch forms."""
    monkeypatch.setattr(native, "_LOADED", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    assert native.library()[0] is None
    assert native.status().startswith("off: compiling native_kernels.c failed")
    assert not list((tmp_path / "hpcfl" / "native").glob("*")), "a failed build left files behind"
    assert _forms(_plan("simplecnn", 100_000))["fc1"] == "gather"
    model = _f32_model("simplecnn", (1, 28, 28))
    x = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(6))
    got = entk_features(model, x, p=50_000, seed=7, method="fused")
    ref = entk_features(model, x, p=50_000, seed=7, method="vmap")
    _assert_close(got, ref, "fused (torch forms, no compiler) vs vmap", rtol=1e-5)
    monkeypatch.setattr(native, "_LOADED", None)
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc at all
    monkeypatch.delenv("CC")
    assert native.status() == "off: no C compiler (cc) on PATH"
    with applied(EntkSettings(native=False, native_from="HPCFL_ENTK_NATIVE")):
        assert native.status() == "off: switched off (HPCFL_ENTK_NATIVE)"


@needs_kernel
def test_the_build_is_cached_per_source_compiler_and_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(native, "_LOADED", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    lib, where = native.library()
    assert lib is not None and where.startswith(str(tmp_path / "hpcfl" / "native" / "entk-"))
    built = sorted(p.name for p in (tmp_path / "hpcfl" / "native").iterdir())
    assert built == [where.rsplit("/", 1)[1]], f"only the library, no temporary left: {built}"
    mtime = (tmp_path / "hpcfl" / "native" / built[0]).stat().st_mtime_ns
    monkeypatch.setattr(native, "_LOADED", None)
    assert native.library()[1] == where  # the second process finds it
    assert (tmp_path / "hpcfl" / "native" / built[0]).stat().st_mtime_ns == mtime
