"""``hpcfl partition`` end to end: real Fashion-MNIST through ``python -m hpcfl``, and its errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcfl.cli.main import build_parser, main
from hpcfl.data import DATASETS, load_partition

REPO = Path(__file__).resolve().parents[1]


def _hpcfl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(cwd / ".cache")}
    return subprocess.run(
        [sys.executable, "-m", "hpcfl", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_partition_fashion_mnist_writes_json_and_png(data_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _hpcfl(
        "partition", "--dataset", "fashion-mnist", "--partition", "dir:0.5", "--num-clients", "10",
        "--seed", "3", "--data-root", str(data_root), "--out", str(out), "--no-download",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[0] == "client" and lines[0].split()[-1] == "total"
    assert lines[11].split()[0] == "all" and lines[11].split()[-1] == "60000"
    saved = load_partition(out / "partition.json")
    assert saved.spec == "dir:0.5" and saved.seed == 3 and len(saved.parts) == 10
    assert int(saved.counts.sum()) == 60000 and saved.dataset == "fashion-mnist"
    assert (out / "partition.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_spec_exits_2_with_one_line(tmp_path: Path) -> None:
    proc = _hpcfl(
        "partition",
        "--dataset",
        "fmnist",
        "--partition",
        "dirichlet:0.5",
        "--num-clients",
        "10",
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("hpcfl: error: unknown partition kind 'dirichlet'")


def test_default_out_dir_and_synthetic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert (
        main(["partition", "--dataset", "synthetic", "--partition", "classes:2", "--num-clients", "5"]) == 0
    )
    saved = load_partition(tmp_path / "partition_synthetic_classes-2")
    assert ((saved.counts > 0).sum(axis=1) == 2).all()
    assert (tmp_path / "partition_synthetic_classes-2" / "partition.png").is_file()
    assert "classes per client 2..2" in capsys.readouterr().out


def test_user_errors_are_one_line(tmp_path: Path, capsys) -> None:
    argv = ["partition", "--dataset", "mnist", "--partition", "iid", "--num-clients", "4"]
    assert main([*argv, "--data-root", str(tmp_path), "--no-download"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "HPCFL_DATA" in err and "train-images-idx3-ubyte.gz" in err
    assert main(["partition", "--dataset", "cifar", "--partition", "iid", "--num-clients", "4"]) == 2
    assert "unknown dataset 'cifar'" in capsys.readouterr().err
    assert main(["partition", "--dataset", "synthetic", "--partition", "natural", "--num-clients", "4"]) == 2
    assert "needs a dataset with writers" in capsys.readouterr().err


def test_help_lists_every_dataset() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    help_text = sub.choices["partition"].format_help()
    for name in DATASETS:
        assert name in help_text
    assert "dir:ALPHA" in help_text and "classes:C" in help_text and "balanced-classes:C" in help_text
