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

import pytest

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


# -- issue 61 item 9: a lock left by a dead host where flock cannot tell ------------------------------


def _record(run: Path, host: str, pid: int, boot: str, until: float) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / ".lock").write_text(f"{host} {pid} {boot} {until!r}\n")


def test_a_lock_left_by_a_dead_host_is_taken_over_with_one_line_once_its_lease_expired(
    tmp_path, capsys, monkeypatch
):
    """Lease mode (no flock, or ``HPCFL_RUN_LOCK=lease`` where flock is host-local): a record from
    another host whose lease expired is stale — the run takes it over, saying so in one line, and
    trains; one whose lease still runs is refused as a live holder."""
    from hpcfl.runner.lock import boot_id

    monkeypatch.setenv("HPCFL_RUN_LOCK", "lease")
    cfg = synthetic_config(tmp_path, rounds=1)
    run = tmp_path / "run"
    _record(run, "node-gone", 4242, "0f-boot", time.time() + 600)
    assert lock_holder(run) == ("node-gone", 4242)
    assert main(["run", str(cfg), "--run-dir", str(run)]) == 2
    assert "in use by another hpcfl run (host node-gone, PID 4242)" in capsys.readouterr().err
    _record(run, "node-gone", 4242, "0f-boot", time.time() - 5)
    assert lock_holder(run) is None
    assert main(["run", str(cfg), "--run-dir", str(run)]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "took over" in line]
    assert len(notes) == 1 and notes[0].startswith(
        f"hpcfl: note: run directory {run}: took over the lock of host node-gone, PID 4242: its lease expired"
    ), notes
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    assert read_holder(run) is None  # released at the end
    # a holder that locked with flock records an endless lease: never taken over on a lease
    _record(run, "node-b", 7, boot_id(), float("inf"))
    assert lock_holder(run) == ("node-b", 7)


def test_a_lock_of_this_host_before_a_reboot_is_stale_even_if_its_pid_is_alive_again(
    tmp_path, monkeypatch, capsys
):
    from hpcfl.runner.lock import stale_reason

    monkeypatch.setenv("HPCFL_RUN_LOCK", "lease")
    run = tmp_path / "run"
    _record(run, socket.gethostname(), os.getppid(), "boot-before-the-reboot", time.time() + 600)
    assert stale_reason(run) == f"host {socket.gethostname()} rebooted since (its boot id changed)"
    with RunLock(run):
        assert read_holder(run) == (socket.gethostname(), os.getpid())
    assert "rebooted since" in capsys.readouterr().err


def test_a_lease_mode_holder_renews_its_lease_and_a_killed_one_stops(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HPCFL_RUN_LOCK": "lease", "HPCFL_RUN_LOCK_LEASE": "0.6"}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"

        def until() -> float:
            return float((run / ".lock").read_text().split()[3])

        first = until()
        time.sleep(1.0)
        assert until() > first  # renewed every 0.2 s
    finally:
        holder.kill()
        holder.wait()
    last = until()
    time.sleep(0.5)
    assert until() == last  # nothing renews a dead holder's lease


@pytest.mark.parametrize(
    ("name", "value", "line"),
    [
        (
            "HPCFL_RUN_LOCK",
            "maybe",
            "hpcfl: error: HPCFL_RUN_LOCK='maybe': must be flock (the default) or lease",
        ),
        (
            "HPCFL_RUN_LOCK_LEASE",
            "0",
            "hpcfl: error: HPCFL_RUN_LOCK_LEASE='0': must be a positive number of seconds",
        ),
        (
            "HPCFL_RUN_LOCK_LEASE",
            "soon",
            "hpcfl: error: HPCFL_RUN_LOCK_LEASE='soon': must be a positive number of seconds",
        ),
    ],
)
def test_a_bad_lock_setting_is_one_line(tmp_path, capsys, monkeypatch, name, value, line):
    monkeypatch.setenv(name, value)
    cfg = synthetic_config(tmp_path, rounds=1)
    assert main(["run", str(cfg), "--run-dir", str(tmp_path / "run")]) != 0
    err = capsys.readouterr().err.strip()
    assert err == line and not (tmp_path / "run" / "metrics.jsonl").exists(), err
