"""Commands that only read files stay light: ``hpcfl status`` and ``hpcfl report`` import neither
torch nor zarr (issue 27 item 5), and the lazy package surface keeps every public name."""

from __future__ import annotations

import json
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


#: ``python -c`` body: hpcfl's command with submitit unimportable (as without the slurm extra)
_NO_SUBMITIT = "import sys\nsys.modules['submitit'] = None\nfrom hpcfl.cli.main import main\nsys.exit(main(sys.argv[1:]))"


def _status(*args: str, submitit: bool) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-c", _NO_SUBMITIT] if not submitit else [sys.executable, "-m", "hpcfl"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([*argv, "status", *args], capture_output=True, text=True, env=env, timeout=120)


def test_status_of_local_runs_and_sweeps_needs_no_slurm_extra(finished_run: Path, tmp_path: Path) -> None:
    """Issue 45 item 3: with submitit unimportable, ``hpcfl status`` of a local run and of a sweep
    prints what it prints with submitit; only a submitted job's record asks for the extra, in one line."""
    from hpcfl.launch.records import JOBS_FILE, SLURM_DIR
    from hpcfl.sweep.grid import parse_grid_arg
    from hpcfl.sweep.plan import plan_sweep

    cfg = synthetic_config(tmp_path, rounds=1, dataset_options={"n_train": 200, "n_test": 50, "seed": 3})
    plan_sweep(cfg, [], None, [parse_grid_arg("lr=0.05,0.1")], tmp_path / "sweep", name="s").write()
    for target, says in ((finished_run, "FINISHED"), (tmp_path / "sweep", "not started")):
        blocked, reference = _status(str(target), submitit=False), _status(str(target), submitit=True)
        assert blocked.returncode == reference.returncode == 0, blocked.stderr[-2000:]
        assert blocked.stdout == reference.stdout and says in blocked.stdout, blocked.stdout

    submitted = tmp_path / "submitted"
    (submitted / SLURM_DIR).mkdir(parents=True)
    (submitted / "config.yaml").write_text((finished_run / "config.yaml").read_text())
    record = dict(
        job_id="123",
        executor="local",
        folder=str(submitted / SLURM_DIR),
        submitted="now",
        ranks=1,
        nodes=1,
        partition=None,
        command="hpcfl run",
    )
    (submitted / SLURM_DIR / JOBS_FILE).write_text(json.dumps(record) + "\n")
    proc = _status(str(submitted), submitit=False)
    assert proc.returncode != 0 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "hpcfl: error: hpcfl status of the submitted job 123 needs submitit, the slurm extra: "
        "pip install 'hpcfl[slurm]'"
    ]
