"""``hpcfl bench entk`` per device (issue 39): vmap's chunk rule, and the best other method named per
device (on a GPU Opacus's fastest mode, not a vmap starved by a CPU-cache-sized chunk)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

import hpcfl.bench.entk as bench
import hpcfl.entk.reference as reference
from hpcfl.bench.entk import benchmark, runners
from hpcfl.entk import entk_features
from hpcfl.entk.reference import VMAP_GPU_COPIES, vmap_chunk, vmap_memory_budget
from hpcfl.models import build_model

RESNET18 = 11_173_962  # parameters of resnet18 with 10 classes (CIFAR shape)


def _sizes(model: torch.nn.Module) -> tuple[int, int, int]:
    params = list(model.parameters())
    return (
        sum(t.numel() for t in params),
        max(t.numel() * t.element_size() for t in params),
        params[0].element_size(),
    )


def test_on_the_host_the_chunk_stays_cache_sized() -> None:
    """No budget (the CPU): today's rule, so CPU figures do not move — simplecnn at batch 256 runs in
    chunks bounded by the 30 MiB block and the 2**26-element budget, as measured."""
    total, largest, elem = _sizes(build_model("simplecnn", (1, 28, 28), 10))
    expected = min(reference.VMAP_BUDGET_ELEMS // total, reference.VMAP_BLOCK_BYTES // largest)
    assert vmap_chunk(256, total, largest, elem, memory_budget=None) == expected < 256
    assert vmap_chunk(4, total, largest, elem, memory_budget=None) == 4  # never above the batch
    assert vmap_chunk(256, RESNET18, 10**9, 4, memory_budget=None) == 1  # never below one sample


def test_on_a_gpu_the_chunk_is_the_largest_that_fits_the_budget() -> None:
    total, largest, elem = _sizes(build_model("resnet18", (3, 32, 32), 10))
    assert total == RESNET18
    per_sample = VMAP_GPU_COPIES * total * elem
    budget = 10 << 30
    chunk = vmap_chunk(256, total, largest, elem, memory_budget=budget)
    assert chunk * per_sample <= budget < (chunk + 1) * per_sample
    # half an H200's free memory takes resnet18's whole batch; the host rule's 30 MiB block, 3 samples
    assert vmap_chunk(256, total, largest, elem, memory_budget=70 << 30) == 256
    assert vmap_chunk(256, total, largest, elem, memory_budget=None) == 3
    assert vmap_chunk(256, total, largest, elem, memory_budget=1) == 1


def test_the_gpu_budget_is_half_the_free_memory_and_none_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert vmap_memory_budget(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 << 30)
    # free to this process: the driver's free memory plus what PyTorch holds unallocated
    assert vmap_memory_budget(torch.device("cuda", 1)) == int(0.5 * (10 << 30))


def test_vmap_features_chunk_by_the_device_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget path is the one vmap_features takes: a budget that fits 3 samples gives chunks of
    3, 3 and 1, and the features still equal the loop's."""
    torch.manual_seed(0)
    model = build_model("mlp", (1, 6, 6), 3).double()
    total, _, elem = _sizes(model)
    chosen: list[int] = []
    rule = reference.vmap_chunk

    def spy(*args: int, memory_budget: int | None) -> int:
        chosen.append(rule(*args, memory_budget=memory_budget))
        return chosen[-1]

    budget = 3 * VMAP_GPU_COPIES * total * elem
    monkeypatch.setattr(reference, "vmap_memory_budget", lambda device: budget)
    monkeypatch.setattr(reference, "vmap_chunk", spy)
    x = torch.randn(7, 1, 6, 6, dtype=torch.float64)
    got = entk_features(model, x, p=total // 3, seed=4, method="vmap", dtype=torch.float64)
    ref = entk_features(model, x, p=total // 3, seed=4, method="loop", dtype=torch.float64)
    assert chosen == [3]
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_the_best_other_method_is_chosen_per_device() -> None:
    rates = {"plain": 900.0, "vmap": 500.0, "opacus": 300.0, "opacus-functorch": 350.0, "backpack": 100.0}
    assert bench.best_other(rates, "cpu") == "vmap"
    assert bench.best_other(rates, "cuda") == "opacus-functorch"  # vmap is not the GPU baseline
    assert bench.best_other({"vmap": 1.0, "backpack": 2.0}, "cuda") is None
    assert "opacus-functorch" in bench.DEFAULT_METHODS["cuda"]
    assert bench.DEFAULT_METHODS["cpu"] == "loop,vmap,fused,opacus,backpack"  # the CPU grid as before


@pytest.mark.parametrize("method", ["opacus", "opacus-functorch"])
def test_both_opacus_modes_give_the_features(method: str) -> None:
    """Each Opacus mode's runner fills the same (B, p) features as the reference loop."""
    pytest.importorskip("opacus")
    spec = {"seed": 0, "input_shape": [1, 6, 6], "device": "cpu", "model": "mlp"}
    spec.update(batch=4, p=50, method=method, loop_samples=4)
    run, samples, note, out = runners.make_runner(spec)
    run()
    torch.manual_seed(0)
    model = build_model("mlp", (1, 6, 6), 10)
    x = torch.randn(4, 1, 6, 6)
    ref = entk_features(model, x, p=50, seed=0, method="loop")
    assert samples == 4 and note.startswith(bench.OPACUS_MODES[method])
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-6)


def _fake_row(spec: dict) -> dict:
    rates = {"plain": 1000.0, "loop": 10.0, "vmap": 800.0, "fused": 600.0, "opacus": 300.0}
    rates.update({"opacus-functorch": 200.0, "backpack": 100.0})
    rate = rates[spec["method"]]
    return {
        "method": spec["method"],
        "status": "ok",
        "samples": 8,
        "seconds_best": 8 / rate,
        "seconds_median": 8 / rate,
        "samples_per_s": rate,
        "samples_per_s_median": rate,
        "peak_mb": 1.0,
        "threads": 1,
        "note": "",
    }


@pytest.mark.parametrize(
    ("device", "best", "label"),
    [
        ("cuda", "opacus", "best other on cuda: opacus (hooks) of opacus, opacus-functorch"),
        ("cpu", "vmap", "best other on cpu: vmap of vmap, opacus, backpack"),
    ],
)
def test_the_output_names_the_best_other_method_of_the_device(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    device: str,
    best: str,
    label: str,
) -> None:
    """With the same measured rates, fused is compared with vmap on the CPU and with Opacus's faster
    mode (named) on a GPU; the JSON and the printed line say which."""
    seen: list[str] = []
    monkeypatch.setattr(benchmark, "run_child", lambda spec: seen.append(spec["method"]) or _fake_row(spec))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--device", device, "--rounds", "1", "--out", str(tmp_path)])
    report = bench.run_benchmark(args)
    assert seen == ["plain", *bench.DEFAULT_METHODS[device].split(",")]
    item = report["acceptance"]["fused_vs_best_other"]
    assert item["best"] == best and item["device"] == device
    assert item["ratio"] == pytest.approx(600.0 / {"opacus": 300.0, "vmap": 800.0}[best])
    saved = json.loads((tmp_path / "entk_bench.json").read_text())
    assert saved["acceptance"]["fused_vs_best_other"]["best"] == best
    assert f"({label})" in capsys.readouterr().out
