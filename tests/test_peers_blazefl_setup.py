"""benchmarks/peers/blazefl_setup.py compares like with like: both frameworks train the same two
modules (BlazeFL's CNN and torchvision's ResNet-18 layout, from blazefl_models.py, also as hpcfl
models), the table's ratio is hpcfl's samples/s over the peer's, and bad options are one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.helpers import REPO

PEERS = REPO / "benchmarks" / "peers"


def _module(name: str) -> ModuleType:
    sys.path.insert(0, str(PEERS))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(PEERS))


def test_models_are_blazefls_cnn_and_torchvisions_resnet18() -> None:
    bm = _module("blazefl_models")
    cnn, resnet = bm.build("cnn"), bm.build("resnet18")
    # BlazeFL's CNN (the PyTorch tutorial's) and torchvision's resnet18(num_classes=10): their counts
    assert sum(p.numel() for p in cnn.parameters()) == 62_006
    assert sum(p.numel() for p in resnet.parameters()) == 11_181_642
    keys = list(resnet.state_dict())
    assert len(keys) == 122  # torchvision's resnet18 state_dict: 122 entries, in this order
    assert keys[:6] == ["conv1.weight", "bn1.weight", "bn1.bias", "bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"]  # fmt: skip
    assert "layer2.0.downsample.1.running_var" in keys and "layer1.0.downsample.0.weight" not in keys
    assert keys[-2:] == ["fc.weight", "fc.bias"]
    x = torch.randn(3, 3, 32, 32)
    for model in (cnn, resnet):
        model.eval()
        logits, rep = model.forward_with_repr(x)
        assert logits.shape == (3, 10) and model.classifier.out_features == 10
        torch.testing.assert_close(model(x), logits)
        torch.testing.assert_close(model.classifier(rep), logits)


@pytest.mark.parametrize("model", ["cnn", "resnet18"])
def test_hpcfl_builds_the_very_module_blazefl_trains(model: str) -> None:
    """The name registered for hpcfl builds blazefl_models' module: same keys, same seeded weights."""
    bm = _module("blazefl_models")
    setup = _module("blazefl_setup")
    from hpcfl.models import build_model
    from hpcfl.registry import MODEL_SPECS, register_model

    name = setup.HPCFL_NAMES[model]
    if name not in MODEL_SPECS:
        register_model(name, lambda input_shape, num_classes, _m=model: bm.build(_m, num_classes))
    torch.manual_seed(3)
    ours = build_model(name, (3, 32, 32), 10)
    torch.manual_seed(3)
    theirs = bm.build(model)
    assert type(ours) is type(theirs)
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_table_ratio_is_hpcfl_over_the_peer_and_a_failure_is_one_row(tmp_path: Path) -> None:
    setup = _module("blazefl_setup")
    rows = [
        setup.summarise({"framework": "blazefl", "version": "3.0.0a1", "mode": "single-threaded",
                         "round_s": [9.0, 4.0], "samples_per_round": [400, 400]}, "cnn", 2),  # 100/s
        setup.summarise({"framework": "blazefl", "mode": "multi-process-2", "status": "failed",
                         "error": "RuntimeError: boom"}, "cnn", 2),
        setup.summarise({"framework": "hpcfl", "version": "0.1", "mode": "hpcfl run",
                         "round_s": [5.0, 2.0], "samples_per_round": [400, 400]}, "cnn", 2),  # 200/s
    ]  # fmt: skip
    meta = {
        "cpu": "test",
        "cores": 2,
        "load_before": "0",
        "load_after": "0",
        "rounds": 2,
        "clients": {"cnn": 2},
    }
    setup.write_outputs(tmp_path, meta, rows)
    md = (tmp_path / "blazefl_setup_cpu.md").read_text().splitlines()
    blaze = next(ln for ln in md if "| blazefl | 3.0.0a1 | single-threaded |" in ln)
    assert "| 4.0 | 100 | 2.00 | 43,000 |" in blaze  # s/round, samples/s, hpcfl / this, published
    hpcfl = next(ln for ln in md if "| hpcfl |" in ln)
    assert "| 2.0 | 200 | 1.00 |" in hpcfl
    assert any("multi-process-2" in ln and "failed: RuntimeError: boom" in ln for ln in md)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--clients", "vgg=3"], "--clients takes MODEL=N"),
        (["--clients", "cnn=0"], "--clients takes MODEL=N"),
        (["--rounds", "1"], "--rounds must be >= 2"),
        (
            ["--blazefl-python", "/nonexistent/python"],
            "peer 'blazefl' has no environment: run `bash benchmarks/peers/setup.sh blazefl`",
        ),  # fmt: skip
    ],
)
def test_bad_options_are_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(PEERS / "blazefl_setup.py"), *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert message in proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "blazefl_setup_cpu.md").exists()
