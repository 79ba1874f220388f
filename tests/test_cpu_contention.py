"""A shared CPU node (issue 44, "CPU contention"): OpenMP threads that spin while descheduled made
rounds 30-50x slower. hpcfl asks OpenMP to wait passively when other work keeps the node busy (only
before torch loads, never over the user's own setting) and says once, with the remedy, when a run's
threads oversubscribe the free cores. No clock is asserted: the busy cores are given."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hpcfl import node
from hpcfl.cli.main import main
from tests.helpers import REPO, synthetic_config


@pytest.mark.parametrize(
    ("threads", "ranks", "cores", "busy", "says"),
    [
        (2, 1, 2, 1.9, True),  # the case: another job on the 2 cores
        (2, 1, 2, 0.3, False),  # a little background work: every thread still has a core
        (1, 1, 2, 2.0, False),  # the remedy itself is never warned about
        (4, 2, 8, 1.0, True),  # 2 ranks x 4 threads on the 7 free cores of 8
        (4, 2, 16, 1.0, False),
        (2, 1, 2, None, False),  # nothing could be read: no guess
    ],
)
def test_oversubscription_note(threads, ranks, cores, busy, says):
    note = node.oversubscription_note(threads, ranks, cores, busy)
    assert (note is not None) == says
    if says:
        assert note.startswith(f"hpcfl: note: other work keeps {busy:.1f} of this node's {cores} cores busy")
        assert note.endswith("set threads: 1 (--set threads=1) while the node is shared")


@pytest.mark.parametrize(
    "line",
    [
        "cpu0 5 1 2\n",  # short: no idle column (an IndexError before issue 51)
        "cpu0 5 x 2 90 1 0 0 0\n",  # not a number (a ValueError)
        "cpu0\n",
    ],
)
def test_a_short_or_garbled_proc_stat_reads_as_unknown(tmp_path, line):
    """/proc/stat is read before any command runs: a line it cannot parse means "unknown" (no
    contention measured, nothing changed), never a traceback."""
    stat = tmp_path / "stat"
    good = "cpu1 10 0 5 100 1 0 0 0 0 0\n"
    stat.write_text(f"cpu  1 2 3 4\n{line}{good}")
    assert node._cpu_ticks([0, 1], stat) is None
    assert node._cpu_ticks([1], stat) == (15, 116)  # busy: 116 ticks but idle 100 and iowait 1
    stat.write_bytes(b"cpu0 \xff\xfe\n")
    assert node._cpu_ticks([0], stat) is None


def _choose(busy: float | None, environ: dict[str, str]) -> dict:
    """choose_wait_policy in a fresh interpreter (torch not loaded yet, as in the hpcfl command)."""
    code = (
        "import json, sys\n"
        "import hpcfl.node as n\n"
        f"n.busy_cores = lambda interval=0.3: {busy!r}\n"
        f"env = {environ!r}\n"
        "chosen = n.choose_wait_policy(env)\n"
        "print(json.dumps({'chosen': chosen, 'env': env, 'torch': 'torch' in sys.modules}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True, timeout=120
    )
    return json.loads(out.stdout)


@pytest.mark.skipif(len(node.allowed_cores()) < 2, reason="one core: no OpenMP threads to wait")
def test_wait_policy_is_passive_only_on_a_busy_node_and_never_over_the_users():
    assert _choose(1.9, {}) == {"chosen": True, "env": {"OMP_WAIT_POLICY": "PASSIVE"}, "torch": False}
    assert _choose(0.2, {}) == {"chosen": False, "env": {}, "torch": False}  # idle: OpenMP's default
    assert _choose(None, {}) == {"chosen": False, "env": {}, "torch": False}
    mine = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert _choose(1.9, mine) == {"chosen": False, "env": mine, "torch": False}


def test_wait_policy_is_left_alone_once_torch_is_loaded(monkeypatch):
    import torch  # noqa: F401 - loaded, as in this test process: too late to choose

    monkeypatch.setattr(node, "busy_cores", lambda interval=0.3: 2.0)
    env: dict[str, str] = {}
    assert node.choose_wait_policy(env) is False and env == {}


def test_run_with_more_threads_than_free_cores_says_so_once(tmp_path, capsys, monkeypatch):
    sampled = []

    def busy(interval: float = 0.3) -> float:
        sampled.append(interval)
        return 1.8

    import torch

    monkeypatch.setattr(node, "busy_cores", busy)
    monkeypatch.setattr(node, "allowed_cores", lambda: [0, 1])
    cfg = synthetic_config(tmp_path, rounds=1, threads=2, algorithm="fedavg")
    threads = torch.get_num_threads()
    try:
        assert main(["run", str(cfg), "--run-dir", str(tmp_path / "two")]) == 0
    finally:
        torch.set_num_threads(threads)  # process-wide: the next test starts as it would have
    notes = [ln for ln in capsys.readouterr().err.splitlines() if "oversubscribe" in ln]
    assert notes == [
        "hpcfl: note: other work keeps 1.8 of this node's 2 cores busy, so 2 torch threads oversubscribe it "
        "and rounds can take many times longer; set threads: 1 (--set threads=1) while the node is shared"
    ]
    sampled.clear()
    assert main(["run", str(cfg), "--run-dir", str(tmp_path / "one"), "--set", "threads=1"]) == 0
    assert "oversubscribe" not in capsys.readouterr().err
    assert sampled == []  # one thread: nothing to measure, no 0.3 s spent
