"""One sweep per sweep directory, and markers that never contradict each other (issue 26, item 2).

Two ``hpcfl sweep`` on one ``--out`` used to race point by point, each failing the points the other
held and leaving finished points with both ``DONE`` and ``FAILED``; ``hpcfl status`` then counted
them as done.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from hpcfl.cli.main import main
from hpcfl.errors import EXIT_RESUMABLE
from hpcfl.runner.lock import RunLock
from hpcfl.sweep.local import FAILED, run_point
from tests.helpers import synthetic_config

GRID = ["--grid", "lr=0.02,0.05"]


def test_second_sweep_on_one_directory_is_refused_naming_the_holder(tmp_path, capsys):
    cfg = synthetic_config(tmp_path, rounds=1, algorithm="fedavg")
    out = tmp_path / "sweep"
    holder = RunLock(out, what="sweep directory", by="another hpcfl sweep", option="--out")
    holder.acquire()  # the first sweep, still running (flock: another open file description)
    try:
        assert main(["sweep", str(cfg), "--out", str(out), *GRID]) == 2
    finally:
        holder.release()
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"hpcfl: error: sweep directory {out} is in use by another hpcfl sweep (host "
        f"{socket.gethostname()}, PID {os.getpid()}); wait for it to end, stop it, or choose another --out"
    )
    assert not (out / "runs").exists()  # refused up front: no point ran or was marked
    assert main(["sweep", str(cfg), "--out", str(out), *GRID]) == 0  # released: it runs
    assert (out / "runs" / "lr=0.02" / "DONE").exists() and not (out / "runs" / "lr=0.02" / FAILED).exists()


def test_point_held_by_another_process_is_busy_not_failed(tmp_path, capsys):
    cfg = synthetic_config(tmp_path, rounds=1, algorithm="fedavg")
    out = tmp_path / "sweep"
    held = out / "runs" / "lr=0.02"
    lock = RunLock(held)
    lock.acquire()  # e.g. an `hpcfl run --run-dir` on the point, or a raced worker
    try:
        assert main(["sweep", str(cfg), "--out", str(out), *GRID]) == EXIT_RESUMABLE
        err = capsys.readouterr().err
        assert f"lr=0.02: busy (run by host {socket.gethostname()}, PID {os.getpid()})" in err
        assert "1 of 2 points are being run by another process and were left alone (lr=0.02)" in err
        assert "failed" not in err
        assert not (held / FAILED).exists()
        capsys.readouterr()
        assert main(["status", str(out)]) == 0
        text = capsys.readouterr().out
        assert "lr=0.02" in text and "running" in text and "1 running, 1 done" in text
    finally:
        lock.release()
    assert main(["sweep", str(cfg), "--out", str(out), *GRID]) == 0
    assert (held / "DONE").exists() and not (held / FAILED).exists()


def test_done_and_failed_never_coexist(tmp_path, capsys):
    """A failure removes DONE; a success removes FAILED; status reports leftovers of older versions."""
    cfg = synthetic_config(tmp_path, rounds=1, algorithm="fedavg")
    out = tmp_path / "sweep"
    assert main(["sweep", str(cfg), "--out", str(out), *GRID]) == 0
    point = out / "runs" / "lr=0.05"
    (point / FAILED).write_text("left by a raced sweep of an older hpcfl\n")  # what the race left
    capsys.readouterr()
    assert main(["status", str(out)]) == 0
    text = capsys.readouterr().out
    assert "done (a stale FAILED marker also says: left by a raced sweep of an older hpcfl)" in text
    assert "2 done" in text
    # a point that fails is never left looking finished
    from hpcfl.config import load_config

    bad = load_config(cfg, ["lr=1e12", "rounds=2"])
    outcome = run_point(bad, point, replace_other=True)
    assert outcome.failed
    assert (point / FAILED).exists() and not (point / "DONE").exists()


@pytest.mark.parametrize("marker", ["DONE", FAILED])
def test_busy_point_keeps_its_markers(tmp_path, marker):
    """A point held by another process is not touched: its markers stay as that process left them."""
    cfg = synthetic_config(tmp_path, rounds=1, algorithm="fedavg")
    from hpcfl.config import load_config

    run = tmp_path / "point"
    with RunLock(run):
        (run / marker).write_text("x\n")
        outcome = run_point(load_config(cfg), run)
        assert outcome.busy and not outcome.failed
        assert sorted(p.name for p in Path(run).iterdir() if not p.name.startswith(".")) == [marker]


def test_compare_still_ends_on_a_held_point(tmp_path):
    """``hpcfl compare`` runs points with ``record_failures=False``: a held point ends it with the
    lock's one line instead of being skipped as busy and reported half-finished."""
    from hpcfl.config import load_config
    from hpcfl.runner.lock import LockedError

    cfg = synthetic_config(tmp_path, rounds=1, algorithm="fedavg")
    run = tmp_path / "point"
    with RunLock(run), pytest.raises(LockedError, match="is in use by another hpcfl run"):
        run_point(load_config(cfg), run, record_failures=False)


def test_status_of_a_run_dir_says_what_its_markers_say(tmp_path, capsys):
    """``hpcfl status RUN_DIR`` of a run started with ``hpcfl run`` used to say NOT SUBMITTED while it
    ran, after it failed as a sweep point, and when it was stopped."""
    cfg = synthetic_config(tmp_path, rounds=1, algorithm="fedavg")
    run = tmp_path / "run"
    assert main(["run", str(cfg), "--run-dir", str(run)]) == 0

    def state() -> tuple[int, str]:
        capsys.readouterr()
        rc = main(["status", str(run)])
        line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("state")][0]
        return rc, line

    assert state() == (0, "state    FINISHED")
    (run / "DONE").unlink()
    assert state() == (0, "state    UNFINISHED (resume it with hpcfl run ... --resume)")
    with RunLock(run):
        assert state() == (0, f"state    RUNNING on {socket.gethostname()} (PID {os.getpid()})")
    (run / FAILED).write_text("loss became NaN/inf in round 1 on client 0\n")
    assert state() == (1, "state    FAILED")


def test_a_failed_point_finished_by_hand_loses_its_failed_marker(tmp_path, capsys):
    """A point that failed in a sweep and was then finished with ``hpcfl run --resume`` (say with
    the fix applied by hand) used to keep FAILED beside DONE."""
    cfg = synthetic_config(tmp_path, rounds=2, algorithm="fedavg")
    run = tmp_path / "point"
    assert main(["run", str(cfg), "--run-dir", str(run), "--set", "rounds=1"]) == 0
    (run / "DONE").unlink()
    (run / FAILED).write_text("stopped by a bad node\n")
    assert main(["run", str(cfg), "--run-dir", str(run), "--resume"]) == 0
    assert (run / "DONE").exists() and not (run / FAILED).exists()
