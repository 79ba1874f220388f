"""End-to-end runs: resume after a kill, MPI ranks vs one process, the run directory's files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from hpcfl.config import load_config
from hpcfl.runner import run_experiment
from tests.helpers import (
    REPO,
    final_state,
    hpcfl_cmd,
    kill_after_rows,
    mpiexec_cmd,
    run_cli,
    synthetic_config,
)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_run_writes_the_run_directory(tmp_path):
    cfg = synthetic_config(tmp_path)
    proc = run_cli("run", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "run"
    for name in ("config.yaml", "metrics.jsonl", "partition.json", "partition.png", "DONE"):
        assert (run / name).exists(), name
    rows = _metrics(run)
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["test_accuracy"] > 0.5  # learnable synthetic data
    assert rows[0]["bytes_up"] > 0 and rows[0]["allreduce_s"] >= 0


def test_same_config_and_seed_give_identical_results(tmp_path):
    cfg = load_config(synthetic_config(tmp_path))
    a = run_experiment(cfg, tmp_path / "a")
    b = run_experiment(cfg, tmp_path / "b")
    assert torch.equal(a.server.x, b.server.x)
    assert a.metrics[-1]["test_accuracy"] == b.metrics[-1]["test_accuracy"]


def test_kill_and_resume_is_bit_identical(tmp_path):
    # big enough that a round takes a noticeable time, so the kill lands mid-run
    opts = dict(dataset_options={"n_train": 16000, "n_test": 400, "seed": 3}, rounds=6)
    cfg_path = synthetic_config(tmp_path, **opts)
    reference = run_experiment(load_config(cfg_path), tmp_path / "ref")

    run = tmp_path / "killed"
    kill_after_rows(cfg_path, run, 2)

    resumed = run_cli("run", str(cfg_path), "--run-dir", str(run), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert torch.equal(final_state(run), reference.server.x)
    assert [r["test_accuracy"] for r in _metrics(run)] == [r["test_accuracy"] for r in reference.metrics]


def test_sigusr1_checkpoints_and_exits_resumable(tmp_path):
    cfg_path = synthetic_config(
        tmp_path, dataset_options={"n_train": 16000, "n_test": 400, "seed": 3}, rounds=6
    )
    run = tmp_path / "pre"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        hpcfl_cmd("run", str(cfg_path), "--run-dir", str(run)), env=env, stderr=subprocess.PIPE, text=True
    )
    while not ((run / "metrics.jsonl").exists() and len(_metrics(run)) >= 1):
        time.sleep(0.02)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 75, err  # EX_TEMPFAIL: stopped cleanly, resumable
    assert "--resume" in err
    done = len(_metrics(run))
    assert done < 6 and (run / "checkpoints" / "LATEST").read_text().strip() == f"round_{done:06d}"


@pytest.mark.mpi
def test_two_mpi_ranks_match_one_process(tmp_path):
    cfg_path = synthetic_config(tmp_path, rounds=3)
    local = run_experiment(load_config(cfg_path), tmp_path / "local")
    run = tmp_path / "mpi"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        mpiexec_cmd(2, "run", str(cfg_path), "--run-dir", str(run)),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    torch.testing.assert_close(final_state(run), local.server.x, rtol=0, atol=1e-5)
    assert abs(_metrics(run)[-1]["test_accuracy"] - local.metrics[-1]["test_accuracy"]) < 1e-9


def test_fedavg_fashion_mnist_iid_passes_80_percent(data_root, tmp_path):
    cfg = load_config(
        None,
        [
            f"data_root={data_root}",
            "dataset=fashion-mnist",
            "partition=iid",
            "num_clients=10",
            "model=simplecnn",
            "rounds=2",
            "lr=0.05",
            "momentum=0.9",
            "batch_size=64",
            "progress=false",
        ],
    )
    t0 = time.perf_counter()
    result = run_experiment(cfg, tmp_path / "fm")
    print(f"FedAvg FMNIST IID: {result.metrics[-1]['test_accuracy']:.4f} in {time.perf_counter() - t0:.1f}s")
    assert result.metrics[-1]["test_accuracy"] > 0.80


def test_a_key_added_to_the_schema_later_reads_as_its_default_when_resuming():
    """A run directory saved before a config key existed stays resumable while the key keeps its
    default, and is another config once it does not."""
    from hpcfl.config import Config, config_differences

    saved = Config().to_dict()
    del saved["validation"]  # written by a version without the key
    assert config_differences(saved, Config().to_dict()) == []
    changed = Config().to_dict()
    changed["validation"] = 0.1
    assert config_differences(saved, changed) == ["validation"]
