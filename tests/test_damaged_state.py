"""Damaged state and resumes (issue 18, items 4, 7, 8): one line naming the damaged file and the
fix, a fallback to the older checkpoint when the newest is damaged, no row lost to a torn metrics
line, and a resume that refuses what it cannot check."""

from __future__ import annotations

import json
import os
import stat
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcfl.cli.main import main
from hpcfl.config import load_config
from hpcfl.errors import StoppedError
from hpcfl.features.store import verify_client
from hpcfl.report import summarise
from hpcfl.runner import StopRequest, run_experiment
from tests.helpers import final_state, one_line_error, synthetic_config, tiny_tct_config

_one_line_error = partial(one_line_error, code=2)  # every refusal here exits 2


def _rows(run_dir: Path) -> list[str]:
    return (run_dir / "metrics.jsonl").read_text().splitlines()


_tct = tiny_tct_config


# 4. damaged feature stores and checkpoints


@pytest.fixture(scope="module")
def tct_run(tmp_path_factory) -> tuple[Path, Path]:
    """A finished TCT run (config path, run directory), copied by each test that damages it."""
    base = tmp_path_factory.mktemp("tct")
    cfg = _tct(base)
    run = base / "run"
    assert main(["run", str(cfg), "--run-dir", str(run)]) == 0
    return cfg, run


def _copy(run: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(run, dest, symlinks=True)
    (dest / ".lock").unlink(missing_ok=True)
    return dest


def test_deleted_chunk_of_a_complete_store_gives_one_line(tct_run, tmp_path, capsys):
    _, src = tct_run
    run = _copy(src, tmp_path / "run")
    chunk = run / "features.zarr" / "client_2" / "c" / "0" / "0"
    chunk.unlink()
    err = _one_line_error(capsys, ["tct-stage2", str(run)])
    assert err == (
        f"hpcfl: error: feature store {run / 'features.zarr'}: client 2 is damaged (chunk file {chunk} is "
        f"missing); delete {run / 'features.zarr' / 'client_2'} and resume with --resume to recompute it"
    )


def test_tct_stage2_applies_its_settings_to_a_saved_run(tct_run, tmp_path, capsys):
    """The saved config keeps stage 2 under ``params:``; the re-solve's --set must still win."""
    _, src = tct_run
    run = _copy(src, tmp_path / "run")
    assert (
        main(["tct-stage2", str(run), "--set", "stage2.rounds=3", "stage2.auto_lr=false", "stage2.lr=1e-4"])
        == 0
    )
    out = run / "stage2" / "auto_lr=False,lr=1e-4,rounds=3" / "metrics.jsonl"
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    stage2 = [r for r in rows if r.get("stage") == "stage2"]
    assert len(stage2) == 3 and all(r["stage2_lr"] == 1e-4 for r in stage2)


def test_flipped_bit_in_a_chunk_gives_one_line(tct_run, tmp_path, capsys):
    _, src = tct_run
    run = _copy(src, tmp_path / "run")
    chunk = run / "features.zarr" / "client_1" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x04
    chunk.write_bytes(bytes(data))
    err = _one_line_error(capsys, ["tct-stage2", str(run)])
    assert f"client 1 is damaged (chunk file {chunk} fails its checksum)" in err


@pytest.mark.parametrize("offset,bit", [(0, 0x01), (-1, 0x08)])  # another class; a huge label
def test_flipped_bit_in_the_labels_gives_one_line(tct_run, tmp_path, capsys, offset, bit):
    """Issue 44: the labels had no checksum; a flipped bit changed a label silently (stage 2 exit 0
    with another result) or ended in an IndexError. Now one line naming the labels file."""
    _, src = tct_run
    run = _copy(src, tmp_path / "run")
    chunk = run / "features.zarr" / "labels_1" / "c" / "0"
    data = bytearray(chunk.read_bytes())
    data[offset] ^= bit
    chunk.write_bytes(bytes(data))
    assert not verify_client(run / "features.zarr", 1) and verify_client(run / "features.zarr", 0)
    err = _one_line_error(capsys, ["tct-stage2", str(run)])
    assert err == (
        f"hpcfl: error: feature store {run / 'features.zarr'}: client 1 is damaged (labels file {chunk} "
        f"fails its checksum); delete {run / 'features.zarr' / 'client_1'} and resume with --resume to "
        "recompute it"
    )


def test_truncated_chunk_and_torn_metadata_give_one_line(tct_run, tmp_path, capsys):
    _, src = tct_run
    run = _copy(src, tmp_path / "a")
    chunk = run / "features.zarr" / "client_0" / "c" / "0" / "0"
    os.truncate(chunk, chunk.stat().st_size // 2)
    err = _one_line_error(capsys, ["tct-stage2", str(run)])
    assert f"chunk file {chunk} has {chunk.stat().st_size} bytes" in err
    run = _copy(src, tmp_path / "b")
    meta = run / "features.zarr" / "client_3" / "zarr.json"
    meta.write_text(meta.read_text()[:40])
    err = _one_line_error(capsys, ["tct-stage2", str(run)])
    assert f"{meta} is damaged" in err
    # issue 44: the advice was to delete the whole store; the client's array alone is recomputed
    assert err.endswith(f"delete {meta.parent} and resume with --resume to recompute that client"), err
    import shutil

    shutil.rmtree(meta.parent)
    assert main(["run", str(tct_run[0]), "--run-dir", str(run), "--resume"]) == 0
    assert all(verify_client(run / "features.zarr", k) for k in range(5))
    assert main(["tct-stage2", str(run)]) == 0
    run = _copy(src, tmp_path / "c")
    root = run / "features_test.zarr" / "zarr.json"
    root.write_text(root.read_text()[:30])
    err = _one_line_error(capsys, ["tct-stage2", str(run)])
    assert f"cannot open feature store {root.parent}" in err and "delete it and recompute" in err


class _StopInsideExtraction(StopRequest):
    """No signal between rounds; a stop request on the ``n``-th poll inside the extraction."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.polls = n, 0

    def stop_now(self) -> bool:
        self.polls += 1
        return self.polls >= self.n


def test_stop_inside_extraction_keeps_finished_clients_and_resume_recomputes_only_damage(
    tct_run, tmp_path, capsys
):
    cfg, src = tct_run
    run = tmp_path / "run"
    with pytest.raises(StoppedError, match="during the feature extraction"):
        run_experiment(load_config(cfg), run, stop=_StopInsideExtraction(5))  # 2 polls per client
    store = run / "features.zarr"
    done = [k for k in range(5) if verify_client(store, k)]
    assert done == [0, 1] and not (run / "DONE").exists()
    (store / "client_1" / "c" / "0" / "0").unlink()  # and a finished client damaged since
    before = {k: (store / f"client_{k}" / "zarr.json").stat().st_mtime_ns for k in done}
    assert main(["run", str(cfg), "--run-dir", str(run), "--resume"]) == 0
    assert (store / "client_0" / "zarr.json").stat().st_mtime_ns == before[0]  # kept
    assert (store / "client_1" / "zarr.json").stat().st_mtime_ns != before[1]  # recomputed
    assert torch.equal(final_state(run), final_state(src))


def test_truncated_stage1_model_gives_one_line(tct_run, tmp_path, capsys):
    _, src = tct_run
    run = _copy(src, tmp_path / "run")
    path = run / "stage1_model.pt"
    os.truncate(path, path.stat().st_size // 2)
    err = _one_line_error(capsys, ["tct-stage2", str(run)])
    assert err.startswith(f"hpcfl: error: {path} is damaged (")
    # issue 44: tct-stage2 advised --resume, whose run then advised --overwrite; both say --overwrite
    fix = "stage 2 cannot resume without it; rerun the run with --overwrite (stage 1 is trained again)"
    assert err.endswith(fix)
    cfg, _ = tct_run
    err = _one_line_error(capsys, ["run", str(cfg), "--run-dir", str(run), "--resume"])
    assert err.endswith(fix)
    assert main(["run", str(cfg), "--run-dir", str(run), "--overwrite"]) == 0
    assert main(["tct-stage2", str(run)]) == 0


@pytest.mark.parametrize("damage", ["truncate_server", "empty_client", "delete_client"])
def test_damaged_newest_checkpoint_falls_back_to_the_older_one(tmp_path, capsys, damage):
    cfg_path = synthetic_config(tmp_path, rounds=3)
    ref = run_experiment(load_config(cfg_path), tmp_path / "ref")
    run = tmp_path / "run"
    assert main(["run", str(cfg_path), "--run-dir", str(run), "--set", "rounds=2"]) == 0
    newest = run / "checkpoints" / "round_000002"
    if damage == "truncate_server":
        os.truncate(newest / "server.pt", (newest / "server.pt").stat().st_size // 2)
        what = "round_000002/server.pt is damaged (BadZipFile)"
    elif damage == "empty_client":
        (newest / "clients" / "client_1.pt").write_bytes(b"")
        what = "round_000002/clients/client_1.pt is damaged (BadZipFile)"
    else:
        (newest / "clients" / "client_1.pt").unlink()
        what = "round_000002/clients/client_1.pt is missing"
    capsys.readouterr()
    assert main(["run", str(cfg_path), "--run-dir", str(run), "--resume"]) == 0
    err = capsys.readouterr().err
    assert (
        f"hpcfl: note: the newest checkpoint is damaged ({what}); resuming from the older complete "
        "checkpoint round_000001"
    ) in err
    assert torch.equal(final_state(run), ref.server.x)
    rows = [json.loads(line) for line in _rows(run)]
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert [r["test_accuracy"] for r in rows] == [r["test_accuracy"] for r in ref.metrics]


def test_crash_between_latest_and_the_rename_is_rolled_forward(tmp_path, capsys):
    """A kill after LATEST names the new checkpoint but before its directory is renamed into
    place: the complete staged copy is taken and the resumed run equals an uninterrupted one."""
    cfg_path = synthetic_config(tmp_path, rounds=3)
    ref = run_experiment(load_config(cfg_path), tmp_path / "ref")
    run = tmp_path / "run"
    assert main(["run", str(cfg_path), "--run-dir", str(run), "--set", "rounds=2"]) == 0
    root = run / "checkpoints"
    assert (root / "LATEST").read_text().strip() == "round_000002"
    (root / "round_000002").rename(root / ".round_000002.tmp")  # the state the kill leaves
    capsys.readouterr()
    assert main(["run", str(cfg_path), "--run-dir", str(run), "--resume"]) == 0
    assert torch.equal(final_state(run), ref.server.x)
    assert [json.loads(line)["round"] for line in _rows(run)] == [1, 2, 3]


# 7. metrics.jsonl and resume


def test_torn_metrics_line_loses_no_other_row(tmp_path, capsys):
    cfg_path = synthetic_config(tmp_path, rounds=4)
    run = tmp_path / "run"
    assert main(["run", str(cfg_path), "--run-dir", str(run)]) == 0
    lines = _rows(run)
    (run / "metrics.jsonl").write_text("\n".join([lines[0], lines[1][:25], *lines[2:]]) + "\n")
    capsys.readouterr()
    summary = summarise(run)
    assert summary.rounds == 4 and summary.final_accuracy == json.loads(lines[3])["test_accuracy"]
    assert f"{run / 'metrics.jsonl'} line 2 is damaged and was skipped" in capsys.readouterr().err
    assert main(["run", str(cfg_path), "--run-dir", str(run), "--resume", "--set", "rounds=6"]) == 0
    now = _rows(run)
    assert now[:3] == [lines[0], lines[2], lines[3]]  # the intact rows 3-4 survive the resume
    assert [json.loads(line)["round"] for line in now] == [1, 3, 4, 5, 6]


def test_resume_without_config_or_latest_refuses(tmp_path, capsys):
    cfg_path = synthetic_config(tmp_path, rounds=2)
    run = tmp_path / "run"
    assert main(["run", str(cfg_path), "--run-dir", str(run), "--set", "rounds=1"]) == 0
    (run / "config.yaml").unlink()
    err = _one_line_error(
        capsys, ["run", str(cfg_path), "--run-dir", str(run), "--resume", "--set", "lr=0.02"]
    )
    assert err == (
        f"hpcfl: error: cannot resume {run}: its config.yaml is missing, so the config cannot be checked "
        "against the checkpoints; restore it or start over with --overwrite"
    )
    run2 = tmp_path / "run2"
    assert main(["run", str(cfg_path), "--run-dir", str(run2), "--set", "rounds=1"]) == 0
    (run2 / "checkpoints" / "LATEST").unlink()
    err = _one_line_error(capsys, ["run", str(cfg_path), "--run-dir", str(run2), "--resume"])
    assert err == (
        f"hpcfl: error: {run2 / 'checkpoints' / 'LATEST'} is missing although {run2 / 'checkpoints'} holds "
        f"checkpoints, so the newest complete one cannot be checked; if round_000001 is it, restore it "
        f"with: echo round_000001 > {run2 / 'checkpoints' / 'LATEST'}"
    )
    assert [json.loads(line)["round"] for line in _rows(run2)] == [1]  # nothing restarted


def test_resume_refuses_a_run_whose_partition_was_drawn_differently(tmp_path, capsys):
    """A run started by an hpcfl whose classes:C was round-robin (now balanced-classes:C) must not
    resume on the NIID-Bench split: simulated by writing the old layout into partition.json."""
    from hpcfl.data import load_partition, partition, save_partition

    cfg_path = synthetic_config(tmp_path, rounds=2, partition="classes:2", num_clients=5)
    run = tmp_path / "run"
    assert main(["run", str(cfg_path), "--run-dir", str(run), "--set", "rounds=1"]) == 0
    saved = load_partition(run)
    labels = torch.cat([torch.full((int(c),), k) for k, c in enumerate(saved.counts.sum(0))])
    old = partition(labels, "balanced-classes:2", 5, seed=7, num_classes=saved.counts.shape[1])
    save_partition(
        run, old, "classes:2", 7, np.stack([np.bincount(labels[p].numpy(), minlength=10) for p in old])
    )
    err = _one_line_error(capsys, ["run", str(cfg_path), "--run-dir", str(run), "--resume"])
    assert "now gives a different split from the run's partition.json" in err
    assert "balanced-classes:2" in err and "--overwrite" in err
    assert [json.loads(line)["round"] for line in _rows(run)] == [1]  # nothing trained


def test_resume_with_other_threads_says_it_is_not_bit_identical(tmp_path, capsys):
    cfg_path = synthetic_config(tmp_path, rounds=2)
    run = tmp_path / "run"
    assert main(["run", str(cfg_path), "--run-dir", str(run), "--set", "rounds=1"]) == 0
    capsys.readouterr()
    assert main(["run", str(cfg_path), "--run-dir", str(run), "--resume", "--set", "threads=2"]) == 0
    assert "not bit-identical" in capsys.readouterr().err


# 8. small ones


def test_failed_resume_of_a_finished_run_keeps_done(tmp_path, capsys):
    cfg_path = synthetic_config(tmp_path, rounds=2)
    run = tmp_path / "run"
    assert main(["run", str(cfg_path), "--run-dir", str(run)]) == 0
    for d in (run / "checkpoints").glob("round_*"):
        (d / "server.pt").write_bytes(b"")
    err = _one_line_error(
        capsys, ["run", str(cfg_path), "--run-dir", str(run), "--resume", "--set", "rounds=4"]
    )
    assert "no older complete checkpoint is sound" in err
    assert (run / "DONE").exists()


def test_non_finite_numbers_are_refused_up_front(tmp_path, capsys):
    cfg_path = synthetic_config(tmp_path)
    for bad in ("momentum=.nan", "lr=.inf", "stage2.lr=-.inf"):
        err = _one_line_error(capsys, ["run", str(cfg_path), "--run-dir", str(tmp_path / "r"), "--set", bad])
        assert "must be a finite number" in err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_run_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        run = tmp_path / "run"
        assert main(["run", str(synthetic_config(tmp_path, rounds=1)), "--run-dir", str(run)]) == 0
    finally:
        os.umask(old)
    for name in ("config.yaml", "metrics.jsonl", "DONE", "partition.json"):
        assert stat.S_IMODE((run / name).stat().st_mode) == 0o644, name


def test_resume_hint_keeps_the_set_overrides():
    import argparse

    from hpcfl.cli.run import resume_command

    args = argparse.Namespace(config="cfg.yaml", set=["lr=0.05", "name=a b"], data_root=None)
    assert resume_command(args, Path("runs/x")) == (
        "hpcfl run cfg.yaml --set lr=0.05 'name=a b' --run-dir runs/x --resume"
    )


def test_config_only_checks_come_before_any_data_is_read(tmp_path, capsys, monkeypatch):
    import hpcfl.runner.federation as federation

    def no_data(*args, **kwargs):
        raise AssertionError("data was read before the config was checked")

    monkeypatch.setattr(federation, "load_dataset", no_data)
    cfg = synthetic_config(tmp_path, dataset="fashion-mnist", dataset_options={}, algorithm="tct")
    run = str(tmp_path / "r")
    for override, fragment in (
        ("partition=classes:11", "asks for 11 classes per client but fashion-mnist has 10"),
        ("num_clients=60001", "num_clients=60001 is more than the 60000 training samples"),
        ("stage2.logit=10", "'stage2.logit' (10) applies only with stage2.head=keep"),
    ):
        assert fragment in _one_line_error(capsys, ["run", str(cfg), "--run-dir", run, "--set", override])
    err = _one_line_error(
        capsys, ["run", str(cfg), "--run-dir", run, "--set", "stage2.head=keep", "stage2.logit=10"]
    )
    assert "'stage2.logit' must be a class index in [0, 10)" in err
    monkeypatch.setenv("PMI_SIZE", "5")
    monkeypatch.setenv("PMI_RANK", "0")
    err = _one_line_error(capsys, ["run", str(cfg), "--run-dir", run, "--set", "num_clients=4"])
    assert "5 ranks but only 4 clients" in err


def test_tct_without_stage2_rounds_leaves_a_model_for_tct_stage2(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["run", str(_tct(tmp_path, rounds=0)), "--run-dir", str(run)]) == 0
    assert (run / "stage1_model.pt").exists()
    assert main(["tct-stage2", str(run), "--set", "stage2.rounds=1"]) == 0
