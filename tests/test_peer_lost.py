"""A peer that stops answering without its process exiting ends the MPI job in one line (issue 50);
a peer that only computes for long is waited for (issue 61).

A host that vanishes (a node lost, a link cut) leaves its peers waiting in a collective; the
deadline of :mod:`hpcfl.comm.deadline` bounds that wait. Here a rank SIGSTOPs itself (it neither
dies nor answers) or is SIGKILLed where the launcher does not notice; the job must end within the
deadline plus the knocks and the count with exactly one line naming the rank and its host, and exit
76. A rank that computes for many deadlines answers the knocks (its beacon thread serves them), so
the others keep waiting and the job ends well.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcfl.cli.main import main
from hpcfl.comm.deadline import AUTO_S, CommDeadline, parse_timeout
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
    ranks: int,
    mode: str,
    *launcher: str,
    guard: bool = True,
    wrap: bool = False,
    timeout_s: float = TIMEOUT_S,
    extra: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    env = repo_env()
    env.pop("HPCFL_RANK_GUARD", None)
    env.pop("HPCFL_COMM_TIMEOUT", None)
    if not guard:
        env["HPCFL_RANK_GUARD"] = "0"
    rank = [sys.executable, str(PROGRAM), mode, str(timeout_s), *extra]
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


SLOW_TIMEOUT_S = 4  # the slow rank's job: knocks every 4 s, each awaited 1 s
SLOW_S = 10  # the slow rank computes this long before the collective: two rounds of knocks


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_rank_that_computes_for_many_deadlines_is_waited_for(ranks: int) -> None:
    """Being slow is not being gone: the others knock while they wait, the busy rank's beacon
    thread answers, and the collective completes with the right sums and no line."""
    proc = _job(ranks, "slow", timeout_s=SLOW_TIMEOUT_S, extra=(str(SLOW_S),))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == ""
    # the ranks' lines reach mpiexec's stdout interleaved (one may end inside another): find each
    waited = {int(r): float(w) for r, w in re.findall(r"OK (\d+) waited (\d+\.\d)", proc.stdout)}
    assert sorted(waited) == list(range(ranks))
    # the others waited through several deadlines (the knocks kept them waiting), not ended at one
    assert all(waited[r] > 1.5 * SLOW_TIMEOUT_S for r in range(ranks - 1)), waited
    print(f"\nwaited past {SLOW_TIMEOUT_S} s deadlines for a busy rank: {waited}")


def test_the_default_notices_a_lost_rank_within_a_minute() -> None:
    """auto knocks after 20 s; a rank silent to two knocks (5 s each) is lost and the count takes
    5 s more: 35 s from the moment the others wait for it, with no upper limit on a slow rank."""
    deadline = CommDeadline.resolve("auto", environ={})
    assert (deadline.seconds, deadline.probe_s, deadline.bound_s) == (AUTO_S, 5.0, 35.0)
    assert deadline.bound_s <= 60
    assert CommDeadline.resolve("4", environ={}).bound_s == 4 + 3 * 1.0
    assert CommDeadline.resolve("200", environ={}).probe_s == 10.0  # the knocks wait at most 10 s
    assert CommDeadline.resolve("0.02", environ={}).probe_s == 0.5  # and at least 0.5 s


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


def _stop_rank_mid_run(tmp_path: Path, run: Path, rank: int) -> tuple[subprocess.Popen, str]:
    """A 2-rank ``hpcfl run`` into ``run`` whose ``rank`` is SIGSTOPped once two rounds are written (its
    host vanished: it neither dies nor answers); the finished job and its stderr."""
    cfg = synthetic_config(tmp_path, rounds=500, algorithm="fedavg", comm_timeout=TIMEOUT_S)
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
        pid = _rank_process(job.pid, rank)
        assert pid is not None and job.poll() is None, "the run did not get going"
        os.kill(pid, signal.SIGSTOP)
        _, err = job.communicate(timeout=60)
    finally:
        job.kill()
    return job, err


@pytest.mark.mpi
def test_a_run_whose_rank_stops_mid_round_ends_in_one_line(tmp_path) -> None:
    run = tmp_path / "run"
    job, err = _stop_rank_mid_run(tmp_path, run, 1)
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


def test_the_deadline_is_resolved_once_from_the_config_or_the_environment() -> None:
    env = {"HPCFL_COMM_TIMEOUT": "120"}
    assert CommDeadline.resolve("90", environ={}) == CommDeadline(90.0, False, "config")
    assert CommDeadline.resolve("90", environ=env) == CommDeadline(
        120.0, False, "environment HPCFL_COMM_TIMEOUT"
    )
    assert CommDeadline.resolve("7", environ={"HPCFL_COMM_TIMEOUT": "auto"}).auto
    resolved = CommDeadline.resolve("3", environ={})
    assert CommDeadline.resolve(resolved, environ={}) is resolved  # already resolved: kept as is
    assert CommDeadline.given(2.5) == CommDeadline(2.5, False, "argument")
    assert CommDeadline.given(None) == CommDeadline()
    assert CommDeadline.resolve("auto", environ={}).record() == {
        "comm_timeout": "auto",
        "comm_timeout_from": "config",
        "comm_knock_after_s": AUTO_S,
        "comm_lost_noticed_within_s": 35.0,
    }


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
    assert record["comm_lost_noticed_within_s"] == 90 + 3 * 10.0
    monkeypatch.setenv("HPCFL_COMM_TIMEOUT", "120")
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
    run = tmp_path / "run"
    job, err = _stop_rank_mid_run(tmp_path, run, 0)
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
