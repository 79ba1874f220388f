"""CUDA-graph replay of the fused eNTK batch (``cuda_graph=True`` / ``HPCFL_ENTK_CUDA_GRAPH=1``).

On the CPU (default suite): the option threads from :func:`hpcfl.entk.entk_features` to the fused
path and is a no-op there, bit for bit, said once; the environment variable is read; the
capture / replay / eager decision (:class:`hpcfl.entk.cuda_graph.BatchGraphs`) step by step;
``hpcfl bench entk --methods fused-graph`` is refused on the CPU; and what capture needs of the eager
batch, on a CUDA device played by the fake accelerator: no copies to the device and no host sync
outside the torch stand-ins of the Triton gathers.

On a GPU (``pytest -m gpu``, skipped without one, the conventions of ``tests/test_gpu.py``): replay
equals the eager fused path on simplecnn, resnet18-GN and vgg11 over several full batches and a
partial one; in-place weight updates are seen and replaced parameters recaptured; a model that
syncs with the host in its forward falls back with one warning and the eager result; the fused
batch has no host sync; autotuning never runs under capture.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import hpcfl.entk.cuda_graph as cg
from hpcfl.entk import entk_features, num_params, reinit_last_layer
from hpcfl.entk.cuda_graph import CUDA_GRAPH_ENV, BatchGraphs, cuda_graph_wanted
from hpcfl.models import build_model


def _float32_model(name: str, shape: tuple[int, int, int], **options) -> nn.Module:
    """float32, re-initialised head, randomised BatchNorm statistics (as tests/test_entk.py does)."""
    from tests.test_entk import _randomise_bn

    torch.manual_seed(0)
    model = build_model(name, shape, 10, **options)
    reinit_last_layer(model, seed=1)
    return _randomise_bn(model).float()


def _entk_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("hpcfl.entk")]


@pytest.fixture
def fresh_note(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The CPU no-op line is said once per process: start each test as a fresh process would."""
    monkeypatch.setattr(cg, "_CPU_NOTED", False)
    monkeypatch.delenv(CUDA_GRAPH_ENV, raising=False)
    caplog.set_level(logging.INFO, logger="hpcfl.entk")


# --------------------------------------------------------------------------- CPU


def test_on_the_cpu_cuda_graph_is_a_noop_bit_for_bit_said_once(fresh_note, caplog) -> None:
    """Two full batches and a partial one of resnet8-GN (conv, GroupNorm, Linear): the features with
    ``cuda_graph=True`` equal the run without, bit for bit; the fused path (not the API) says once
    per process that the option does nothing here."""
    model = _float32_model("resnet8", (3, 8, 8), norm="gn")
    x = torch.randn(10, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    p = num_params(model) // 4
    plain = entk_features(model, x, p=p, seed=7, method="fused", batch_size=4)
    assert _entk_lines(caplog) == []
    graphed = entk_features(model, x, p=p, seed=7, method="fused", batch_size=4, cuda_graph=True)
    assert torch.equal(graphed, plain)
    assert _entk_lines(caplog) == ["eNTK: CUDA-graph replay is a no-op on cpu; the fused path runs as usual"]
    again = entk_features(model, x, p=p, seed=7, batch_size=4, cuda_graph=True)  # method auto
    assert torch.equal(again, plain)
    assert len(_entk_lines(caplog)) == 1, "said once per process"


def test_vmap_and_loop_ignore_cuda_graph(fresh_note, caplog) -> None:
    model = _float32_model("mlp", (1, 4, 4))
    x = torch.randn(3, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    for method in ("vmap", "loop"):
        entk_features(model, x, p=20, seed=0, method=method, cuda_graph=True)
    assert _entk_lines(caplog) == [], "only the fused path takes the option"


def test_the_environment_variable_turns_it_on_unless_the_caller_says(
    fresh_note, caplog, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _float32_model("mlp", (1, 4, 4))
    x = torch.randn(3, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    monkeypatch.setenv(CUDA_GRAPH_ENV, "1")
    entk_features(model, x, p=20, seed=0, method="fused", cuda_graph=False)
    assert _entk_lines(caplog) == [], "an explicit False wins over the environment"
    entk_features(model, x, p=20, seed=0, method="fused")
    assert len(_entk_lines(caplog)) == 1 and "no-op on cpu" in _entk_lines(caplog)[0]
    for value, wanted in (("1", True), ("0", False), ("", False), ("no", False), ("yes", True)):
        monkeypatch.setenv(CUDA_GRAPH_ENV, value)
        assert cuda_graph_wanted(None) is wanted, value
        assert cuda_graph_wanted(False) is False and cuda_graph_wanted(True) is True
    monkeypatch.delenv(CUDA_GRAPH_ENV)
    assert cuda_graph_wanted(None) is False, "off by default"


class _Entry:
    """Stands in for a captured batch: the decision only reads its bindings."""

    def __init__(self, bindings: tuple[int, ...]) -> None:
        self.bindings = bindings


def _never() -> tuple[int, ...]:
    raise AssertionError("the addresses are read only when a graph exists")


def test_a_key_runs_eager_then_captures_then_replays() -> None:
    graphs, key = BatchGraphs(), ((8, 3, 32, 32), torch.float32, torch.float32, 0)
    assert graphs.action(key, full=True, current=_never) == "eager", "first batch: warm-up"
    graphs.warmed(key)
    assert graphs.action(key, full=False, current=_never) == "eager", "a partial batch never captures"
    assert graphs.action(key, full=True, current=_never) == "capture"
    graphs.captured(key, _Entry((1, 2)))
    assert graphs.action(key, full=True, current=lambda: (1, 2)) == "replay"
    other = ((8, 3, 32, 32), torch.float32, torch.float64, 0)
    assert graphs.action(other, full=True, current=_never) == "eager", "another key warms up on its own"


def test_a_replaced_parameter_drops_the_graph_and_captures_again() -> None:
    graphs, key = BatchGraphs(), ("k",)
    graphs.warmed(key)
    graphs.captured(key, _Entry((1, 2)))
    assert graphs.action(key, full=True, current=lambda: (1, 3)) == "capture"
    assert key not in graphs.graphs, "a graph reading freed memory is never replayed"


def test_a_failure_turns_replay_off_for_the_plan_with_one_warning(caplog) -> None:
    caplog.set_level(logging.INFO, logger="hpcfl.entk")
    graphs, key = BatchGraphs(), ("k",)
    graphs.warmed(key)
    graphs.captured(key, _Entry((1,)))
    graphs.fail("capture failed: RuntimeError: operation not permitted when stream is capturing")
    graphs.fail("another reason")
    assert graphs.action(key, full=True, current=_never) == "eager"
    assert graphs.graphs == {}
    lines = _entk_lines(caplog)
    assert lines == [
        "eNTK: CUDA-graph replay is off for this model (capture failed: RuntimeError: operation not "
        "permitted when stream is capturing); running the fused path eagerly"
    ]


def test_the_replay_check_tolerance_is_float32_rounding() -> None:
    assert cg.tolerance(torch.float32) == 1e-5
    assert cg.tolerance(torch.float64) == 1e-5
    assert cg.tolerance(torch.bfloat16) == 8 * torch.finfo(torch.bfloat16).eps


@pytest.mark.parametrize(
    ("name", "options"),
    [("simplecnn", {}), ("resnet8", {"norm": "gn"}), ("resnet8", {"norm": "bn"}), ("vgg11", {})],
    ids=["simplecnn", "resnet8-gn", "resnet8-bn", "vgg11"],
)
def test_on_a_played_cuda_device_the_fused_batch_syncs_only_in_the_torch_gathers(name, options) -> None:
    """Capturability, checked on the CPU: on the fake accelerator (a CUDA device played on the CPU,
    its Triton dispatchers on their torch stand-ins), a fused call with its plan cached copies
    nothing to the device and reads values back only inside ``triton_kernels``' torch gathers —
    the code the compiled gathers replace on a GPU. A sync in hpcfl's own fused batch (GroupNorm's
    ``repeat_interleave`` with tensor repeats was one) shows up here as a site under ``hpcfl/``."""
    from hpcfl.testing.fake_accelerator import fake_cuda

    with fake_cuda() as dev:
        torch.manual_seed(0)
        model = build_model(name, (3, 32, 32), 10, **options).to("cuda")
        x = torch.randn(4, 3, 32, 32, device="cuda")
        first = entk_features(model, x, p=3000, seed=0, method="fused", batch_size=2)
        dev.syncs.clear(), dev.sync_sites.clear(), dev.copies.clear(), dev.copy_sites.clear()
        again = entk_features(model, x, p=3000, seed=0, method="fused", batch_size=2)
        copies, syncs = dict(dev.copy_sites), dict(dev.sync_sites)
        assert dev.is_accel(again) and torch.equal(first, again)
    assert not copies, f"host-to-device copies in a cached call: {copies}"
    outside = [site for (_, site) in syncs if "/triton_kernels/" not in site]
    assert syncs and not outside, f"host syncs outside the torch gathers: {outside}"


def test_bench_refuses_fused_graph_on_the_cpu(tmp_path: Path, capsys) -> None:
    from hpcfl.cli.main import main

    args = ["bench", "entk", "--model", "mlp", "--methods", "fused,fused-graph", "--out", str(tmp_path / "b")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "hpcfl: error: --methods fused-graph needs --device cuda (a CUDA graph is a no-op on the CPU, "
        "where it is fused)"
    ], err
    assert not (tmp_path / "b").exists(), "nothing written"


def test_bench_gives_fused_graph_its_own_ratios() -> None:
    from hpcfl.bench.entk.report import acceptance

    def ok(rate: float) -> dict:
        return {"status": "ok", "samples_per_s": rate}

    rows = {"plain": ok(100.0), "fused": ok(40.0), "fused-graph": ok(60.0), "opacus": ok(30.0)}
    result = acceptance(rows, "cuda")
    assert result["fused_vs_best_other"]["ratio"] == pytest.approx(40 / 30)
    assert result["fused_graph_vs_best_other"]["ratio"] == pytest.approx(2.0)
    assert result["fused_graph_vs_best_other"]["best"] == "opacus"
    assert result["fused_graph_vs_plain"]["ratio"] == pytest.approx(0.6)
    assert "fused_graph_vs_plain" not in acceptance({**rows, "fused-graph": {"status": "failed"}}, "cuda")


# --------------------------------------------------------------------------- GPU

CUDA = torch.device("cuda")

GRAPH_CASES = [
    pytest.param("simplecnn", (1, 28, 28), {}, id="simplecnn"),
    pytest.param("resnet18", (3, 32, 32), {"norm": "gn"}, id="resnet18-gn"),
    pytest.param("vgg11", (3, 32, 32), {"batch_norm": False}, id="vgg11"),
]


@pytest.fixture
def _float32_convolutions(monkeypatch: pytest.MonkeyPatch) -> None:
    """True float32 convolutions and matmuls, as in tests/test_gpu.py."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def _plan_graphs(model: nn.Module) -> BatchGraphs:
    from hpcfl.entk import api

    (entry,) = api._PLANS[model].values()
    return entry[1].graphs


def _close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """float32 on both sides, same kernels: the replay may differ from eager only by the rounding of
    a non-deterministic kernel."""
    from tests.test_entk import _assert_close

    _assert_close(got.double().cpu(), ref.double().cpu(), what, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("name", "shape", "options"), GRAPH_CASES)
@pytest.mark.usefixtures("_float32_convolutions")
def test_graph_replay_equals_eager_over_full_and_partial_batches(
    name, shape, options, fresh_note, caplog
) -> None:
    model = _float32_model(name, shape, **options).to(CUDA)
    x = torch.randn(3 * 8 + 3, *shape, generator=torch.Generator().manual_seed(11))  # on the host
    p = min(20_000, num_params(model) // 3)
    kw = dict(p=p, seed=7, method="fused", batch_size=8)
    eager = entk_features(model, x, **kw, cuda_graph=False)
    graphed = entk_features(model, x, **kw, cuda_graph=True)  # eager, capture, replay, partial
    graphs = _plan_graphs(model)
    assert graphs.failed is None and len(graphs.graphs) == 1, (graphs.failed, list(graphs.graphs))
    _close(graphed, eager, f"{name}: first call (capture + replay) vs eager")
    again = entk_features(model, x.to(CUDA), **kw, cuda_graph=True)  # every full batch replays
    _close(again, eager, f"{name}: replay vs eager")
    staged = torch.empty(x.shape[0], p, dtype=torch.float64)  # out on the host: staged batch by batch
    entk_features(model, x, **kw, cuda_graph=True, out=staged, dtype=torch.float64)
    _close(staged, eager, f"{name}: replay into a float64 host buffer vs eager")
    assert _entk_lines(caplog) == [], "no fallback, no note"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.usefixtures("_float32_convolutions")
def test_replay_sees_in_place_updates_and_recaptures_replaced_parameters(fresh_note, caplog) -> None:
    model = _float32_model("simplecnn", (1, 28, 28)).to(CUDA)
    x = torch.randn(16, 1, 28, 28, device=CUDA, generator=torch.Generator(CUDA).manual_seed(2))
    kw = dict(p=5_000, seed=7, method="fused", batch_size=4)
    entk_features(model, x, **kw, cuda_graph=True)
    graphs = _plan_graphs(model)
    (key,) = graphs.graphs
    with torch.no_grad():
        for t in model.parameters():
            t.mul_(1.5)  # an optimiser step: same addresses
    _close(
        entk_features(model, x, **kw, cuda_graph=True), entk_features(model, x, **kw), "after in-place update"
    )
    first = graphs.graphs[key]
    head = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    head.weight = nn.Parameter(head.weight.detach().clone() * 0.5)  # a new tensor at a new address
    _close(
        entk_features(model, x, **kw, cuda_graph=True),
        entk_features(model, x, **kw),
        "after a replaced weight",
    )
    assert graphs.graphs[key] is not first, "recaptured for the new address"
    assert _entk_lines(caplog) == []


class _SyncsInForward(nn.Module):
    """simplecnn-like conv net whose forward reads a value back to the host (a host sync)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Linear(4 * 8 * 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        if h.abs().sum().item() < 0:  # never true; the .item() is the point
            h = -h
        return self.head(h.flatten(1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.usefixtures("_float32_convolutions")
def test_a_capture_failure_warns_once_and_gives_the_eager_result(fresh_note, caplog) -> None:
    torch.manual_seed(0)
    model = _SyncsInForward().to(CUDA)
    x = torch.randn(14, 1, 8, 8, device=CUDA, generator=torch.Generator(CUDA).manual_seed(4))
    kw = dict(p=100, seed=7, method="fused", batch_size=4)
    eager = entk_features(model, x, **kw)
    graphed = entk_features(model, x, **kw, cuda_graph=True)
    graphed_again = entk_features(model, x, **kw, cuda_graph=True)
    assert torch.equal(graphed, eager) and torch.equal(graphed_again, eager), "the eager path's own result"
    lines = _entk_lines(caplog)
    assert len(lines) == 1 and "CUDA-graph replay is off for this model (capture failed" in lines[0], lines
    assert _plan_graphs(model).failed is not None
    # the process goes on normally: the caller's stream is the default one, CUDA still works
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert float(torch.ones(3, device=CUDA).sum()) == 3.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_fused_batch_has_no_host_sync(fresh_note) -> None:
    """What capture needs of the eager path: with inputs and output on the device, a fused call
    (plan cached, kernels compiled) raises nothing under ``set_sync_debug_mode("error")``."""
    model = _float32_model("resnet18", (3, 32, 32), norm="gn").to(CUDA)
    x = torch.randn(8, 3, 32, 32, device=CUDA)
    out = torch.empty(8, 20_000, device=CUDA)
    kw = dict(p=20_000, seed=7, method="fused", batch_size=8, out=out)
    entk_features(model, x, **kw)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        entk_features(model, x, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.usefixtures("_float32_convolutions")
def test_autotune_never_runs_under_capture(fresh_note, caplog, monkeypatch: pytest.MonkeyPatch) -> None:
    """With HPCFL_TRITON_AUTOTUNE the eager batch tunes every shape before the capture (graph in use,
    equal to eager); timing a config while a stream captures is refused with one clear reason."""
    from triton_kernels import _triton

    if not _triton.HAS_TRITON:
        pytest.skip("needs Triton")
    monkeypatch.setattr(_triton, "AUTOTUNE", True)
    model = _float32_model("vgg11", (3, 32, 32), batch_norm=False).to(CUDA)
    x = torch.randn(3 * 4, 3, 32, 32, device=CUDA, generator=torch.Generator(CUDA).manual_seed(5))
    kw = dict(p=20_000, seed=7, method="fused", batch_size=4)
    eager = entk_features(model, x, **kw, cuda_graph=False)
    graphed = entk_features(model, x, **kw, cuda_graph=True)
    assert _plan_graphs(model).failed is None and _plan_graphs(model).graphs
    _close(graphed, eager, "autotuned gathers: replay vs eager")
    assert _entk_lines(caplog) == []
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    scratch = torch.zeros(4, device=CUDA)
    with pytest.raises(RuntimeError, match="Triton autotune would time kernels during CUDA-graph capture"):
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            scratch.add_(1)
            _triton.bench_config(lambda: None)
