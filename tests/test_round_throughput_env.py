"""benchmarks/round_throughput.py starts its subprocesses with PYTHONPATH prepended to, not replaced
(issue 39: replacing it dropped the GPU image's /tmp/site, and the GPU run crashed)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers import REPO


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "round_throughput", REPO / "benchmarks" / "round_throughput.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_child_env_prepends_the_repository_to_pythonpath(bench: ModuleType) -> None:
    env = bench.child_env(3, {"PYTHONPATH": f"/tmp/site{os.pathsep}/opt/more", "OTHER": "kept"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/tmp/site", "/opt/more"]
    assert env["OMP_NUM_THREADS"] == "3" and env["OTHER"] == "kept"
    # none set: the repository alone (no empty entry, which would put the working directory on the path)
    assert bench.child_env(1, {})["PYTHONPATH"] == str(REPO)
    assert bench.child_env(1, {"PYTHONPATH": ""})["PYTHONPATH"] == str(REPO)


def test_a_dependency_on_pythonpath_stays_importable_in_the_child(bench: ModuleType, tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "only_on_pythonpath.py").write_text("VALUE = 39\n")
    env = bench.child_env(1, {**os.environ, "PYTHONPATH": str(site)})
    code = "import only_on_pythonpath, hpcfl; print(only_on_pythonpath.VALUE, hpcfl.__file__)"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    value, hpcfl_file = proc.stdout.split()
    assert value == "39" and Path(hpcfl_file).is_relative_to(REPO)


def test_every_subprocess_of_the_benchmark_gets_the_prepended_path(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The two places that start processes (the hpcfl runs and the allreduce probe) pass it on."""
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    seen: list[str] = []

    def fake_run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
        env = kw["env"]
        assert isinstance(env, dict)
        seen.append(env["PYTHONPATH"])
        if "--run-dir" in cmd:  # an hpcfl run: leave the metrics row it would write
            run_dir = Path(cmd[cmd.index("--run-dir") + 1])
            run_dir.mkdir(parents=True)
            row = {"compute_s": 1.0, "allreduce_s": 0.5, "eval_s": 0.5, "seconds": 2.0}
            (run_dir / "metrics.jsonl").write_text(json.dumps(row) + "\n")
            return subprocess.CompletedProcess(cmd, 0, "", "")
        return subprocess.CompletedProcess(cmd, 0, "{'float32': 1.0, 'float64': 2.0}\n", "")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    assert bench.hpcfl_run("/data", 2, 1, 1, tmp_path)["samples_per_s"] == 60000 / 1.5
    assert bench.allreduce_cost(10) == {"float32": 1.0, "float64": 2.0}
    assert seen == [f"{REPO}{os.pathsep}/tmp/site"] * 2
