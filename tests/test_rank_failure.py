"""A rank that fails alone ends the whole MPI job with one line naming the rank and the cause.

Rank 1 of a 2-rank ``mpiexec`` job raises (a user error or a bug) or is killed by SIGKILL while
rank 0 waits in a collective; without the abort/guard the job would hang until the timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import MPIEXEC, REPO, mpiexec_cmd, synthetic_config

PROGRAM = REPO / "tests" / "mpi_programs" / "rank_fails.py"


def _run_two_ranks(mode: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("HPCFL_RANK_GUARD", None)
    cmd = [MPIEXEC, "-n", "2", sys.executable, str(PROGRAM), mode]
    # A hang would end in TimeoutExpired; the job itself ends in seconds.
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("hpcfl: error:")]


@pytest.mark.mpi
def test_user_error_on_one_rank_ends_the_job_with_one_line() -> None:
    proc = _run_two_ranks("user")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["hpcfl: error: rank 1: the scratch disk of this node is full"]


@pytest.mark.mpi
def test_bug_on_one_rank_ends_the_job_with_traceback_and_one_line() -> None:
    proc = _run_two_ranks("bug")
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" in proc.stderr
    assert _error_lines(proc.stderr) == [
        "hpcfl: error: rank 1: internal error: ZeroDivisionError: division by zero in a client update"
    ]
    assert proc.stderr.strip().splitlines()[-1] == _error_lines(proc.stderr)[0]


@pytest.mark.mpi
def test_rank_killed_by_sigkill_ends_the_job_with_one_line() -> None:
    proc = _run_two_ranks("kill")
    # Usually 137 (the guard's 128 + 9). Now and then MPICH's hydra reports the SIGKILL it sent to
    # a surviving guard instead (exit 9, plus its own banner on stdout); our line is there either way.
    assert proc.returncode in (128 + 9, 9), proc.stderr
    assert proc.stderr.strip().splitlines() == ["hpcfl: error: rank 1: killed by SIGKILL"]


@pytest.mark.mpi
def test_error_every_rank_hits_before_mpi_starts_is_said_once(tmp_path) -> None:
    cfg = synthetic_config(tmp_path, model="nope")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        mpiexec_cmd(2, "run", str(cfg), "--run-dir", str(tmp_path / "r")),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("hpcfl: error: unknown model 'nope'")
