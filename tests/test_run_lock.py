"""The run-directory lock: a second run (or submission) on a run directory in use is refused in one
line naming the holder, the first run's files are untouched, and a killed holder's lock is taken over."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from hpcfl.cli.main import main
from hpcfl.runner.lock import RunLock, lock_holder, read_holder
from tests.helpers import REPO, hpcfl_cmd, run_cli, synthetic_config

HOLD = "import sys, time; from hpcfl.runner.lock import RunLock; RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(300)"


def _hold(run_dir: Path) -> subprocess.Popen:
    """Another process holding the lock of ``run_dir`` (as a running ``hpcfl run`` does)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _refusal(pid: int, run_dir: Path) -> str:
    return (
        f"hpcfl: error: run directory {run_dir} is in use by another hpcfl run (host {socket.gethostname()}, "
        f"PID {pid}); wait for it to end, stop it, or choose another --run-dir"
    )


def test_second_run_on_a_locked_run_directory_is_refused_and_changes_nothing(tmp_path, capsys):
    cfg = synthetic_config(tmp_path, rounds=2)
    run = tmp_path / "run"
    assert main(["run", str(cfg), "--run-dir", str(run)]) == 0
    capsys.readouterr()
    holder = _hold(run)
    try:
        before = _snapshot(run)
        for extra in (["--resume"], ["--overwrite"], ["--resume", "--set", "rounds=4"]):
            code = main(["run", str(cfg), "--run-dir", str(run), *extra])
            err = capsys.readouterr().err.strip()
            assert code == 2 and err == _refusal(holder.pid, run), err
            assert _snapshot(run) == before
    finally:
        holder.kill()
        holder.wait()


def test_two_concurrent_runs_write_each_row_once(tmp_path, capsys):
    cfg = synthetic_config(tmp_path, rounds=3, dataset_options={"n_train": 16000, "n_test": 400, "seed": 3})
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(
        hpcfl_cmd("run", str(cfg), "--run-dir", str(run)), env=env, stderr=subprocess.PIPE
    )
    deadline = time.time() + 120
    while read_holder(run) is None and time.time() < deadline:
        time.sleep(0.02)
    code = main(["run", str(cfg), "--run-dir", str(run), "--resume"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == _refusal(first.pid, run), err
    assert first.wait(timeout=240) == 0
    rounds = [json.loads(line)["round"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2, 3]
    assert lock_holder(run) is None  # released at the end


def test_lock_of_a_killed_run_is_taken_over(tmp_path):
    run = tmp_path / "run"
    holder = _hold(run)
    assert lock_holder(run) == (socket.gethostname(), holder.pid)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert read_holder(run) == (socket.gethostname(), holder.pid)  # the stale record is still there
    assert lock_holder(run) is None
    with RunLock(run):
        assert read_holder(run) == (socket.gethostname(), os.getpid())
    assert read_holder(run) is None


def test_submit_to_a_run_directory_in_use_is_refused(tmp_path):
    cfg = synthetic_config(tmp_path)
    run = tmp_path / "run"
    holder = _hold(run)
    try:
        proc = run_cli("submit", str(cfg), "--run-dir", str(run), "--dry-run", timeout=120)
        assert proc.returncode == 2 and proc.stderr.strip() == _refusal(holder.pid, run), proc.stderr
    finally:
        holder.kill()
        holder.wait()
    # a queued or running job owns it too (a local-executor job is a live process)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        (run / "slurm").mkdir()
        record = dict(
            job_id=str(sleeper.pid),
            executor="local",
            folder=str(run / "slurm"),
            submitted="now",
            ranks=1,
            nodes=1,
            partition=None,
            command="hpcfl submit",
        )
        (run / "slurm" / "jobs.jsonl").write_text(json.dumps(record) + "\n")
        proc = run_cli("submit", str(cfg), "--run-dir", str(run), "--dry-run", timeout=120)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"belongs to job {sleeper.pid}, which is RUNNING" in proc.stderr
    finally:
        sleeper.kill()
        sleeper.wait()


def test_tct_stage2_on_a_run_directory_in_use_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    holder = _hold(run)
    try:
        assert main(["tct-stage2", str(run)]) == 2
        assert capsys.readouterr().err.strip() == _refusal(holder.pid, run)
    finally:
        holder.kill()
        holder.wait()
