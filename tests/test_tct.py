"""TCT end to end: resume inside and across stages, MPI standardisation, tct-stage2, real data."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hpcfl.cli.main import main
from hpcfl.config import load_config
from hpcfl.runner import StopRequest, run_experiment
from tests.helpers import MPIEXEC, REPO, run_mpi_program, synthetic_config


class StopAfter(StopRequest):
    """Asks the run to stop after ``n`` rounds of this invocation (a deterministic preemption)."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    @property
    def requested(self) -> bool:  # read once per round by the runner
        self.calls += 1
        return self.calls >= self.n

    def stop_now(self) -> bool:  # counts rounds only: never stops inside the extraction
        return False


def _tct_config(tmp_path, **overrides):
    keys = dict(
        algorithm="tct",
        partition="classes:2",
        num_clients=5,
        stage1={"rounds": 2},
        stage2={"p": 300, "rounds": 3, "local_steps": 20, "auto_lr": True},
    )
    keys.update(overrides)
    return load_config(synthetic_config(tmp_path, **keys))


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("stop_after", [1, 3])  # inside stage 1; inside stage 2
def test_resume_inside_and_across_stages_is_bit_identical(tmp_path, stop_after):
    cfg = _tct_config(tmp_path)
    ref = run_experiment(cfg, tmp_path / "ref")
    assert [r["stage"] for r in ref.metrics] == ["stage1", "stage1", "stage2", "stage2", "stage2"]
    run = tmp_path / "cut"
    first = run_experiment(cfg, run, stop=StopAfter(stop_after))
    assert not first.finished and first.rounds_done == stop_after
    second = run_experiment(cfg, run, resume=True)
    assert second.finished
    assert torch.equal(second.server.x, ref.server.x)
    assert [r["test_accuracy"] for r in _rows(run)] == [r["test_accuracy"] for r in ref.metrics]


def test_tct_stage2_rerun_reuses_features_and_refuses_feature_changes(tmp_path, capsys):
    cfg = _tct_config(tmp_path)
    run = tmp_path / "tct"
    run_experiment(cfg, run)
    mtime = (run / "features.zarr" / "zarr.json").stat().st_mtime_ns
    assert main(["tct-stage2", str(run), "--set", "stage2.local_steps=5", "stage2.variant=gd"]) == 0
    out = run / "stage2" / "local_steps=5,variant=gd" / "metrics.jsonl"
    assert len(out.read_text().splitlines()) == 3
    assert (run / "features.zarr" / "zarr.json").stat().st_mtime_ns == mtime  # not recomputed
    capsys.readouterr()
    assert main(["tct-stage2", str(run), "--set", "stage2.p=100"]) == 2
    assert "changes the features" in capsys.readouterr().err
    assert main(["tct-stage2", str(run), "--set", "stage2.head=keep"]) == 2
    assert "changes the features" in capsys.readouterr().err


def test_diverging_stage2_learning_rate_is_refused_before_any_round(tmp_path, capsys):
    cfg_path = synthetic_config(
        tmp_path,
        algorithm="tct",
        partition="classes:2",
        num_clients=5,
        stage1={"rounds": 1},
        stage2={"p": 300, "rounds": 3, "local_steps": 20, "lr": 1000.0},
    )
    assert main(["run", str(cfg_path), "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "diverges" in err and "use stage2.lr <" in err and "Traceback" not in err
    assert all(r["stage"] == "stage1" for r in _rows(tmp_path / "r"))


def _dead_columns(model, x, p, seed=0, logit=0):
    """Which of the p kept eNTK columns are zero for every input in ``x`` → bool (p,)."""
    from hpcfl.entk import entk_features

    z = entk_features(model, x, p=p, seed=seed, logit=logit)  # (n, p)
    return (z == 0).all(dim=0)


def test_no_kept_entk_coordinate_is_structurally_zero():
    """Issue 16: stage 2 differentiates a fresh 1-output head, so no kept coordinate is a parameter
    that cannot reach the differentiated output (the kept C-output head left the C−1 other rows'
    weights and biases identically zero).

    Why this is the structural check: a column can also be zero because of the data (a ReLU unit off
    for every input). On the two-layer MLP at random init with 64 Gaussian images, a hidden unit is
    off for all 64 with probability about 2^-64 and no input pixel is ever zero, so a column that is
    zero for every input can only be one no input could make non-zero. With p = P every coordinate
    is kept, so this covers every parameter; the legacy ``head: keep`` form shows exactly the
    (C−1)·(hidden + 1) dead head columns the check is there to catch.
    """
    from hpcfl.algorithms.tct_params import Stage2Section
    from hpcfl.entk import coordinate_set, num_params
    from hpcfl.models import build_model, last_linear
    from hpcfl.tct.features import convexified_model, differentiated_output, feature_meta

    torch.manual_seed(0)
    model = build_model("mlp", (1, 28, 28), 10)
    x = torch.randn(64, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    fresh = convexified_model(model, Stage2Section())
    assert last_linear(fresh).out_features == 1 and last_linear(model).out_features == 10, "a copy"
    total = num_params(fresh)
    assert total == num_params(model) - 9 * 101
    assert feature_meta(fresh, Stage2Section(p=total)).head == "fresh1"
    dead = _dead_columns(fresh, x, total, logit=differentiated_output(Stage2Section()))
    assert not dead.any(), f"{int(dead.sum())} kept columns are zero for every input"

    keep = Stage2Section(head="keep", logit=3)
    legacy = convexified_model(model, keep)
    dead = _dead_columns(legacy, x, num_params(legacy), logit=differentiated_output(keep))
    head = last_linear(legacy)
    rows = torch.ones(10, dtype=torch.bool)
    rows[3] = False  # only row 3 reaches logit 3
    expected = torch.cat(
        [torch.zeros(num_params(legacy) - 1010, dtype=torch.bool), rows.repeat_interleave(100), rows]
    )
    assert head.weight.shape == (10, 100) and torch.equal(dead, expected)

    # TCT's SimpleCNN with subsampled coordinates, as stage 2 keeps them. Here ReLU units can be off
    # for every input, so a kept head column (weight j = hidden unit j's activation) may be zero from
    # the data: each zero head column must be exactly a hidden unit that is off for all inputs.
    cnn = build_model("simplecnn", (1, 28, 28), 10)
    fresh = convexified_model(cnn, Stage2Section())
    total, p = num_params(fresh), 20_000
    kept = coordinate_set(total, p, 0)
    in_head = kept >= total - 129  # the fresh head: 128 weights, then the bias
    dead = _dead_columns(fresh, x[:16], p)
    with torch.no_grad():
        off = torch.cat([(cnn.features(x[:16]) == 0).all(dim=0), torch.tensor([False])])  # (129,)
    assert in_head.sum() > 0
    assert torch.equal(dead[in_head], off[kept[in_head] - (total - 129)])


@pytest.mark.mpi
def test_federated_standardisation_over_two_mpi_ranks():
    run_mpi_program("standardize.py")


@pytest.mark.mpi
def test_tct_two_ranks_match_one_process(tmp_path):
    cfg_path = synthetic_config(
        tmp_path,
        algorithm="tct",
        partition="classes:2",
        num_clients=5,
        stage1={"rounds": 1},
        stage2={"p": 300, "rounds": 2, "local_steps": 20, "auto_lr": True},
    )
    local = run_experiment(load_config(cfg_path), tmp_path / "local")
    run = tmp_path / "mpi"
    proc = subprocess.run(
        [
            MPIEXEC,
            "-n",
            "2",
            sys.executable,
            "-m",
            "hpcfl",
            "run",
            str(cfg_path),
            "--run-dir",
            str(run),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    rows = _rows(run)

    # stage 2's moments and float64 round sums are added in client/draw order: the same bits on 2 ranks
    def accuracies(rows: list[dict]) -> list[tuple]:
        return [(r["round"], r["stage"], r["test_accuracy"], r.get("train_accuracy")) for r in rows]

    assert accuracies(rows) == accuracies(local.metrics)
    assert [r["stage"] for r in rows].count("stage2") == 2


def test_short_tct_on_fashion_mnist_classes1_beats_fedavg(data_root, tmp_path):
    """One FedAvg round is the shared stage-1 budget; TCT's stage 2 then lifts accuracy far above it."""
    cfg = load_config(
        None,
        [
            f"data_root={data_root}",
            "partition=classes:1",
            "algorithm=tct",
            "stage1.rounds=1",
            "lr=0.01",
            "stage2.p=500",
            "stage2.rounds=3",
            "stage2.local_steps=500",
            "stage2.auto_lr=true",
            "progress=false",
        ],
    )
    result = run_experiment(cfg, tmp_path / "tct")
    fedavg = [r for r in result.metrics if r["stage"] == "stage1"][-1]["test_accuracy"]
    tct = result.metrics[-1]["test_accuracy"]
    print(f"FMNIST classes:1 — FedAvg after stage 1: {fedavg:.4f}, TCT: {tct:.4f}")
    assert tct > fedavg + 0.25
