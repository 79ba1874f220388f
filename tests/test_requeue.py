"""The requeue after a lost peer against a real SLURM (issue 61): asked once, never twice by a stale
copy of the run, and asked again while the controller does not answer (a batch host cut off).

:func:`hpcfl.launch.requeue.requeue_lost_peer` (``hpcfl submit``'s speaking rank) and the shell
function of the same name in ``slurm/cpu.sbatch`` / ``gpu.sbatch`` follow one rule; both are run
here against the session's single-node SLURM.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.cluster import slurm as cluster_module
from tests.cluster.slurm import REPO, SlurmCluster

pytestmark = pytest.mark.slurm

slurm_cluster = cluster_module.slurm_cluster
slurm_env = cluster_module.slurm_env


def _shell_requeue(job: str, restart_count: int, **env: str) -> str:
    """The batch scripts' ``requeue_lost_peer`` run for ``job`` as run ``restart_count`` would; its output."""
    text = (REPO / "slurm" / "cpu.sbatch").read_text()
    start = text.index("requeue_lost_peer() {")
    function = text[start : text.index("\n}\n", start) + 3]
    script = f"{function}\nrequeue_lost_peer\n"
    environ = {
        **os.environ,
        "SLURM_JOB_ID": job,
        "SLURM_RESTART_COUNT": str(restart_count),
        **env,
    }
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=environ, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.mark.parametrize("how", ["python", "shell"])
def test_a_lost_peer_requeues_once_and_a_stale_copy_does_not(
    slurm_env: SlurmCluster, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    from hpcfl.launch.requeue import requeue_lost_peer, restarts

    job = slurm_env.sbatch(wrap="sleep 300", args=["-n1", "-c1", "--requeue"])
    try:
        slurm_env.wait_state(job, ["RUNNING"], timeout=60)
        lines: list[str] = []

        def ask(run: int) -> None:
            if how == "shell":
                out = _shell_requeue(job, run, HPCFL_STALE_WAIT="0")
                lines.extend(out.splitlines())
            else:
                monkeypatch.setenv("SLURM_RESTART_COUNT", str(run))
                requeue_lost_peer(job, stale_wait_s=0, say=lines.append)

        ask(0)  # run 0 lost a peer: the job is requeued
        assert (restarts(job), lines) == (1, [])
        ask(0)  # run 0 again, after the requeue (a stale copy): it does not requeue the rerun
        assert restarts(job) == 1
        assert lines == [
            f"hpcfl: job {job} was requeued by SLURM meanwhile; "
            + ("this run's script waits to be ended" if how == "shell" else "this run waits to be ended")
        ]
    finally:
        slurm_env.run("scancel", job, check=False)


@pytest.mark.parametrize("how", ["python", "shell"])
def test_a_controller_out_of_reach_is_asked_again_then_named(
    slurm_env: SlurmCluster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, how: str
) -> None:
    """What a batch host whose link was cut sees: no controller. Asked again until the wait ends."""
    from hpcfl.launch.requeue import requeue_lost_peer

    conf = Path(slurm_env.env["SLURM_CONF"]).read_text()
    port = cluster_module._free_port()  # nothing listens there
    (tmp_path / "slurm.conf").write_text(re.sub(r"(?m)^SlurmctldPort=\d+", f"SlurmctldPort={port}", conf))
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    if how == "shell":
        out = _shell_requeue("4242", 0, HPCFL_REQUEUE_WAIT="1", SLURM_CONF=str(tmp_path / "slurm.conf"))
        assert out == "hpcfl: the controller did not answer for 1 s; resume with: scontrol requeue 4242"
    else:
        lines: list[str] = []
        requeue_lost_peer("4242", wait_s=1, poll_s=1, say=lines.append)
        assert lines == ["hpcfl: the controller did not answer for 1 s; resume with: scontrol requeue 4242"]
