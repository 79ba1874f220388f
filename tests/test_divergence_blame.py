"""A divergence or an exit names its cause (issue 44): a NaN model names the hyper-parameter that can
make it (FedAdam's server rate, FedDyn's α, the DP clip, a plugin's server step), not always the
learning rate; a ``sys.exit`` inside plugin code is one line, never a silent exit."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.helpers import REPO, hpcfl_cmd, synthetic_config

PLUGIN = """
import dataclasses
import sys

import torch

import hpcfl
from hpcfl.algorithms import FedAvg


@hpcfl.register_algorithm
class Faulty(FedAvg):
    name = "faulty_44"

    def server_update(self, server, aggregate, ctx):
        new, metrics = super().server_update(server, aggregate, ctx)
        {action}
        return new, metrics
"""


def _run_plugin(tmp_path: Path, action: str) -> subprocess.CompletedProcess:
    (tmp_path / "faulty_44.py").write_text(textwrap.dedent(PLUGIN).replace("{action}", action))
    cfg = synthetic_config(tmp_path, algorithm="faulty_44", imports=["faulty_44"], rounds=2)
    return subprocess.run(
        hpcfl_cmd("run", str(cfg), "--run-dir", str(tmp_path / "run")),
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert lines[0].startswith("hpcfl: error: "), proc.stderr
    return lines[0]


@pytest.mark.parametrize(("code", "rc"), [(3, 3), (0, 1)])
def test_sys_exit_inside_a_plugin_is_one_line_and_never_exit_0(tmp_path: Path, code: int, rc: int) -> None:
    """Issue 44: a plugin's ``sys.exit`` bypassed the error line (``sys.exit(0)`` mid-run even
    looked like success)."""
    proc = _run_plugin(tmp_path, f"sys.exit({code})")
    line = _one_line(proc)
    assert proc.returncode == rc
    assert f"sys.exit({code}) in {tmp_path / 'faulty_44.py'}:" in line and "the run did not finish" in line
    assert not (tmp_path / "run" / "DONE").exists()


def test_a_plugin_server_step_making_nan_is_named_not_the_learning_rate(tmp_path: Path) -> None:
    """Issue 44: the learning rate was blamed for a NaN a plugin's server step made."""
    proc = _run_plugin(tmp_path, "new = dataclasses.replace(new, x=torch.full_like(new.x, float('nan')))")
    line = _one_line(proc)
    assert proc.returncode not in (0, 75)
    assert line == (
        "hpcfl: error: the server step of round 1 (faulty_44) made the model NaN/inf from finite uploads; "
        "check the algorithm's server step"
    )


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (
            ["algorithm=fedadam", "params.server_lr=1e30"],
            "lower the learning rate (lr is 0.05), or params.server_lr (1e+30)",
        ),
        (["algorithm=feddyn", "params.alpha=1e30"], "lower the learning rate (lr is 0.05), or params.alpha (1e+30)"),
        # issue 51: a huge proximal or regulariser weight diverges the local steps as a huge lr does
        (["algorithm=ditto", "params.lam=1e6", "client_eval=0.2"], "lower the learning rate (lr is 0.05), or params.lam (1e+06)"),
        (["algorithm=fedprox", "params.mu=1e6"], "lower the learning rate (lr is 0.05), or params.mu (1e+06)"),
        (
            ["algorithm=feduv", "params.variance_weight=1e30", "params.uniformity_weight=1e30"],
            "or params.variance_weight (1e+30), params.uniformity_weight (1e+30)",
        ),
        (
            ["algorithm=fedavg", "clients_per_round=2", "privacy.level=client", "privacy.noise_multiplier=1",
             "privacy.clip=1e38"],
            "the server step of round 1 (fedavg) made the model NaN/inf from finite uploads; lower privacy.clip (1e+38)",
        ),
    ],
)  # fmt: skip
def test_a_nan_model_names_the_hyper_parameter_that_can_make_it(tmp_path: Path, capsys, sets, words) -> None:
    """Issue 44: "lower the learning rate" for a NaN made by FedAdam's server rate, FedDyn's α or
    the DP clip; now the message names them (the clip alone when the server step made the NaN), and
    (issue 51) Ditto's λ, FedProx's μ and FedUV's weights."""
    from hpcfl.cli.main import main

    if "privacy.level=client" in sets:
        pytest.importorskip("opacus")
    cfg = synthetic_config(tmp_path, rounds=3, lr=0.05, momentum=0.0)
    code = main(["run", str(cfg), "--run-dir", str(tmp_path / "run"), "--set", *sets])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code not in (0, 75) and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("hpcfl: error: ") and words in lines[0], err
