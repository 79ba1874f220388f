"""eNTK features: the fused path equals vmap equals the paper's loop, on every model of the zoo.

Comparisons run in float64 (so 1e-5 relative is a real check, not float32 noise), on a few small
inputs. BatchNorm running statistics are randomised so eval-mode BN is not close to the identity.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import hpcfl.entk.costs as costs
from hpcfl.entk import EntkMethod, coordinate_set, entk_features, num_params, reinit_last_layer
from hpcfl.errors import ConfigError
from hpcfl.models import build_model
from hpcfl.models import reinit_last_layer as models_reinit

F64 = torch.float64


def _randomise_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.rand(m.num_features, generator=gen) - 0.5)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            if m.affine:
                m.weight.data.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                m.bias.data.copy_(torch.rand(m.num_features, generator=gen) - 0.5)
    return model


def _model(name: str, shape: tuple[int, int, int], **options) -> nn.Module:
    torch.manual_seed(0)
    model = build_model(name, shape, 10, **options)
    reinit_last_layer(model, seed=1)
    return _randomise_bn(model).to(F64)


def _assert_close(got: torch.Tensor, ref: torch.Tensor, what: str, rtol: float = 1e-5) -> None:
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = (got - ref).norm() / ref.norm().clamp_min(1e-300)
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol}"
    scale = ref.abs().max()
    assert torch.allclose(got, ref, rtol=rtol, atol=rtol * float(scale)), f"{what}: elementwise mismatch"


@pytest.fixture(autouse=True)
def _no_silent_fallback(request, caplog):
    """Equality tests must compare the real fused path, not a vmap fallback."""
    caplog.set_level(logging.INFO, logger="hpcfl.entk")
    yield
    if "fallback" not in request.node.name:
        lines = [r.getMessage() for r in caplog.records if r.name.startswith("hpcfl.entk")]
        assert not lines, f"unexpected eNTK log lines: {lines}"


def _features(model, x, p, method, **kw):
    z = entk_features(model, x, p=p, seed=7, method=method, dtype=F64, **kw)
    assert not z.requires_grad, f"{method} returned a tensor attached to a graph"
    return z


CASES = [
    pytest.param("mlp", (1, 28, 28), {}, 4, id="mlp"),
    pytest.param("simplecnn", (1, 28, 28), {}, 4, id="simplecnn"),
    pytest.param("resnet8", (3, 32, 32), {"norm": "bn"}, 3, id="resnet8-bn"),
    pytest.param("resnet8", (3, 32, 32), {"norm": "gn"}, 3, id="resnet8-gn"),
    pytest.param("vgg11", (3, 32, 32), {"batch_norm": False}, 2, id="vgg11"),
    pytest.param("vgg11", (3, 32, 32), {"batch_norm": True}, 2, id="vgg11-bn"),
    pytest.param("resnet18", (3, 32, 32), {"norm": "gn"}, 2, id="resnet18-gn"),
    pytest.param("resnet18", (3, 32, 32), {"norm": "bn"}, 2, id="resnet18-bn"),
]


@pytest.mark.parametrize(("name", "shape", "options", "n"), CASES)
def test_fused_equals_vmap_equals_loop_subsampled(name, shape, options, n):
    model = _model(name, shape, **options)
    x = torch.randn(n, *shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    p = min(20_000, num_params(model) // 3)
    fused = _features(model, x, p, "fused")
    vmap = _features(model, x, p, "vmap")
    _assert_close(fused, vmap, f"{name} fused vs vmap (p={p})")
    loop = _features(model, x[:1], p, "loop")
    _assert_close(loop, vmap[:1], f"{name} loop vs vmap (p={p})")


FULL_CASES = [c for c in CASES if c.id in ("mlp", "simplecnn", "resnet8-bn", "resnet8-gn")] + [
    pytest.param(*c.values, id=c.id, marks=pytest.mark.slow)
    for c in CASES
    if c.id in ("vgg11", "vgg11-bn", "resnet18-gn", "resnet18-bn")
]


@pytest.mark.parametrize(("name", "shape", "options", "n"), FULL_CASES)
def test_fused_equals_vmap_full_entk(name, shape, options, n):
    """p = P: every coordinate, columns in parameter order (the "full" per-layer paths)."""
    model = _model(name, shape, **options)
    x = torch.randn(n, *shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    total = num_params(model)
    fused = _features(model, x, total, "fused")
    vmap = _features(model, x, total, "vmap")
    _assert_close(fused, vmap, f"{name} full eNTK fused vs vmap")
    loop = _features(model, x[:1], total, "loop")
    _assert_close(loop, vmap[:1], f"{name} full eNTK loop vs vmap")


@pytest.mark.parametrize(("num", "p", "seed"), [(1000, 1000, 0), (356_234, 100_000, 123), (17, 5, 9)])
def test_coordinate_set_is_the_papers_randperm_set(num, p, seed):
    state = torch.get_rng_state()
    got = coordinate_set(num, p, seed)
    assert torch.equal(torch.get_rng_state(), state), "coordinate_set touched the global RNG"
    torch.manual_seed(seed)
    expected = torch.randperm(num)[:p]  # TCT Algorithm 3
    assert torch.equal(got, expected.sort().values), "not the manual_seed + randperm set"
    assert got.dtype == torch.int64 and bool((got[1:] > got[:-1]).all()), "not sorted and distinct"


@pytest.mark.parametrize("p", [0, 18])
def test_coordinate_set_rejects_bad_p(p):
    with pytest.raises(ConfigError, match="p="):
        coordinate_set(17, p, 0)


class _Geometry(nn.Module):
    """Odd conv geometries (stride, padding, dilation, groups, 'same'), GN, BN1d, BN2d, biases;
    input channels 4 and 16 exercise both ungrouped dense layouts ("ko" and "nhwc")."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2))
        self.gn = nn.GroupNorm(3, 6)
        self.conv2 = nn.Conv2d(6, 16, 3, padding="same", groups=2, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.conv3 = nn.Conv2d(16, 5, (1, 2), padding="valid")
        self.fc = nn.Linear(5 * 4 * 6, 9)
        self.bn1d = nn.BatchNorm1d(9)
        self.head = nn.Linear(9, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.gn(self.conv1(x)))  # (B, 6, 4, 7)
        x = torch.relu(self.bn(self.conv2(x)))  # (B, 16, 4, 7)
        x = torch.tanh(self.conv3(x)).flatten(1)  # (B, 5·4·6)
        return self.head(torch.relu(self.bn1d(self.fc(x))))


@pytest.mark.parametrize("mode", ["materialise", "gather"])
@pytest.mark.parametrize("p", [40, 900, None])
def test_conv_geometries_both_paths(monkeypatch, mode, p):
    """Both forms reached through the cost model (not forced), on every Linear and Conv2d."""
    zero = dict.fromkeys(costs.COST_TERMS, 0.0)
    if mode == "gather":  # make the cost model pick the gathers everywhere
        monkeypatch.setitem(costs._COSTS, "cpu", {**zero, "mac": 1e9, "mem": 1e9, "pick": 1e9})
    else:  # materialise everywhere, one sample per tile
        monkeypatch.setitem(costs._COSTS, "cpu", {**zero, "term": 1e9, "store": 1e9})
        monkeypatch.setattr(costs, "DENSE_TILE_ELEMS", 1)
    torch.manual_seed(0)
    model = _randomise_bn(_Geometry()).to(F64)
    x = torch.randn(3, 4, 7, 5, dtype=F64)
    p = p or num_params(model)
    fused = _features(model, x, p, "fused", batch_size=2)
    vmap = _features(model, x, p, "vmap")
    _assert_close(fused, vmap, f"geometry model, {mode}, p={p}")


class _WithPReLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.act = nn.PReLU(5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc(x)))


class _Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(torch.tanh(self.fc(x)))))  # fc applied twice


@pytest.mark.parametrize(
    ("factory", "layer", "reason"),
    [(_WithPReLU, "PReLU", "no per-sample"), (_Shared, "Linear", "more than once")],
)
def test_unsupported_model_fallback_with_one_log_line(caplog, factory, layer, reason):
    torch.manual_seed(0)
    model = factory().to(F64)
    x = torch.randn(5, 6, dtype=F64)
    got = _features(model, x, 20, "fused")
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("hpcfl.entk")]
    assert len(lines) == 1, f"expected one log line, got {lines}"
    assert layer in lines[0] and reason in lines[0] and "vmap" in lines[0], lines[0]
    ref = _features(model, x, 20, "vmap")
    _assert_close(got, ref, "fallback result")
    caplog.clear()
    _assert_close(_features(model, x, 20, "auto"), ref, "second call (cached verdict)")
    assert len([r for r in caplog.records if r.name.startswith("hpcfl.entk")]) == 1, "one line per call"


def test_auto_is_fused_and_silent_on_supported_models(caplog):
    model = _model("mlp", (1, 28, 28))
    x = torch.randn(3, 1, 28, 28, dtype=F64)
    got = _features(model, x, 500, EntkMethod.AUTO)  # the autouse fixture checks the silence
    _assert_close(got, _features(model, x, 500, "vmap"), "auto vs vmap")


def test_features_scope_is_the_prefix_without_the_last_layer():
    model = _model("simplecnn", (1, 28, 28))
    x = torch.randn(2, 1, 28, 28, dtype=F64)
    total, feats = num_params(model, "all"), num_params(model, "features")
    assert total - feats == 128 * 10 + 10, "features scope must drop exactly the classifier"
    full = _features(model, x, total, "fused")
    scoped = _features(model, x, feats, "fused", params="features")
    _assert_close(scoped, full[:, :feats], "params='features' vs the prefix of the full eNTK")
    _assert_close(scoped, _features(model, x, feats, "vmap", params="features"), "features scope vmap")


def test_logit_batching_dtype_out_and_modes_restored():
    model = _model("resnet8", (3, 32, 32), norm="bn")
    model.train()
    stats = model.norm1.running_mean.clone()
    x = torch.randn(5, 3, 32, 32, dtype=F64)
    ref = _features(model, x, 3000, "vmap", logit=3)
    got = _features(model, x, 3000, "fused", logit=3, batch_size=2)
    _assert_close(got, ref, "logit 3, batches of 2")
    assert not torch.allclose(got, _features(model, x, 3000, "fused")), "logit had no effect"
    assert model.training and model.norm1.training, "training flags not restored"
    assert torch.equal(model.norm1.running_mean, stats), "running statistics changed"
    out = torch.full((5, 3000), float("nan"), dtype=torch.float16)
    half = entk_features(model, x, p=3000, seed=7, logit=3, out=out)
    assert half is out and half.dtype == torch.float16, "out= not used"
    torch.testing.assert_close(half.double(), ref, rtol=2e-3, atol=2e-3 * float(ref.abs().max()))


def test_mixed_training_flags_come_back_as_they_were(monkeypatch):
    """Only the modules in training mode are switched to eval and back: one already in eval stays
    in eval (a frozen BatchNorm), and a model in eval throughout is not touched at all."""
    model = _model("resnet8", (3, 32, 32), norm="bn")
    model.train()
    model.norm1.eval()
    x = torch.randn(3, 3, 32, 32, dtype=F64)
    ref = _features(model, x, 500, "vmap")
    assert model.training and not model.norm1.training, "vmap changed the flags"
    _assert_close(_features(model, x, 500, "fused"), ref, "fused with mixed flags")
    flags = {name: m.training for name, m in model.named_modules()}
    assert flags[""] and not flags["norm1"] and sum(flags.values()) == len(flags) - 1
    model.eval()
    setattr_calls = []
    original = nn.Module.__setattr__

    def counting(self, name, value):
        if name == "training":
            setattr_calls.append(self)
        original(self, name, value)

    monkeypatch.setattr(nn.Module, "__setattr__", counting)
    _assert_close(_features(model, x, 500, "fused"), ref, "fused in eval")
    monkeypatch.undo()
    assert not setattr_calls, f"{len(setattr_calls)} training flags set on a model already in eval"


def test_a_call_sets_up_once_for_all_its_batches(monkeypatch):
    """The fused path registers its forward hooks once per call, not once per batch, and vmap moves
    its index columns to the device once per call."""
    from hpcfl.entk import fused

    model = _model("simplecnn", (1, 28, 28))
    x = torch.randn(7, 1, 28, 28, dtype=F64)
    made = []
    real = fused._Capture

    def counted(*args, **kwargs):
        made.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused, "_Capture", counted)
    got = _features(model, x, 800, "fused", batch_size=2)
    assert len(made) == 1, f"{len(made)} hook sets for 4 batches"
    _assert_close(got, _features(model, x, 800, "vmap", batch_size=2), "fused vs vmap in batches of 2")


def test_off_the_cpu_only_the_planned_layers_are_hooked(monkeypatch):
    """The hooks that keep gradients channels-last serve the CPU's channels-last forward only; on a
    CUDA device (played on the CPU by the fake accelerator) every hook is a planned layer's."""
    from hpcfl.entk import fused
    from hpcfl.testing.fake_accelerator import fake_cuda

    made = []
    real = fused._Capture

    def counted(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(fused, "_Capture", counted)
    torch.manual_seed(0)
    model = build_model("simplecnn", (1, 28, 28), 10)
    planned = sum(1 for m in model.modules() if any(True for _ in m.parameters(recurse=False)))
    entk_features(model, torch.randn(3, 1, 28, 28), p=500, seed=0, method="fused")
    assert len(made[-1].handles) > planned, "the CPU forward keeps its channels-last hooks"
    with fake_cuda() as dev:
        model = model.to("cuda")
        z = entk_features(model, torch.randn(3, 1, 28, 28, device="cuda"), p=500, seed=0, method="fused")
        assert dev.is_accel(z)
    assert len(made[-1].handles) == planned, "a CUDA forward hooked more than its planned layers"


def test_bad_options_are_config_errors():
    model = _model("mlp", (1, 28, 28))
    x = torch.randn(2, 1, 28, 28, dtype=F64)
    with pytest.raises(ConfigError, match="method"):
        entk_features(model, x, p=10, seed=0, method="magic")
    with pytest.raises(ConfigError, match="scope"):
        entk_features(model, x, p=10, seed=0, params="head")
    with pytest.raises(ConfigError, match="p="):
        entk_features(model, x, p=10**9, seed=0)
    with pytest.raises(ConfigError, match="logit 10"):
        entk_features(model, x, p=10, seed=0, logit=10)
    with pytest.raises(ConfigError, match="batch_size"):
        entk_features(model, x, p=10, seed=0, batch_size=0)


def test_reinit_last_layer_is_reexported():
    assert reinit_last_layer is models_reinit


def test_bench_entk_writes_csv_json_png(tmp_path, capsys):
    """Smoke run of ``hpcfl bench entk`` (each method in its own subprocess)."""
    import json

    from hpcfl.cli.main import main

    out = tmp_path / "bench"
    args = ["bench", "entk", "--model", "mlp", "--p", "100", "--batch", "8", "--methods", "fused,loop"]
    args += ["--repeats", "1", "--loop-samples", "2", "--threads", "1", "--rounds", "1", "--out", str(out)]
    assert main(args) == 0
    report = json.loads((out / "entk_bench.json").read_text())
    rows = {r["method"]: r for r in report["results"]}
    assert set(rows) == {"plain", "fused", "loop"}
    assert all(r["status"] == "ok" and r["samples_per_s"] > 0 for r in rows.values()), rows
    assert (out / "entk_bench.csv").read_text().startswith("method,")
    # the machine and the thread count the figures were measured with (issue 66)
    assert report["machine"]["threads"] == 1 and report["machine"]["cores"] >= 1
    assert "cpu_vector_extensions" in (out / "entk_bench.csv").read_text().splitlines()[0]
    assert (out / "entk_bench.png").stat().st_size > 1000
    assert "fused_vs_plain" in capsys.readouterr().out


class _NeedsNCHW(nn.Module):
    """A conv net whose forward ``.view``s its conv output: impossible on channels-last strides."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).view(x.shape[0], -1))


def _plan_of(model: nn.Module):
    from hpcfl.entk import api

    (entry,) = api._PLANS[model].values()
    return entry[1]


def test_channels_last_forward_falls_back_to_the_models_own_format():
    torch.manual_seed(0)
    model = _NeedsNCHW().to(F64)
    x = torch.randn(4, 3, 5, 5, dtype=F64)
    got = _features(model, x, 60, "fused")
    assert _plan_of(model).channels_last is False  # the .view refused channels-last strides
    _assert_close(got, _features(model, x, 60, "vmap"), "NCHW fallback vs vmap")
    _assert_close(_features(model, x, 60, "fused"), got, "second call, NCHW from the start")


def test_fused_follows_in_place_weight_updates():
    """The channels-last weight copies are refreshed when a weight changes in place."""
    model = _model("simplecnn", (1, 28, 28))
    x = torch.randn(3, 1, 28, 28, dtype=F64, generator=torch.Generator().manual_seed(5))
    before = _features(model, x, 5000, "fused")
    assert _plan_of(model).channels_last is True
    with torch.no_grad():
        model.conv2.weight.mul_(-1.5)  # what an optimizer step does: same storage, new version
    after = _features(model, x, 5000, "fused")
    _assert_close(after, _features(model, x, 5000, "vmap"), "after an in-place update")
    assert not torch.allclose(after, before)


@pytest.mark.parametrize("threads", [1, 3])
def test_fused_is_the_same_on_any_number_of_threads(threads):
    """The per-layer tasks run on ``torch.get_num_threads()`` threads; the result does not depend on it."""
    model = _model("resnet8", (3, 32, 32), norm="bn")
    x = torch.randn(5, 3, 32, 32, dtype=F64, generator=torch.Generator().manual_seed(6))
    ref = _features(model, x, 20_000, "vmap")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _features(model, x, 20_000, "fused")
    finally:
        torch.set_num_threads(before)
    assert torch.get_num_threads() == before
    _assert_close(got, ref, f"fused on {threads} threads")


def test_run_tasks_runs_every_task_and_reraises_the_first_error():
    from hpcfl.entk.tasks import run_tasks

    def bad() -> None:
        raise ValueError("task failed")

    for workers in (1, 2, 4):
        done: list[int] = []
        tasks = [lambda i=i, done=done: done.append(i) for i in range(10)]
        before = torch.get_num_threads()
        run_tasks(tasks, workers)
        assert sorted(done) == list(range(10))
        done.clear()
        with pytest.raises(ValueError, match="task failed"):
            run_tasks([bad, *tasks], workers)
        assert sorted(done) == list(range(10)), "the other tasks still ran"
        assert torch.get_num_threads() == before


def test_vmap_in_several_chunks_equals_the_loop(monkeypatch):
    """A block bound smaller than one batch's per-sample gradients splits vmap into chunks."""
    import hpcfl.entk.reference as reference

    model = _model("mlp", (1, 6, 6))
    x = torch.randn(7, 1, 6, 6, dtype=F64, generator=torch.Generator().manual_seed(3))
    p = num_params(model) // 3
    largest = max(t.numel() * t.element_size() for t in model.parameters())
    monkeypatch.setattr(reference, "VMAP_BLOCK_BYTES", 3 * largest)  # chunks of 3, 3 and 1 samples
    got = entk_features(model, x, p=p, seed=4, method="vmap")
    ref = entk_features(model, x, p=p, seed=4, method="loop")
    _assert_close(got, ref, "vmap in chunks vs loop")


def test_bench_entk_keeps_every_coordinate_when_p_exceeds_the_model_and_takes_norm(tmp_path, capsys):
    """``--p`` above P keeps all P coordinates (said, recorded) instead of failing every method (the
    H200 session's resnet8 at p = 1e5 > 78,042); ``--norm gn`` builds the GroupNorm ResNet Opacus
    accepts; ``--norm`` on a model without that option is one line, exit 2."""
    import json

    from hpcfl.cli.main import main
    from hpcfl.entk import num_params
    from hpcfl.models import build_model

    out = tmp_path / "bench"
    args = ["bench", "entk", "--model", "resnet8", "--norm", "gn", "--p", "10000000", "--batch", "2"]
    args += ["--methods", "fused", "--repeats", "1", "--threads", "1", "--rounds", "1", "--out", str(out)]
    assert main(args) == 0
    total = num_params(build_model("resnet8", (3, 32, 32), 10, norm="gn"))
    assert "every coordinate kept (p = " + f"{total:,})" in capsys.readouterr().out
    report = json.loads((out / "entk_bench.json").read_text())
    assert report["config"]["p"] == total and report["config"]["p_requested"] == 10_000_000
    assert report["config"]["norm"] == "gn"
    assert all(r["status"] == "ok" for r in report["results"]), report["results"]
    assert main(["bench", "entk", "--model", "mlp", "--norm", "gn", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hpcfl: error: --norm applies to resnet8 and resnet18, not mlp"], err


def test_bench_entk_in_process_times_every_method_here_and_refuses_environment_options(tmp_path, capsys):
    """``--in-process``: the same rows without a process per method (what a GPU session uses to
    save a CUDA start-up per method and round); the options that set a fresh process's environment
    are refused with one line."""
    import json

    from hpcfl.cli.main import main

    out = tmp_path / "bench"
    args = ["bench", "entk", "--model", "mlp", "--p", "100", "--batch", "8", "--methods", "fused,vmap"]
    args += ["--repeats", "1", "--threads", "1", "--rounds", "2", "--in-process", "--out", str(out)]
    assert main(args) == 0
    report = json.loads((out / "entk_bench.json").read_text())
    assert report["config"]["in_process"] is True
    rows = {r["method"]: r for r in report["results"]}
    assert set(rows) == {"plain", "fused", "vmap"}
    assert all(r["status"] == "ok" and r["samples_per_s"] > 0 for r in rows.values()), rows
    capsys.readouterr()
    assert main([*args[:-2], "--out", str(tmp_path / "x"), "--keep-freed-memory"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not with --in-process" in err[0], err
