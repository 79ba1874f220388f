"""Commands that only read files stay light: ``hpcfl status`` and ``hpcfl report`` import neither
torch nor zarr (issue 27 item 5), and the lazy package surface keeps every public name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, hpcfl_cmd, synthetic_config

HEAVY = ("torch", "zarr")


def _imported(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``python -X importtime ARGS``; the process and the top-level packages it imported."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    modules = {
        line.split("|")[2].strip().split(".")[0]
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }
    assert "hpcfl" in modules, proc.stderr[-2000:]
    return proc, modules


@pytest.mark.parametrize(
    "module", ["hpcfl", "hpcfl.cli.status", "hpcfl.cli.main", "hpcfl.launch.status", "hpcfl.sweep.status"]
)
def test_importing_the_status_path_imports_neither_torch_nor_zarr(module: str) -> None:
    _, modules = _imported("-c", f"import {module}")
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hpcfl import load_config, run_experiment

    tmp = tmp_path_factory.mktemp("light")
    cfg = synthetic_config(tmp, rounds=2, dataset_options={"n_train": 200, "n_test": 50, "seed": 3})
    return run_experiment(load_config(cfg), tmp / "run").run_dir


def test_hpcfl_status_of_a_real_run_reports_it_without_torch_or_zarr(finished_run: Path) -> None:
    proc, modules = _imported(*hpcfl_cmd("status", str(finished_run))[1:])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "FINISHED" in proc.stdout and "rounds   2/2" in proc.stdout, proc.stdout
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


def test_hpcfl_report_of_a_real_run_writes_it_without_torch_or_zarr(
    finished_run: Path, tmp_path: Path
) -> None:
    proc, modules = _imported(*hpcfl_cmd("report", str(finished_run), "--out", str(tmp_path / "rep"))[1:])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "rep" / "report.md").exists() and (tmp_path / "rep" / "accuracy.png").exists()
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


def test_lazy_names_resolve_to_the_objects_they_name_even_after_a_same_named_submodule_loads() -> None:
    """``hpcfl.data.partition`` is the function (as when the package imported eagerly), also when the
    module of the same name was imported first; every public name of the lazy packages resolves."""
    code = (
        "import importlib, hpcfl, hpcfl.data, hpcfl.comm, hpcfl.runner, hpcfl.sweep, hpcfl.launch, hpcfl.metrics\n"
        "import hpcfl.data.partition\n"
        "from hpcfl.data import partition\n"
        "module = importlib.import_module('hpcfl.data.partition')\n"
        "assert partition is module.partition and hpcfl.partition is partition, partition\n"
        "for pkg in (hpcfl, hpcfl.data, hpcfl.comm, hpcfl.runner, hpcfl.sweep, hpcfl.launch, hpcfl.metrics):\n"
        "    assert all(hasattr(pkg, n) for n in pkg.__all__), pkg\n"
        "    assert set(pkg.__all__) <= set(dir(pkg)), pkg\n"
        "from hpcfl.runner.experiment import run_experiment\n"
        "assert hpcfl.run_experiment is run_experiment\n"
        "try:\n"
        "    hpcfl.no_such_name\n"
        "except AttributeError as err:\n"
        "    assert 'no_such_name' in str(err)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
        "print('OK')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert proc.stdout.strip() == "OK", proc.stderr[-2000:]
