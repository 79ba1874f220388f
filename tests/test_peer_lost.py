"""A peer that stops answering without its process exiting ends the MPI job in one line (issue 50).

A host that vanishes (a node lost, a link cut) leaves its peers waiting in a collective; the
deadline of :mod:`hpcfl.comm.deadline` bounds that wait. Here a rank SIGSTOPs itself (it neither
dies nor answers) or is SIGKILLed where the launcher does not notice; the job must end within the
deadline plus the probe with exactly one line naming the rank and its host, and exit 76.
"""

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
from hpcfl.comm.deadline import FACTOR, FLOOR_S, Deadline, parse_timeout, resolve_timeout
from hpcfl.comm.mpi import lost_message
from hpcfl.errors import EXIT_PEER_LOST, ConfigError
from tests.helpers import MPIEXEC, REPO, mpiexec_cmd, repo_env, run_mpi_program, synthetic_config

PROGRAM = REPO / "tests" / "mpi_programs" / "peer_lost.py"
HOST = socket.gethostname()
TIMEOUT_S = 3  # the collective deadline of these jobs; each ends in deadline + probe + start-up


def _line(rank: int) -> str:
    return (
        f"hpcfl: error: rank {rank} (host {HOST}) did not answer within {TIMEOUT_S} s (its node was lost "
        "or its link cut); ending the job — resume with --resume"
    )


def _job(
    ranks: int, mode: str, *launcher: str, guard: bool = True, wrap: bool = False
) -> subprocess.CompletedProcess:
    env = repo_env()
    env.pop("HPCFL_RANK_GUARD", None)
    env.pop("HPCFL_COMM_TIMEOUT", None)
    if not guard:
        env["HPCFL_RANK_GUARD"] = "0"
    rank = [sys.executable, str(PROGRAM), mode, str(TIMEOUT_S)]
    if wrap:  # the killed rank's exit reaches the launcher as a plain exit code, not a signal
        rank = ["sh", "-c", " ".join(rank)]
    # a hang would end in TimeoutExpired
    return subprocess.run(
        [MPIEXEC, *launcher, "-n", str(ranks), *rank], env=env, capture_output=True, text=True, timeout=90
    )


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_stopped_rank_ends_the_job_with_one_line(ranks: int) -> None:
    proc = _job(ranks, "stop")
    assert proc.returncode == EXIT_PEER_LOST, proc.stderr
    assert proc.stderr.strip().splitlines() == [_line(ranks - 1)]


@pytest.mark.mpi
def test_a_killed_rank_the_launcher_misses_ends_the_job_with_one_line() -> None:
    # Without the rank guard a SIGKILLed rank is normally caught by mpiexec itself (its banner ends
    # the job). On a lost node nothing reports it: -disable-auto-cleanup and a shell between the
    # launcher and the rank leave only the deadline to notice.
    proc = _job(2, "kill", "-disable-auto-cleanup", guard=False, wrap=True)
    assert proc.returncode == EXIT_PEER_LOST, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln != "Killed"]  # the shell's own note
    assert lines == [_line(1)]


def _rank_process(launcher: int, rank: int) -> int | None:
    """PID of the guarded process of ``rank`` under the launcher ``launcher`` (None until it runs)."""
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"HPCFL_RANK_GUARD=child" in env and f"PMI_RANK={rank}".encode() in env:
            pid = ppid  # walk up to the launcher
            while pid > 1:
                if pid == launcher:
                    return int(proc.name)
                try:
                    pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    break
    return None


@pytest.mark.mpi
def test_a_run_whose_rank_stops_mid_round_ends_in_one_line(tmp_path) -> None:
    cfg = synthetic_config(tmp_path, rounds=500, algorithm="fedavg", comm_timeout=TIMEOUT_S)
    run = tmp_path / "run"
    env = repo_env()
    env.pop("HPCFL_RANK_GUARD", None)
    env.pop("HPCFL_COMM_TIMEOUT", None)
    job = subprocess.Popen(
        mpiexec_cmd(2, "run", str(cfg), "--run-dir", str(run)), env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        metrics, until = run / "metrics.jsonl", time.monotonic() + 60
        while time.monotonic() < until and (
            not metrics.exists() or len(metrics.read_text().splitlines()) < 2
        ):
            time.sleep(0.1)
        pid = _rank_process(job.pid, 1)
        assert pid is not None and job.poll() is None, "the run did not get going"
        os.kill(pid, signal.SIGSTOP)  # its host vanished: it neither dies nor answers
        _, err = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == EXIT_PEER_LOST, err
    assert err.strip().splitlines() == [_line(1)]
    assert json.loads((run / "determinism.json").read_text())["comm_timeout"] == TIMEOUT_S


@pytest.mark.mpi
def test_bounded_collectives_equal_the_blocking_ones() -> None:
    run_mpi_program("collectives_match.py")  # allreduce bit for bit, objects equal, every root


def test_lost_ranks_are_named_grouped_by_host() -> None:
    hosts = ["a", "a", "b", "b", "c"]
    assert lost_message([2, 3, 4], hosts, "did not answer within 5 s") == (
        "ranks 2, 3 (host b) and rank 4 (host c) did not answer within 5 s (their nodes were lost or "
        "their links cut); ending the job — resume with --resume"
    )


def test_auto_deadline_is_the_floor_or_ten_times_the_longest_interval() -> None:
    now = [0.0]
    deadline = Deadline(None, clock=lambda: now[0])
    assert deadline.start() == (FLOOR_S, FLOOR_S)
    now[0] = 40.0
    deadline.start()
    now[0] = 45.0
    assert deadline.start() == (FACTOR * 40.0, 45.0 + FACTOR * 40.0)
    assert Deadline(2.5).start()[0] == 2.5


@pytest.mark.parametrize("value", ["0", "-3", "soon", "nan", "inf"])
def test_a_deadline_that_is_not_a_positive_number_is_one_line(tmp_path, capsys, value: str) -> None:
    cfg = synthetic_config(tmp_path, rounds=1)
    code = main(["run", str(cfg), "--run-dir", str(tmp_path / "r"), "--set", f"comm_timeout={value}"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2
    assert lines == [
        f"hpcfl: error: config key 'comm_timeout' must be auto or a positive number of seconds (the "
        f"deadline of a collective), got {value!r}"
    ]


def test_a_bad_environment_deadline_is_one_line_naming_the_variable(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("HPCFL_COMM_TIMEOUT", "-1")
    cfg = synthetic_config(tmp_path, rounds=1)
    assert main(["run", str(cfg), "--run-dir", str(tmp_path / "r")]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert lines == [
        "hpcfl: error: environment variable HPCFL_COMM_TIMEOUT must be auto or a positive number of "
        "seconds (the deadline of a collective), got '-1'"
    ]


def test_the_record_says_which_deadline_ran_and_who_set_it(tmp_path, monkeypatch) -> None:
    cfg = synthetic_config(tmp_path, rounds=1)
    assert main(["run", str(cfg), "--run-dir", str(tmp_path / "a"), "--set", "comm_timeout=90"]) == 0
    record = json.loads((tmp_path / "a" / "determinism.json").read_text())
    assert (record["comm_timeout"], record["comm_timeout_from"]) == (90.0, "config")
    monkeypatch.setenv("HPCFL_COMM_TIMEOUT", "120")
    assert resolve_timeout("90") == (120.0, "environment HPCFL_COMM_TIMEOUT")
    assert main(["run", str(cfg), "--run-dir", str(tmp_path / "b"), "--set", "comm_timeout=90"]) == 0
    record = json.loads((tmp_path / "b" / "determinism.json").read_text())
    assert (record["comm_timeout"], record["comm_timeout_from"]) == (120.0, "environment HPCFL_COMM_TIMEOUT")


def test_parse_timeout_accepts_auto_and_seconds() -> None:
    assert parse_timeout("auto") is None and parse_timeout(" AUTO ") is None
    assert parse_timeout(2) == 2.0 and parse_timeout("0.5") == 0.5
    with pytest.raises(ConfigError):
        parse_timeout(True)


# Every loss is said (issue 61): whichever side survives names the ranks that did not answer and
# says why it ends; a side that is not a majority (a tie without rank 0 included) ends without
# requeueing, saying so. The probe's silent cases, frozen (SIGSTOP) and killed (SIGKILL, nothing but
# the communicator noticing).
def _minority_line(lost: str, answered: str, share: str) -> str:
    who = (
        "its node was lost or its link cut"
        if lost.startswith("rank ")
        else "their nodes were lost or their links cut"
    )
    return (
        f"hpcfl: error: {lost} (host {HOST}) did not answer within {TIMEOUT_S} s ({who}); only {answered} "
        f"answered, {share}, so this side ends the job without requeueing it (the other side may still "
        "run) — resume with --resume once the job has ended"
    )


SILENT_BEFORE = {  # ranks, the stopped ranks -> the line the surviving side says
    (2, "0"): _minority_line("rank 0", "rank 1", "half of the 2 ranks, without rank 0"),
    (4, "0,1"): _minority_line("ranks 0, 1", "ranks 2, 3", "half of the 4 ranks, without rank 0"),
    (3, "1,2"): _minority_line("ranks 1, 2", "rank 0", "a minority of the 3 ranks"),
}


def _stopping_job(
    ranks: int, mode: str, stopped: str, *launcher: str, guard: bool = True
) -> subprocess.CompletedProcess:
    env = repo_env()
    env.pop("HPCFL_RANK_GUARD", None)
    env.pop("HPCFL_COMM_TIMEOUT", None)
    rank = [sys.executable, str(PROGRAM), mode, str(TIMEOUT_S), stopped]
    if not guard:  # a killed rank's exit reaches the launcher as a plain exit code, not a signal
        env["HPCFL_RANK_GUARD"] = "0"
        # hydra may signal a dead rank's survivors with SIGUSR1 under -disable-auto-cleanup; the
        # shell, standing where a node's own process would, must not die of it
        rank = ["sh", "-c", "trap : USR1; " + " ".join(rank)]
    return subprocess.run(
        [MPIEXEC, *launcher, "-n", str(ranks), *rank], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.mpi
@pytest.mark.parametrize(("ranks", "stopped"), list(SILENT_BEFORE))
def test_a_side_without_a_majority_says_what_it_saw(ranks: int, stopped: str) -> None:
    proc = _stopping_job(ranks, "stop", stopped)
    assert proc.returncode == EXIT_PEER_LOST, proc.stderr
    assert proc.stderr.strip().splitlines() == [SILENT_BEFORE[ranks, stopped]]


@pytest.mark.mpi
@pytest.mark.parametrize(("ranks", "stopped"), [(2, "0"), (3, "1,2")])
def test_a_side_without_a_majority_says_what_it_saw_when_the_others_are_killed(
    ranks: int, stopped: str
) -> None:
    proc = _stopping_job(ranks, "kill", stopped, "-disable-auto-cleanup", guard=False)
    assert proc.returncode == EXIT_PEER_LOST, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln != "Killed"]  # the shell's own note
    assert lines == [SILENT_BEFORE[ranks, stopped]]


@pytest.mark.mpi
def test_a_run_whose_rank_0_stops_says_so_from_rank_1_and_leaves_peer_lost(tmp_path) -> None:
    cfg = synthetic_config(tmp_path, rounds=500, algorithm="fedavg", comm_timeout=TIMEOUT_S)
    run = tmp_path / "run"
    env = repo_env()
    env.pop("HPCFL_RANK_GUARD", None)
    env.pop("HPCFL_COMM_TIMEOUT", None)
    job = subprocess.Popen(
        mpiexec_cmd(2, "run", str(cfg), "--run-dir", str(run)), env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        metrics, until = run / "metrics.jsonl", time.monotonic() + 60
        while time.monotonic() < until and (
            not metrics.exists() or len(metrics.read_text().splitlines()) < 2
        ):
            time.sleep(0.1)
        pid = _rank_process(job.pid, 0)
        assert pid is not None and job.poll() is None, "the run did not get going"
        os.kill(pid, signal.SIGSTOP)
        _, err = job.communicate(timeout=60)
    finally:
        job.kill()
    line = SILENT_BEFORE[2, "0"]
    assert job.returncode == EXIT_PEER_LOST, err
    assert err.strip().splitlines() == [line]
    assert (run / "PEER_LOST").read_text() == line.removeprefix("hpcfl: error: ") + "\n"


@pytest.mark.mpi
@pytest.mark.parametrize("stopped", ["0", "1"])
def test_a_rank_stopped_before_the_start_up_exchange_ends_the_job_in_one_line(stopped: str) -> None:
    # the rank stops after MPI_Init, before the communicator's roll call: nobody knows its host yet
    proc = _stopping_job(2, "start", stopped)
    assert proc.returncode == EXIT_PEER_LOST, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"hpcfl: error: rank {stopped} (host unknown) did not answer within {TIMEOUT_S} s (its node was "
        "lost or its link cut); ending the job — resume with --resume"
    ]


@pytest.mark.mpi
def test_a_rank_stopped_before_the_start_up_exchange_is_named_among_three() -> None:
    proc = _stopping_job(3, "start", "2")
    assert proc.returncode == EXIT_PEER_LOST, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"hpcfl: error: rank 2 (host unknown) did not answer within {TIMEOUT_S} s (its node was "
        "lost or its link cut); ending the job — resume with --resume"
    ]
