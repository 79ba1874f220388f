"""The real local SLURM (tests/cluster/slurm.py) does what hpcfl's batch jobs rely on.

Each test is one fact later code builds on: batch jobs run, ``srun --mpi=pmi2`` wires up the
MPICH wheel's MPI, submitit returns results and reads real states through sacct, bad requests fail
at once with SLURM's own message (never a hang), and ``scontrol requeue`` reruns a running job (the
preemption path). Timings are printed for ``pytest -s``.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest

from tests.cluster import slurm as cluster_module
from tests.cluster.slurm import REPO, SlurmCluster, SlurmCommandError
from tests.helpers import synthetic_config

pytestmark = pytest.mark.slurm

# the session fixtures (once tests/conftest.py imports them, these two lines can go)
slurm_cluster = cluster_module.slurm_cluster
slurm_env = cluster_module.slurm_env

PYTHON = sys.executable  # the venv's python: mpi4py + the mpich wheel, submitit


def _square_plus(x: int, y: int = 1) -> int:
    """The function the submitit test runs on the cluster."""
    return x * x + y


def test_cluster_starts_with_idle_node(slurm_cluster: SlurmCluster) -> None:
    """The fixture's cluster is up: one idle node with at least 4 CPUs in the default partition."""
    phases = ", ".join(f"{k}={v:.2f}s" for k, v in slurm_cluster.timings.items())
    print(f"\ncluster start: {phases}")
    assert slurm_cluster.node_state() == "idle"
    line = slurm_cluster.run("sinfo", "-h", "-o", "%P %c %a").stdout.split()
    assert line[0] == f"{slurm_cluster.partition}*"
    assert int(line[1]) >= 4
    assert line[2] == "up"


def test_sbatch_hostname_completes(slurm_cluster: SlurmCluster) -> None:
    """A plain batch job runs to COMPLETED and its output file holds the hostname."""
    t0 = time.monotonic()
    job = slurm_cluster.sbatch(wrap="hostname")
    state = slurm_cluster.wait_state(job, timeout=60)
    print(f"\nsbatch hostname: {state} after {time.monotonic() - t0:.2f}s")
    assert state == "COMPLETED"
    assert slurm_cluster.output_path(job).read_text().strip() == socket.gethostname()


def _mpi_script(mpi: str) -> str:
    """A 2-task batch job running a tiny mpi4py allreduce under ``srun --mpi=<mpi>``."""
    code = (
        "from mpi4py import MPI; c = MPI.COMM_WORLD; "
        "print('rank', c.rank, 'size', c.size, 'sum', c.allreduce(c.rank + 1), flush=True)"
    )
    return f'#SBATCH --ntasks=2\nsrun --mpi={mpi} {PYTHON} -c "{code}"\n'


def test_srun_pmi2_mpich_wheel_allreduce(slurm_cluster: SlurmCluster) -> None:
    """``srun --mpi=pmi2`` gives the MPICH wheel's libmpi a 2-rank world (PMI from slurmstepd)."""
    assert "pmi2" in slurm_cluster.run("srun", "--mpi=list").stdout
    t0 = time.monotonic()
    job = slurm_cluster.sbatch(_mpi_script("pmi2"))
    state = slurm_cluster.wait_state(job, timeout=120)
    out = slurm_cluster.output_path(job).read_text()
    print(f"\nsrun --mpi=pmi2 2 ranks: {state} after {time.monotonic() - t0:.2f}s\n{out}")
    assert state == "COMPLETED", out
    assert sorted(out.split("\n")[:2]) == ["rank 0 size 2 sum 3", "rank 1 size 2 sum 3"], out


def test_srun_without_pmi_gives_singletons(slurm_cluster: SlurmCluster) -> None:
    """Without ``--mpi=pmi2`` (MpiDefault=none) every task is a 1-rank world: the failure mode
    hpcfl must detect (SLURM_NTASKS > 1 but MPI size 1) rather than train R copies alone."""
    job = slurm_cluster.sbatch(_mpi_script("none"))
    assert slurm_cluster.wait_state(job, timeout=120) == "COMPLETED"
    out = slurm_cluster.output_path(job).read_text()
    assert out.split("\n")[:2] == ["rank 0 size 1 sum 1"] * 2, out


def test_submitit_job_returns_result(slurm_env: SlurmCluster, tmp_path: Path) -> None:
    """A submitit job on the cluster returns the function's value, and (with accounting) submitit
    reads the real final state through sacct instead of UNKNOWN."""
    submitit = pytest.importorskip("submitit")
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    executor.update_parameters(
        slurm_partition=slurm_env.partition,
        timeout_min=5,
        cpus_per_task=1,
        # the job unpickles _square_plus by reference: make this test module importable there
        slurm_setup=[f"export PYTHONPATH={REPO}"],
    )
    t0 = time.monotonic()
    job = executor.submit(_square_plus, 6, y=6)
    deadline = time.monotonic() + 120
    while not job.done() and time.monotonic() < deadline:
        time.sleep(0.2)
    print(f"\nsubmitit job {job.job_id}: done after {time.monotonic() - t0:.2f}s")
    assert job.done(), f"submitit job {job.job_id} not done after 120 s: {slurm_env.squeue_state(job.job_id)}"
    assert job.result() == 42
    if slurm_env.accounting:  # slurmctld sends job records to slurmdbd asynchronously: sacct lags
        state = job.watcher.get_state(job.job_id, mode="force")
        deadline = time.monotonic() + 30
        while state != "COMPLETED" and time.monotonic() < deadline:
            time.sleep(0.5)
            state = job.watcher.get_state(job.job_id, mode="force")
        print(f"sacct says COMPLETED after {time.monotonic() - t0:.2f}s")
        assert state == "COMPLETED"


def test_submitit_bad_partition_fails_fast(slurm_env: SlurmCluster, tmp_path: Path) -> None:
    """submitit surfaces sbatch's rejection at submit time (FailedJobError), within seconds."""
    submitit = pytest.importorskip("submitit")
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    executor.update_parameters(slurm_partition="no-such-partition", timeout_min=1)
    t0 = time.monotonic()
    with pytest.raises(submitit.core.utils.FailedJobError, match="(?i)invalid partition"):
        executor.submit(_square_plus, 1)
    assert time.monotonic() - t0 < 20


def test_sbatch_nonexistent_partition_fails_fast(slurm_cluster: SlurmCluster) -> None:
    """A job for a partition that does not exist is rejected at once with a clear message."""
    t0 = time.monotonic()
    with pytest.raises(SlurmCommandError, match="(?i)invalid partition") as err:
        slurm_cluster.sbatch(wrap="true", args=["--partition=no-such-partition"])
    print(f"\n{err.value.stderr.strip()} ({time.monotonic() - t0:.2f}s)")
    assert time.monotonic() - t0 < 20


def test_sbatch_impossible_request_fails_fast(slurm_cluster: SlurmCluster) -> None:
    """A request no node can meet (999 CPUs per task) is rejected at once, not left pending (the
    fixture sets EnforcePartLimits=ALL; with SLURM's default NO it would pend as PartitionConfig)."""
    t0 = time.monotonic()
    with pytest.raises(SlurmCommandError, match="(?i)more processors requested than permitted") as err:
        slurm_cluster.sbatch(wrap="true", args=["--cpus-per-task=999"])
    print(f"\n{err.value.stderr.strip()} ({time.monotonic() - t0:.2f}s)")
    assert time.monotonic() - t0 < 20


def test_scontrol_requeue_reruns_running_job(slurm_cluster: SlurmCluster) -> None:
    """``scontrol requeue`` stops a running job and runs it again with SLURM_RESTART_COUNT=1 (what a
    preempted, ``--requeue``'d hpcfl job goes through). The rerun starts ``cred_expire`` + 1 = 6 s
    after the requeue (BeginTime), which is why the fixture sets cred_expire=5."""
    runs = slurm_cluster.tmpdir / "jobs" / f"requeue-{time.monotonic_ns()}.txt"
    job = slurm_cluster.sbatch(
        f"""#SBATCH --requeue
echo "run ${{SLURM_RESTART_COUNT:-0}}" >> {runs}
if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then sleep 300; fi
echo finished
"""
    )
    assert slurm_cluster.wait_state(job, ["RUNNING"], timeout=60) == "RUNNING"
    deadline = time.monotonic() + 30
    while not runs.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert runs.read_text() == "run 0\n"
    t0 = time.monotonic()
    slurm_cluster.run("scontrol", "requeue", job)
    state = slurm_cluster.wait_state(job, ["COMPLETED"], timeout=90)
    print(f"\nrequeue -> {state} after {time.monotonic() - t0:.2f}s")
    assert state == "COMPLETED"
    assert runs.read_text() == "run 0\nrun 1\n"
    assert slurm_cluster.output_path(job).read_text().strip().endswith("finished")


# ---------------------------------------------------------------------------------------------
# the slurm/ templates, run for real


def _metric_rounds(metrics: Path) -> list[int]:
    """The round numbers in a run's metrics.jsonl (empty while it does not exist)."""
    if not metrics.exists():
        return []
    return [json.loads(line)["round"] for line in metrics.read_text().splitlines() if line.strip()]


def test_cpu_sbatch_checkpoints_on_usr1_requeues_and_resumes(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """slurm/cpu.sbatch end to end with 2 MPI ranks: SIGUSR1 mid-run (what ``--signal=USR1@120``
    sends before the time limit) -> hpcfl checkpoints and exits 75 -> the script requeues the job ->
    the rerun resumes with ``--resume`` and finishes every round."""
    rounds = 60
    config = synthetic_config(tmp_path, rounds=rounds)
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    job = slurm_cluster.sbatch(
        (REPO / "slurm" / "cpu.sbatch").read_text(),
        args=["--ntasks=2", "--cpus-per-task=1"],  # the file's 4x2 CPUs exceed the test node
        env={"CONFIG": str(config), "RUN_DIR": str(run_dir), "HPCFL": f"{PYTHON} -m hpcfl"},
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while len(_metric_rounds(metrics)) < 2 and time.monotonic() < deadline:
        assert slurm_cluster.squeue_state(job) in ("PENDING", "RUNNING", "CONFIGURING"), (
            slurm_cluster.output_path(job).read_text()
        )
        time.sleep(0.1)
    assert len(_metric_rounds(metrics)) >= 2, "the run wrote no metrics within 120 s"
    slurm_cluster.run("scancel", "--signal=USR1", job)  # to the job steps (the ranks), not the shell
    t_signal = time.monotonic()

    state = slurm_cluster.wait_state(job, ["COMPLETED"], timeout=240)
    log = slurm_cluster.output_path(job).read_text()
    print(f"\ncpu.sbatch: signalled after {t_signal - t0:.1f}s, {state} after {time.monotonic() - t0:.1f}s")
    assert state == "COMPLETED", log
    assert "run 0: 2 ranks" in log and "run 1: 2 ranks" in log, log
    assert "requeueing job" in log, log
    done_rounds = _metric_rounds(metrics)
    assert done_rounds[-1] == rounds, log
    assert (run_dir / "DONE").exists()


def test_scaling_sweep_runs_each_point_once(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """slurm/scaling_sweep.sbatch walks its default points (1x1 1x2 1x4 on a 4-task node) with srun
    at each size, marks each done (a requeued sweep skips them) and summarizes at the end.
    ``hpcfl bench scaling`` is stood in for by a script that records the world it was launched
    into (the real one is tested in test_bench_scaling.py)."""
    stub = tmp_path / "stub.sh"
    stub.write_text(
        "#!/bin/bash\n"
        "# called as: stub.sh bench scaling CONFIG --out DIR, then: stub.sh bench scaling --summarize OUT --out OUT\n"
        'if [ "$3" = --summarize ]; then touch "$4/SUMMARIZED"; exit 0; fi\n'
        '[ "$3" = "$CONFIG" ] && [ "$4" = --out ] || exit 3\n'
        'echo "$SLURM_NNODES $SLURM_NTASKS" > "$5/rank-$SLURM_PROCID"\n'
    )
    stub.chmod(0o755)
    out = tmp_path / "sweep"
    job = slurm_cluster.sbatch(
        (REPO / "slurm" / "scaling_sweep.sbatch").read_text(),
        args=["--ntasks-per-node=4", "--no-requeue"],
        env={"CONFIG": str(tmp_path / "cfg.yaml"), "OUT": str(out), "HPCFL": str(stub), "SRUN_MPI": "none"},
    )
    state = slurm_cluster.wait_state(job, timeout=120)
    log = slurm_cluster.output_path(job).read_text()
    assert state == "COMPLETED", log
    assert (out / "SUMMARIZED").exists(), log
    points = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert points == ["nodes1-ranks1", "nodes1-ranks2", "nodes1-ranks4"], log
    for point in points:
        ranks = int(point.rsplit("ranks", 1)[1])
        assert (out / point / "SWEEP_DONE").exists()
        assert sorted(p.name for p in (out / point).glob("rank-*")) == [f"rank-{i}" for i in range(ranks)]
        assert (out / point / "rank-0").read_text().split() == ["1", str(ranks)]
