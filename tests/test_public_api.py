"""The public surface of ``hpcfl`` and the runs guide's Python example (docs/runs.md), executed as written."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

import hpcfl
from tests.helpers import REPO


def test_every_public_name_resolves_and_nothing_else_is_listed() -> None:
    missing = [name for name in hpcfl.__all__ if not hasattr(hpcfl, name)]
    assert missing == []
    assert {"run_experiment", "load_config", "Config", "ALGORITHMS", "load_dataset", "partition"} <= set(
        hpcfl.__all__
    )
    assert {"build_model", "LocalComm", "get_comm"} <= set(hpcfl.__all__)
    assert "fedavg" in hpcfl.ALGORITHMS and isinstance(hpcfl.get_comm("local"), hpcfl.LocalComm)


def _readme_example() -> str:
    text = (REPO / "docs/runs.md").read_text()
    section = text.split("\n## From Python\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the guide's 'From Python' section holds one python example"
    return blocks[0]


def test_readme_python_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_readme_example(), "docs/runs.md", "exec"), {"__name__": "__readme__"})
    first, second = out.getvalue().splitlines()
    assert re.fullmatch(r"round 2: test accuracy 0\.\d{3}", first), first
    assert "'fedavg'" in second and "'tct'" in second and second.endswith("] LocalComm")
    rows = [
        json.loads(line) for line in (tmp_path / "runs/api_example/metrics.jsonl").read_text().splitlines()
    ]
    assert rows[-1]["round"] == 2 and 0.0 < rows[-1]["test_accuracy"] <= 1.0


def test_readme_adding_an_algorithm_shows_the_real_file_and_its_one_line() -> None:
    text = (REPO / "docs/algorithms.md").read_text()
    section = text.split("\n## Adding an algorithm\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    (line,) = re.findall(r"```text\n(.*?)```", section, flags=re.S)
    assert code in (REPO / "hpcfl/algorithms/fedavgm.py").read_text()
    assert line in (REPO / "hpcfl/registry.py").read_text()
    assert "class FedAvgM(Algorithm" in code
