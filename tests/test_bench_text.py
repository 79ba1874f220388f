"""benchmarks/text_per_sample.py compares like with like: Opacus's copy of a text model (DPLSTM with
the LSTM's weights, contiguous Embedding indices) is the same function, hpcfl's clipped per-sample
sum equals both Opacus modes' and its eNTK features equal torch.func's; bad counts are one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.helpers import REPO


def _bench() -> ModuleType:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import text_per_sample
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return text_per_sample


@pytest.mark.parametrize("name", ["char-transformer", "char-lstm"])
def test_opacus_copy_is_the_same_model_and_the_work_is_the_same(name: str) -> None:
    bench = _bench()
    workload = bench.TextWorkload(seq_len=9, options=bench.TINY_OPTIONS)
    model, x, _ = workload(name, 5, "cpu", False)
    theirs, x2, _ = workload(name, 5, "cpu", True)
    assert torch.equal(x, x2)
    if name == "char-lstm":
        from opacus.layers import DPLSTM

        assert isinstance(theirs.lstm, DPLSTM) and isinstance(model.lstm, torch.nn.LSTM)
    # DPLSTM keeps nn.LSTM's names (in its own order): the same parameters, by name
    assert sorted(n for n, _ in theirs.named_parameters()) == sorted(n for n, _ in model.named_parameters())
    torch.testing.assert_close(theirs(x), model(x), rtol=1e-5, atol=1e-6)
    found = bench.check_same_work(workload, name, 5, "cpu", ["dp", "entk"])
    assert set(found["differences"]) == {
        "dp_opacus_hooks_norms",
        "dp_opacus_hooks",
        "dp_opacus_ghost",
        "entk_torch.func",
    }
    assert all(d <= bench.CLOSE for d in found["differences"].values()), found
    assert found["entk_path"] == ("fused" if name == "char-transformer" else "per-sample loop: no fused LSTM")


@pytest.mark.parametrize("option", ["--steps", "--batches"])
def test_a_zero_count_is_refused_in_one_line(tmp_path: Path, option: str) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "text_per_sample.py"),
            option,
            "0",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert f"{option} must be >= 1, got 0" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()
