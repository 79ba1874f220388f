"""More than one node: hpcfl on an emulated 2-node SLURM cluster (``-m multinode``).

Each node is a network + UTS + mount namespace of its own (:mod:`hpcfl.testing.netns`: hostname,
address on a bridge, ``/dev/shm``, boot id) with its own ``slurmd``; the controller and accounting
sit in a head namespace, where the client commands (``hpcfl submit``, ``sbatch``) run as on a login
node. MPI between the nodes crosses the veth links over TCP (MPICH's UCX sees two hosts); the tests
show it from the links' byte counters instead of assuming it.

What is checked: ``hpcfl submit --nodes 2 --ntasks-per-node 2`` is bit-identical to one rank and
records its layout (hosts, node-local ranks, devices); the node-local rank drives the GPU index
(fake accelerator); the sbatch templates and a sweep's job array on two nodes; TCT's feature
store, the run lock, checkpoints and client-state stores with writers on both hosts; a lost node
or a cut link ends the job within the collective deadline in one line and the rerun resumes
bit-identically; a slow or lossy link changes the time, not the results.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("submitit")

from tests.helpers import final_state, hpcfl_cmd, repo_env, run_cli, synthetic_config  # noqa: E402
from tests.slurm_cluster import SlurmCluster, ensure_packages, start_cluster  # noqa: E402

pytestmark = [pytest.mark.multinode, pytest.mark.slurm]

REPO = Path(__file__).resolve().parents[1]


def _skip_reason() -> str | None:
    from hpcfl.testing.netns import namespaces_available

    return namespaces_available()


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    """Two emulated nodes on 10 Gb/s-shaped links, for this module."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    ensure_packages(accounting=True)
    c = start_cluster(nodes=2, link="10gbe")
    print(f"\n[multinode] 2 nodes up in {c.timings['total']:.1f}s at {c.tmpdir}")
    try:
        yield c
    finally:
        c.stop()


def cli(cluster: SlurmCluster, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m hpcfl ARGS`` on the head namespace (the login node) against the cluster."""
    return subprocess.run(
        [*cluster.prefix, *hpcfl_cmd(*args)],
        capture_output=True,
        text=True,
        env=repo_env(**cluster.env),
        timeout=timeout,
    )


def _wait_for(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.3) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached within {timeout:.0f} s")
        time.sleep(interval)


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _results(run_dir: Path) -> list[dict]:
    """The rows' deterministic columns (what hpcfl promises is the same on any layout; the loss is
    a float32 sum over evaluation shards, which differs in the last bits with the rank count)."""
    keep = ("round", "test_accuracy", "participants", "work_steps", "bytes_up", "bytes_down")
    return [{k: r[k] for k in keep if k in r} for r in _rows(run_dir)]


def _layout(run_dir: Path) -> list[tuple[str, int, str]]:
    record = json.loads((run_dir / "determinism.json").read_text())
    return [(r["host"], r["local_rank"], r["device"]) for r in record["ranks"]]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The reference: the small config run in one process, no MPI."""
    tmp = tmp_path_factory.mktemp("one-rank")
    cfg = synthetic_config(tmp, rounds=3, num_clients=8, checkpoint_every=1)
    run_dir = tmp / "run"
    proc = run_cli("run", str(cfg), "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    return cfg, run_dir


def test_submit_on_two_nodes_is_bit_identical_to_one_rank(
    cluster: SlurmCluster, one_rank: tuple[Path, Path], tmp_path: Path
) -> None:
    cfg, reference = one_rank
    run_dir = tmp_path / "run"
    sent = [cluster.network.tx_bytes(i) for i in (1, 2)]
    proc = cli(
        cluster, "submit", str(cfg), "--run-dir", str(run_dir),
        "--nodes", "2", "--ntasks-per-node", "2", "-c", "1", "--time", "10", "--wait",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # 4 ranks, 2 per host, node-local ranks from the node's shared-memory communicator
    assert _layout(run_dir) == [
        ("node1", 0, "cpu"), ("node1", 1, "cpu"), ("node2", 0, "cpu"), ("node2", 1, "cpu"),
    ]  # fmt: skip
    # the rounds' allreduces crossed the links: at least one float64 model per round each way
    params = final_state(reference).numel()
    crossed = [cluster.network.tx_bytes(i) - s for i, s in zip((1, 2), sent, strict=True)]
    assert min(crossed) > 3 * 8 * params, crossed
    assert _results(run_dir) == _results(reference)
    assert torch.equal(final_state(run_dir), final_state(reference))
