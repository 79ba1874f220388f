"""``hpcfl submit`` / ``hpcfl status`` (hpcfl.launch): the submitit glue.

Without SLURM: the generated sbatch script against golden files, every refusal that must happen
before queueing (one line, exit 2), and whole runs through submitit's local executor, including
the checkpoint-and-requeue protocol after a preemption signal. With the real local SLURM
(``-m slurm``): a 2-rank run, a preemption mid-run that requeues and resumes, sbatch's refusal in
one line, and a pending job's reason.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("submitit")

from hpcfl.cli.main import main  # noqa: E402
from hpcfl.config import load_config  # noqa: E402
from hpcfl.errors import ConfigError  # noqa: E402
from hpcfl.launch import SubmitOptions, render_sbatch, submit_run  # noqa: E402
from tests.cluster import slurm as cluster_module  # noqa: E402
from tests.cluster.slurm import SlurmCluster  # noqa: E402
from tests.helpers import run_cli, synthetic_config  # noqa: E402

GOLDEN = Path(__file__).parent / "golden"

# the session fixtures (once tests/conftest.py imports them, these two lines can go)
slurm_cluster = cluster_module.slurm_cluster
slurm_env = cluster_module.slurm_env


def _metric_rounds(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["round"] for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.2) -> None:
    """Poll ``check()`` until true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached within {timeout:.0f} s")
        time.sleep(interval)


# ---------------------------------------------------------------------------------------------
# the sbatch script


@pytest.mark.parametrize(
    ("golden", "options"),
    [
        (
            "submit_cpu.sbatch",
            SubmitOptions(partition="cpu", ntasks_per_node=8, cpus_per_task=2, time_min=120),
        ),
        (
            "submit_gpu.sbatch",
            SubmitOptions(
                partition="gpu",
                nodes=2,
                ntasks_per_node=4,
                cpus_per_task=8,
                gpus_per_task=1,
                time_min=240,
                mem_gb=64,
                account="proj",
                mpi="pmix",
                sbatch={"reservation": "fl"},
            ),
        ),
    ],
)
def test_sbatch_script_matches_golden(golden: str, options: SubmitOptions) -> None:
    """The script submitit would queue: srun --mpi, --requeue, the stop signal, one task per rank."""
    text = render_sbatch(options, Path("/shared/runs/demo/slurm"), "hpcfl-demo")
    text = text.replace(shlex.quote(sys.executable), "PYTHON")
    assert text == (GOLDEN / golden).read_text()


def test_dry_run_prints_script_and_queues_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = synthetic_config(tmp_path)
    run_dir = tmp_path / "run"
    assert main(["submit", str(cfg), "--run-dir", str(run_dir), "--ntasks-per-node", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash")
    assert "#SBATCH --ntasks-per-node=2" in out and "--mpi=pmi2" in out
    assert f"{run_dir}/slurm/%j_0_log.out" in out
    assert not run_dir.exists()


# ---------------------------------------------------------------------------------------------
# refusals before anything is queued: one line, exit 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--ntasks-per-node", "8"], "8 ranks for 4 clients"),
        (["--gpus-per-task", "1"], "add --set device=cuda"),
        (["--time", "1", "--signal-delay", "120"], "leaves no time before the stop signal"),
        (["--executor", "local", "--ntasks-per-node", "2"], "the local executor runs one rank"),
        (["--mpi", "openmpi"], "unknown --mpi 'openmpi'"),
    ],
)
def test_bad_requests_are_refused_in_one_line(tmp_path: Path, extra: list[str], message: str) -> None:
    cfg = synthetic_config(tmp_path)
    proc = run_cli("submit", str(cfg), "--run-dir", str(tmp_path / "run"), *extra, "--dry-run", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_run_dir_of_another_config_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("name: synth\nlr: 0.5\n")
    proc = run_cli("submit", str(synthetic_config(tmp_path)), "--run-dir", str(run_dir), "--dry-run")
    assert proc.returncode == 2
    assert "holds a run of another config" in proc.stderr and "Traceback" not in proc.stderr


def test_without_srun_submit_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun on it
    cfg = synthetic_config(tmp_path)
    with pytest.raises(ConfigError, match="no SLURM here"):
        submit_run(load_config(str(cfg)), tmp_path / "run", SubmitOptions())


def test_status_of_a_plain_directory_says_what_to_do(tmp_path: Path) -> None:
    proc = run_cli("status", str(tmp_path))
    assert proc.returncode == 2
    assert "holds no run and no submitted job" in proc.stderr and "hpcfl submit" in proc.stderr


# ---------------------------------------------------------------------------------------------
# whole runs through submitit's local executor


def test_local_executor_runs_to_the_end_and_status_reports_it(tmp_path: Path) -> None:
    cfg = synthetic_config(tmp_path, rounds=3)
    run_dir = tmp_path / "run"
    proc = run_cli(
        "submit", str(cfg), "--run-dir", str(run_dir), "--executor", "local", "--wait", timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (run_dir / "DONE").exists() and _metric_rounds(run_dir) == [1, 2, 3]
    assert "rounds   3/3" in proc.stdout and "(finished)" in proc.stdout

    proc = run_cli("status", str(run_dir), "--json")
    status = json.loads(proc.stdout)
    assert proc.returncode == 0
    assert status["finished"] and not status["failed"] and status["executor"] == "local"
    assert status["rounds_done"] == status["rounds_total"] == 3


def test_local_job_failing_at_run_time_reports_the_cause(tmp_path: Path) -> None:
    """A config valid on the submit host but failing on the node (data missing there) ends the
    job; status exits 1 and prints the cause in one line."""
    cfg = synthetic_config(
        tmp_path, dataset="mnist", dataset_options={}, data_root=str(tmp_path / "nowhere"), download=False
    )
    run_dir = tmp_path / "run"
    proc = run_cli(
        "submit", str(cfg), "--run-dir", str(run_dir), "--executor", "local", "--wait", timeout=300
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    proc = run_cli("status", str(run_dir))
    assert proc.returncode == 1
    error = [line for line in proc.stdout.splitlines() if line.startswith("error")]
    assert len(error) == 1 and "DataError" in error[0], proc.stdout
    assert "log      " in proc.stdout


def _task_pid(controller_pid: int, timeout: float = 60) -> int:
    """The PID of the single task process submitit's local controller started."""
    children = Path(f"/proc/{controller_pid}/task/{controller_pid}/children")
    pids: list[str] = []

    def found() -> bool:
        nonlocal pids
        pids = children.read_text().split() if children.exists() else []
        return bool(pids)

    _wait_for(found, timeout, "the local task process")
    return int(pids[0])


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc to find the task process")
def test_local_preemption_signal_checkpoints_requeues_and_resumes(tmp_path: Path) -> None:
    """submitit's preemption signal (USR2) to the running task: hpcfl finishes the round in flight,
    checkpoints, and requeues through submitit's protocol (HpcflJob.checkpoint); the rerun resumes
    and finishes every round."""
    rounds = 60
    cfg = load_config(str(synthetic_config(tmp_path, rounds=rounds)))
    run_dir = tmp_path / "run"
    job, _ = submit_run(cfg, run_dir, SubmitOptions(executor="local", time_min=30))
    try:
        _wait_for(lambda: len(_metric_rounds(run_dir)) >= 2, 120, "two finished rounds")
        task = _task_pid(job._process.pid)
        signal_round = max(_metric_rounds(run_dir))
        os.kill(task, signal.SIGUSR2)
        _wait_for(job.done, 240, "the end of the job", interval=0.5)
        summary = job.result()
    finally:
        job.cancel(check=False)
    log = Path(job.paths.stderr).read_text()
    assert "stopped by a signal after round" in log, log
    stopped_at = int(log.split("stopped by a signal after round ")[1].split()[0])
    assert signal_round <= stopped_at < rounds
    assert summary["finished"] and summary["rounds_done"] == rounds
    assert _metric_rounds(run_dir) == list(range(1, rounds + 1))


# ---------------------------------------------------------------------------------------------
# on the real local SLURM


def _submit_two_ranks(
    cfg: Path, run_dir: Path, cluster: SlurmCluster, *extra: str, timeout: float
) -> subprocess.CompletedProcess:
    """``hpcfl submit`` of a 2-rank, 1-CPU-per-rank, 10-minute job to the test cluster."""
    args = ["--run-dir", str(run_dir), "--ntasks-per-node", "2", "-c", "1", "--time", "10", *extra]
    return run_cli("submit", str(cfg), *args, env=cluster.env, timeout=timeout)


@pytest.mark.slurm
def test_slurm_two_rank_run_completes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    cfg = synthetic_config(tmp_path, rounds=5)
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = _submit_two_ranks(cfg, run_dir, slurm_cluster, "--wait", timeout=300)
    print(f"\nhpcfl submit --wait (2 ranks, 5 rounds): {time.monotonic() - t0:.1f}s")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (run_dir / "DONE").exists() and _metric_rounds(run_dir) == [1, 2, 3, 4, 5]
    job_id = proc.stderr.split("submitted job ")[1].split()[0]
    assert (run_dir / "slurm" / f"{job_id}_1_log.out").exists()  # a second task ran
    status = json.loads(run_cli("status", str(run_dir), "--json", env=slurm_cluster.env).stdout)
    assert status["ranks"] == 2 and status["finished"] and not status["failed"]
    assert status["state"] in ("COMPLETED", "COMPLETING", "RUNNING")  # the last moments of the job


@pytest.mark.slurm
def test_slurm_preemption_requeues_and_resumes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The signal SLURM sends before the time limit (USR2 with submitit) mid-run: the ranks agree,
    checkpoint the round, finalize MPI, rank 0 requeues the job; the rerun resumes and finishes."""
    rounds = 80
    cfg = synthetic_config(tmp_path, rounds=rounds)
    run_dir = tmp_path / "run"
    proc = _submit_two_ranks(cfg, run_dir, slurm_cluster, timeout=120)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip()
    _wait_for(lambda: len(_metric_rounds(run_dir)) >= 2, 180, "two finished rounds")
    t0 = time.monotonic()
    slurm_cluster.run("scancel", "--signal=USR2", job_id)

    def finished() -> bool:
        state = slurm_cluster.squeue_state(job_id)
        assert state not in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), (
            f"job {job_id} {state}\n{(run_dir / 'slurm' / f'{job_id}_0_log.err').read_text()}"
        )
        return state == "COMPLETED"

    _wait_for(finished, 240, "COMPLETED after the requeue", interval=0.5)
    print(f"\nUSR2 -> checkpoint -> requeue -> resume -> COMPLETED: {time.monotonic() - t0:.1f}s")
    log = (run_dir / "slurm" / f"{job_id}_0_log.err").read_text()
    assert "stopped by a signal after round" in log and "DUE TO JOB REQUEUE" in log, log
    assert _metric_rounds(run_dir) == list(range(1, rounds + 1))
    proc = run_cli("status", str(run_dir), env=slurm_cluster.env)
    assert proc.returncode == 0 and "requeued 1x" in proc.stdout and "(finished)" in proc.stdout, proc.stdout


@pytest.mark.slurm
def test_slurm_rejection_is_one_line(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    t0 = time.monotonic()
    proc = run_cli(
        "submit",
        str(synthetic_config(tmp_path)),
        "--run-dir",
        str(tmp_path / "run"),
        "--partition",
        "no-such-partition",
        env=slurm_cluster.env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "sbatch rejected the job: invalid partition specified: no-such-partition" in proc.stderr
    assert "sinfo -s" in proc.stderr
    assert time.monotonic() - t0 < 60


@pytest.mark.slurm
def test_slurm_status_explains_a_pending_job_then_a_cancelled_one(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        "submit",
        str(synthetic_config(tmp_path)),
        "--run-dir",
        str(run_dir),
        "--sbatch",
        "begin=now+1hour",
        env=slurm_cluster.env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip()
    proc = run_cli("status", str(run_dir), env=slurm_cluster.env)
    assert proc.returncode == 0
    assert "PENDING (BeginTime: its start time has not come" in proc.stdout, proc.stdout
    slurm_cluster.run("scancel", job_id)
    _wait_for(lambda: slurm_cluster.squeue_state(job_id) == "CANCELLED", 30, "CANCELLED")
    proc = run_cli("status", str(run_dir), env=slurm_cluster.env)
    assert proc.returncode == 1 and "state    CANCELLED" in proc.stdout, proc.stdout
