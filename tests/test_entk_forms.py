"""The two forms of a Linear/Conv2d weight in the fused eNTK path — the gather kernels and the
materialised per-sample gradients (one batched product, then a pick) — equal the vmap reference
in float64 to 1e-10 on odd shapes; the per-layer cost model keeps the CPU's choice of before it had
launch and store terms; and the least-squares fit of its constants recovers known constants."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import hpcfl.entk.costs as costs
import hpcfl.entk.layers as layers
from hpcfl.entk import entk_features, native, num_params
from hpcfl.entk._common import eval_mode
from hpcfl.entk.coords import coordinate_set, param_columns, scope_parameters
from hpcfl.entk.fused import build_plan, fused_features
from hpcfl.entk.layers import ConvPlan, LinearPlan
from hpcfl.models import build_model

F64 = torch.float64
CPU = torch.device("cpu")


def _assert_close(got: torch.Tensor, ref: torch.Tensor, what: str, rtol: float = 1e-10) -> None:
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = float((got - ref).norm() / ref.norm().clamp_min(1e-300))
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol}"
    assert torch.allclose(got, ref, rtol=rtol, atol=rtol * float(ref.abs().max())), f"{what}: elementwise"


class _OddNet(nn.Module):
    """Odd conv geometries (stride, padding, dilation, groups, 'same', a strided 1×1, an empty
    row count after dilation) and Linears with and without bias; tanh keeps every δ non-zero."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 5, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2))
        self.conv2 = nn.Conv2d(5, 10, 3, padding="same", groups=5, bias=False)
        self.conv3 = nn.Conv2d(10, 4, 1, stride=2)
        self.conv4 = nn.Conv2d(4, 7, (2, 3), dilation=(2, 1))
        self.fc = nn.Linear(7 * 1 * 3, 11)
        self.fc2 = nn.Linear(11, 6, bias=False)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.conv1(x))  # (B, 5, 5, 9)
        x = torch.tanh(self.conv2(x))  # (B, 10, 5, 9)
        x = torch.tanh(self.conv3(x))  # (B, 4, 3, 5)
        x = torch.tanh(self.conv4(x)).flatten(1)  # (B, 7·1·3)
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc(x)))))


def _forced(model: nn.Module, x: torch.Tensor, p: int, form: str | None, batch_size: int):
    named = scope_parameters(model)
    columns = param_columns(named, coordinate_set(num_params(model), p, 7))
    plan = build_plan(model, named, columns, CPU, form=form)
    out = torch.full((x.shape[0], p), float("nan"), dtype=F64)
    with eval_mode(model):
        fused_features(model, x, plan=plan, logit=0, out=out, batch_size=batch_size, progress=False)
    return out, plan


def _count_gathers(monkeypatch) -> dict[str, int]:
    calls = {"linear": 0, "conv": 0}

    def counted(kind, fn):
        def wrapper(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(layers, "linear_gather", counted("linear", layers.linear_gather))
    monkeypatch.setattr(layers, "conv2d_gather", counted("conv", layers.conv2d_gather))
    return calls


@pytest.mark.parametrize("tiles", ["one sample a tile", "whole batch"])
@pytest.mark.parametrize("form", ["gather", "materialise"])
@pytest.mark.parametrize("p", [17, 250, 732])
def test_forced_forms_equal_vmap_on_odd_shapes(monkeypatch, form, p, tiles):
    if tiles == "one sample a tile":
        monkeypatch.setattr(costs, "DENSE_TILE_ELEMS", 1)
    calls = _count_gathers(monkeypatch)
    torch.manual_seed(0)
    model = _OddNet().to(F64)
    assert num_params(model) == 733  # p = 732: every layer but one is kept whole or nearly
    x = torch.randn(5, 3, 9, 7, dtype=F64, generator=torch.Generator().manual_seed(1))
    got, plan = _forced(model, x, p, form, batch_size=3)
    ref = entk_features(model, x, p=p, seed=7, method="vmap", dtype=F64)
    _assert_close(got, ref, f"forced {form}, p={p}, {tiles}")
    partial = [lp for lp in plan.layers.values() if not lp.columns[0].full and lp.columns[0].n]
    assert partial, "no layer exercised the forced form"
    assert all(lp.forced == form for lp in partial)
    used = {kind for kind, count in calls.items() if count}
    if form == "materialise":
        assert not used, f"the materialise form called the gather kernels: {calls}"
    else:
        kinds = {"linear" if isinstance(lp, LinearPlan) else "conv" for lp in partial}
        assert used == kinds, f"gathers called for {used}, partial layers {kinds}"


@pytest.mark.parametrize(
    ("name", "shape", "options"),
    [("simplecnn", (1, 28, 28), {}), ("resnet8", (3, 32, 32), {"norm": "gn"})],
    ids=["simplecnn", "resnet8-gn"],
)
@pytest.mark.parametrize("form", ["gather", "materialise"])
def test_forced_forms_equal_vmap_on_zoo_models(name, shape, options, form):
    torch.manual_seed(0)
    model = build_model(name, shape, 10, **options).to(F64)
    x = torch.randn(3, *shape, dtype=F64, generator=torch.Generator().manual_seed(2))
    p = num_params(model) // 3
    got, _ = _forced(model, x, p, form, batch_size=2)
    ref = entk_features(model, x, p=p, seed=7, method="vmap", dtype=F64)
    _assert_close(got, ref, f"{name}, forced {form}")


def test_unknown_form_is_refused():
    model = _OddNet()
    named = scope_parameters(model)
    columns = param_columns(named, coordinate_set(num_params(model), 20, 0))
    with pytest.raises(ValueError, match="dense"):
        build_plan(model, named, columns, CPU, form="dense")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown form"):
        costs.form_features(
            "dense", batch=1, n=1, out_channels=1, k=1, unfold_rows=0, length=1, device_type="cpu"
        )


# The CPU plan of each benchmark model as the cost model chose it before the launch/store terms and
# the Linear materialise form existed (recorded from main at b80062c): p → {layer: form}.
_CPU_CHOICE = {
    "simplecnn": {p: {"conv": "materialise", "linear": "gather"} for p in (100_000, 20_000)},
    "resnet8": {
        100_000: {"conv": "full", "linear": "full"},
        20_000: {"conv": "materialise", "linear": "gather"},
    },
    "vgg11": {p: {"conv": "gather", "linear": "gather"} for p in (100_000, 20_000)},
}
_MODELS = {
    "simplecnn": ((1, 28, 28), {}),
    "resnet8": ((3, 32, 32), {"norm": "gn"}),
    "vgg11": ((3, 32, 32), {}),
}


@pytest.mark.parametrize("name", list(_CPU_CHOICE))
def test_cpu_plan_keeps_todays_forms(name, monkeypatch):
    """The torch forms' choice (the native kernel switched off: tests/test_entk_native.py covers it)."""
    monkeypatch.setenv("HPCFL_ENTK_NATIVE", "0")
    shape, options = _MODELS[name]
    torch.manual_seed(0)
    model = build_model(name, shape, 10, **options).eval()
    named = scope_parameters(model)
    seen: dict[str, tuple[int, int]] = {}  # layer -> (input channels, output positions)
    modules = dict(model.named_modules())
    for p, expected in _CPU_CHOICE[name].items():
        columns = param_columns(named, coordinate_set(num_params(model), min(p, num_params(model)), 0))
        plan = build_plan(model, named, columns, CPU)
        if not seen:
            hooks = [
                modules[layer].register_forward_hook(
                    lambda m, a, o, layer=layer: seen.__setitem__(layer, (a[0].shape[1], o[0, 0].numel()))
                )
                for layer in plan.layers
            ]
            with torch.no_grad():
                model(torch.zeros(1, *shape))
            for hook in hooks:
                hook.remove()
        for layer, lp in plan.layers.items():
            if isinstance(lp, ConvPlan):
                channels, length = seen[layer]
                assert lp.form(256, length, channels) == expected["conv"], f"{name} p={p} {layer}"
            elif isinstance(lp, LinearPlan):
                assert lp.form(256) == expected["linear"], f"{name} p={p} {layer}"


def test_cpu_choice_is_the_per_sample_rule_of_before():
    """On the CPU, for any batch: a Linear always gathers, and a conv materialises exactly where the
    earlier per-sample rule (0.03 ns a MAC, 0.3 a streamed element, 1 a pick vs 1 a term) said so."""
    grid = itertools.product((1, 7, 256), (1, 9, 500), (3, 64, 512), (9, 288, 4608), (1, 16, 784))
    for batch, n, out_c, k, length in grid:
        n = min(n, out_c * k - 1)
        linear = costs.choose_layer_form(
            batch=batch, n=n, out_channels=out_c, k=k, unfold_rows=0, length=1, device_type="cpu"
        )
        assert linear == "gather", (batch, n, out_c, k)
        rows = k  # ungrouped: C·kh·kw rows of the unfolded input
        dense = out_c * k * length * 0.03 + (rows * length + out_c * k) * 0.3 + n * 1.0
        before = "materialise" if dense < n * length * 1.0 else "gather"
        conv = costs.choose_layer_form(
            batch=batch, n=n, out_channels=out_c, k=k, unfold_rows=rows, length=length, device_type="cpu"
        )
        assert conv == before, (batch, n, out_c, k, length)


def test_cuda_materialise_tiles_are_whole_batches():
    per_sample = 32 * 9 * 784 + 64 * 288  # simplecnn conv2: unfolded input + per-sample gradient
    assert costs.materialise_tile(256, per_sample, "cpu") == 4
    assert costs.materialise_tile(256, per_sample, "cuda") == 256
    cpu = costs.form_features(
        "materialise",
        batch=256,
        n=5000,
        out_channels=64,
        k=288,
        unfold_rows=288,
        length=784,
        device_type="cpu",
    )
    cuda = costs.form_features(
        "materialise",
        batch=256,
        n=5000,
        out_channels=64,
        k=288,
        unfold_rows=288,
        length=784,
        device_type="cuda",
    )
    assert (cpu["launch"], cuda["launch"]) == (3 * 64, 3)
    assert {k: v for k, v in cpu.items() if k != "launch"} == {k: v for k, v in cuda.items() if k != "launch"}


def test_fit_constants_recovers_known_constants():
    truth = {"launch": 4000.0, "mac": 0.002, "mem": 0.015, "pick": 0.03, "term": 0.05, "store": 0.0}
    gen = torch.Generator().manual_seed(0)
    rows, times = [], []
    for _ in range(40):
        batch, n = (
            int(torch.randint(1, 300, (1,), generator=gen)),
            int(torch.randint(1, 5000, (1,), generator=gen)),
        )
        out_c, k = (
            int(torch.randint(3, 600, (1,), generator=gen)),
            int(torch.randint(9, 5000, (1,), generator=gen)),
        )
        length = int(torch.randint(1, 900, (1,), generator=gen))
        unfold = 0 if length == 1 else k
        for form in costs.FORMS:
            feats = costs.form_features(
                form,
                batch=batch,
                n=n,
                out_channels=out_c,
                k=k,
                unfold_rows=unfold,
                length=length,
                device_type="cuda",
            )
            rows.append(feats)
            times.append(sum(truth[name] * count for name, count in feats.items()))
    fitted = costs.fit_constants(rows, times)
    for name, value in truth.items():
        assert fitted[name] == pytest.approx(value, rel=1e-6, abs=1e-9), (name, fitted)
    with pytest.raises(ValueError, match="positive"):
        costs.fit_constants(rows[:2], [1.0, 0.0])
    with pytest.raises(ValueError, match="as many"):
        costs.fit_constants(rows[:2], [1.0])


def test_layer_inputs_and_deltas_feed_the_plans_to_the_fused_result():
    """What benchmarks/entk_layer_costs.py times layer by layer is what the fused batch computes."""
    from hpcfl.entk.fused import layer_inputs_and_deltas
    from hpcfl.entk.layers import Workspace

    torch.manual_seed(0)
    model = _OddNet().to(F64)
    x = torch.randn(4, 3, 9, 7, dtype=F64, generator=torch.Generator().manual_seed(3))
    ref, plan = _forced(model, x, 250, None, batch_size=4)
    got = torch.full_like(ref, float("nan"))
    modules = dict(model.named_modules())
    with eval_mode(model):
        captured = layer_inputs_and_deltas(model, x, plan=plan)
    assert set(captured) == set(plan.layers)
    for layer, (act, delta) in captured.items():
        for task in plan.layers[layer].tasks(modules[layer], act, delta, got, Workspace(), pieces=1):
            task()
    assert torch.equal(got, ref)


@pytest.mark.parametrize("form", [None, "gather", "materialise"])
def test_cuda_paths_played_on_the_cpu_equal_vmap(form):
    """Under the fake accelerator the plans take their CUDA branches (CUDA constants and whole-batch
    tiles, the NCHW 'weight' operand layout, the gathers' torch references): no device mix, and the
    features equal the CPU vmap reference to 1e-10."""
    from hpcfl.testing.fake_accelerator import fake_cuda

    torch.manual_seed(0)
    model = _OddNet().to(F64)
    x = torch.randn(5, 3, 9, 7, dtype=F64, generator=torch.Generator().manual_seed(4))
    ref = entk_features(model, x, p=250, seed=7, method="vmap", dtype=F64)
    with fake_cuda() as dev:
        cuda = torch.device("cuda")
        model.to(cuda)
        named = scope_parameters(model)
        columns = param_columns(named, coordinate_set(num_params(model), 250, 7))
        plan = build_plan(model, named, columns, cuda, form=form)
        out = torch.empty(5, 250, dtype=F64, device=cuda)
        with eval_mode(model):
            fused_features(model, x, plan=plan, logit=0, out=out, batch_size=5, progress=False)
        assert dev.is_accel(out)
        conv = [lp for lp in plan.layers.values() if isinstance(lp, ConvPlan)]
        assert all(lp._layout(16, False) == "weight" for lp in conv)
        got = out.cpu()
    _assert_close(got, ref, f"fake CUDA, form {form}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("autotune", [False, True], ids=["fixed-tiles", "autotuned"])
@pytest.mark.parametrize("form", [None, "gather", "materialise"])
def test_forms_on_cuda_equal_cpu_vmap(monkeypatch, form, autotune):
    """On a real GPU: the compiled gathers (fixed or autotuned tiles), the materialise form's
    cuBLAS product and the cost model's CUDA choice equal the CPU vmap reference, float64."""
    import triton_kernels._triton as tt

    monkeypatch.setattr(tt, "AUTOTUNE", autotune)
    torch.manual_seed(0)
    model = _OddNet().to(F64)
    x = torch.randn(5, 3, 9, 7, dtype=F64, generator=torch.Generator().manual_seed(4))
    ref = entk_features(model, x, p=250, seed=7, method="vmap", dtype=F64)
    cuda = torch.device("cuda")
    model.to(cuda)
    named = scope_parameters(model)
    columns = param_columns(named, coordinate_set(num_params(model), 250, 7))
    plan = build_plan(model, named, columns, cuda, form=form)
    out = torch.empty(5, 250, dtype=F64, device=cuda)
    with eval_mode(model):
        fused_features(model, x, plan=plan, logit=0, out=out, batch_size=5, progress=False)
    _assert_close(out.cpu(), ref, f"CUDA, form {form}, autotune {autotune}")


def test_layer_cost_script_times_both_forms_and_fits(tmp_path):
    """benchmarks/entk_layer_costs.py at a tiny size on the CPU: a row per layer and form, the
    constants fitted over them, whole batches under each choice (figures not asserted)."""
    import importlib.util
    import json

    from tests.helpers import REPO

    spec = importlib.util.spec_from_file_location(
        "entk_layer_costs", REPO / "benchmarks" / "entk_layer_costs.py"
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    argv = ["--device", "cpu", "--models", "simplecnn", "--batch", "3", "--p", "1500", "--runs", "1"]
    assert script.main([*argv, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "entk_layer_costs_cpu.json").read_text())
    rows = report["rows"]
    layers_ = {r["layer"] for r in rows}
    assert layers_ == {"conv1", "conv2", "conv3", "fc1", "classifier"}
    timed = {layer: {r["form"] for r in rows if r["layer"] == layer} for layer in layers_}
    forms = set(costs.FORCEABLE) if native.usable(torch.device("cpu")) else set(costs.FORMS)
    assert all(timed[layer] == forms for layer in layers_), timed  # the native form wherever it runs
    assert all(r["ms"] > 0 and r["fitted_ms"] is not None for r in rows)
    assert set(report["fitted"]) == set(costs.COST_TERMS) and min(report["fitted"].values()) >= 0
    policies = {"plain", "auto", "torch", "fitted", "gather", "materialise"}
    assert set(report["batches"]["simplecnn"]) == policies | ({"native"} if "native" in forms else set())
    if "native" in forms:
        assert set(report["native_fit"]) == set(costs.NATIVE_TERMS)
    assert (tmp_path / "entk_layer_costs_cpu.csv").read_text().startswith("model,layer,kind,")
    # the report it wrote is what $HPCFL_ENTK_COSTS names to use the fitted constants on that device
    # type (a cluster's own GPU model) and only there
    costs.fitted_file.cache_clear()
    import os

    os.environ[costs.COSTS_ENV] = str(tmp_path / "entk_layer_costs_cpu.json")
    try:
        assert costs.constants("cpu") == report["fitted"]
        assert costs.constants("cuda") is costs.CUDA_COSTS
    finally:
        del os.environ[costs.COSTS_ENV]
    assert costs.constants("cpu") is costs.CPU_COSTS


def test_costs_file_that_is_not_a_fit_is_one_clear_error(tmp_path, monkeypatch):
    from hpcfl.errors import ConfigError

    bad = tmp_path / "bench.json"
    bad.write_text('{"device": "cuda", "fitted": null}')
    monkeypatch.setenv(costs.COSTS_ENV, str(bad))
    costs.fitted_file.cache_clear()
    with pytest.raises(ConfigError, match="HPCFL_ENTK_COSTS=.*not a fitted-constants report"):
        costs.constants("cuda")
    monkeypatch.setenv(costs.COSTS_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="not a fitted-constants report"):
        costs.constants("cpu")
