"""TCT's stage 2 and the run's device, as far as a CPU can check it: ``hpcfl tct-stage2`` re-solves
the stage 2 of a run made with ``device: cuda`` on a machine without a GPU when asked to
(``--set device=cpu``), and says how when not asked. (The CUDA-vs-CPU equality of both stages and
of the stage-2 solvers is in ``tests/test_gpu.py``.)"""

from __future__ import annotations

import json

import pytest
import torch

from hpcfl.cli.main import main
from hpcfl.runner import run_experiment
from tests.test_tct import _tct_config


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_tct_stage2_re_solves_a_cuda_run_on_the_cpu(tmp_path, capsys):
    cfg = _tct_config(
        tmp_path, stage1={"rounds": 1}, stage2={"p": 200, "rounds": 2, "local_steps": 10, "auto_lr": True}
    )
    run = tmp_path / "run"
    run_experiment(cfg, run)
    saved = run / "config.yaml"
    saved.write_text(saved.read_text().replace("device: cpu", "device: cuda"))  # as a GPU run saves it
    assert "device: cuda" in saved.read_text()
    if not torch.cuda.is_available():
        assert main(["tct-stage2", str(run)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "no CUDA GPU is visible" in err[0] and "--set device=cpu" in err[0], err
    assert main(["tct-stage2", str(run), "--set", "device=cpu", "stage2.local_steps=10"]) == 0
    redo = _rows(run / "stage2" / "device=cpu,local_steps=10" / "metrics.jsonl")
    first = [r for r in _rows(run / "metrics.jsonl") if r["stage"] == "stage2"]
    assert [r["test_accuracy"] for r in redo] == [r["test_accuracy"] for r in first]  # same device: same bits
    assert [r["train_loss"] for r in redo] == [r["train_loss"] for r in first]


def test_tct_stage2_still_refuses_keys_outside_stage2_and_device(tmp_path, capsys):
    saved = tmp_path / "config.yaml"
    saved.write_text("algorithm: tct\n")
    assert main(["tct-stage2", str(tmp_path), "--set", "lr=0.1"]) == 2
    err = capsys.readouterr().err
    assert "changes only stage2.* keys and device, not lr" in err


def test_tct_stage2_runs_on_the_runs_device_under_a_fake_cuda(tmp_path):
    """``device: cuda`` on a CPU through the fake accelerator (hpcfl.testing.fake_accelerator): no
    device mix anywhere in either stage, stage 2's state (and so its problems and solvers) is on the
    run's device rather than silently on the host, and the result is the CPU run's, bit for bit."""
    fake = pytest.importorskip("hpcfl.testing.fake_accelerator")
    keys = dict(stage1={"rounds": 1}, stage2={"p": 200, "rounds": 2, "local_steps": 10, "auto_lr": True})
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cuda").mkdir()
    ref = run_experiment(_tct_config(tmp_path / "cpu", device="cpu", **keys), tmp_path / "cpu" / "run")
    with fake.fake_cuda() as dev:
        got = run_experiment(_tct_config(tmp_path / "cuda", device="cuda", **keys), tmp_path / "cuda" / "run")
        assert dev.is_accel(got.server.x), "stage 2 ran on the host in a device: cuda run"
    assert torch.equal(got.server.x, ref.server.x)
    assert [r["test_accuracy"] for r in got.metrics] == [r["test_accuracy"] for r in ref.metrics]
