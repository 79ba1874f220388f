"""What bit-identity needs, recorded and compared (issue 26, item 3).

``hpcfl run`` with 2 threads and ``mpiexec -n 2 hpcfl run`` with 1 thread per rank of the same
config differ in the last bits; nothing said so. Every run now writes the threads of each rank,
``reduction``, ``client_batch`` and the device to ``determinism.json``; a resume with other values
and ``hpcfl report`` of same-config runs that differ in them name the difference.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

from hpcfl.cli.main import main
from hpcfl.runner.determinism import differences, read_record
from tests.conftest import REPO
from tests.helpers import mpiexec_cmd, synthetic_config


def test_run_records_the_threads_of_every_rank(tmp_path):
    cfg = synthetic_config(tmp_path, rounds=1, algorithm="fedavg", threads=2)
    run = tmp_path / "run"
    assert main(["run", str(cfg), "--run-dir", str(run)]) == 0
    assert read_record(run) == {
        "threads_per_rank": [2],
        "ranks": [{"host": socket.gethostname(), "local_rank": 0, "device": "cpu"}],
        "reduction": "float64",
        "client_batch": "auto",  # the default: one by one on the CPU, recorded as the size used
        "client_batch_used": 1,
        "client_threads": 1,
        "device": "cpu",
        "comm_timeout": "auto",
        "comm_timeout_from": "config",
        "comm_knock_after_s": 20.0,
        "comm_lost_noticed_within_s": 35.0,
    }


def test_resume_names_each_setting_that_differs(tmp_path, capsys):
    cfg = synthetic_config(tmp_path, rounds=3, algorithm="fedavg")
    run = tmp_path / "run"
    assert main(["run", str(cfg), "--run-dir", str(run), "--set", "rounds=1"]) == 0
    capsys.readouterr()
    assert main(["run", str(cfg), "--run-dir", str(run), "--resume", "--set", "rounds=2"]) == 0
    assert "note" not in capsys.readouterr().err  # the same settings: nothing to say
    assert main(["run", str(cfg), "--run-dir", str(run), "--resume", "--set", "client_batch=1"]) == 0
    assert "note" not in capsys.readouterr().err  # auto is 1 on the CPU: the same training
    argv = ["run", str(cfg), "--run-dir", str(run), "--resume", "--set", "threads=2", "client_batch=2"]
    assert main(argv) == 0
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("hpcfl: note:")]
    assert notes == [
        f"hpcfl: note: resuming {run} with other settings than it began with (threads 2 thread(s) per "
        "rank on 1 rank(s), the run began with 1 thread(s) per rank on 1 rank(s); client_batch 2, the run "
        "began with auto (1)): results stay valid but are not bit-identical to an uninterrupted run"
    ]  # issue 44: "began with" is the start's record (auto), not the previous resume's client_batch=1
    # issue 44: the record keeps what the run BEGAN with (it was overwritten by each resume, so a
    # later resume's note named the previous resume's settings as the start)
    assert read_record(run)["threads_per_rank"] == [1]
    argv = ["run", str(cfg), "--run-dir", str(run), "--resume", "--set", "rounds=4", "threads=2"]
    assert main(argv) == 0
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("hpcfl: note:")]
    assert len(notes) == 1 and "the run began with 1 thread(s) per rank" in notes[0], notes


def test_client_threads_matter_only_through_the_threads_a_client_trains_on():
    one = {"threads_per_rank": [1], "reduction": "float64", "client_batch": "1", "device": "cpu"}
    assert differences(one, {**one, "client_threads": 2}) == []  # 1 // 2: still 1 thread per client
    two = {**one, "threads_per_rank": [2]}
    assert differences(two, {**two, "client_threads": 2}) == ["client_threads 1 vs 2"]  # 2 vs 1 each


def test_rank_count_matters_only_with_float32_sums():
    one = {"threads_per_rank": [1], "reduction": "float64", "client_batch": "1", "device": "cpu"}
    two = {**one, "threads_per_rank": [1, 1]}
    assert differences(one, two) == []  # float64 sums: placement-independent
    assert differences({**one, "reduction": "float32"}, {**two, "reduction": "float32"}) == [
        "threads 1 thread(s) per rank on 1 rank(s) vs 1 thread(s) per rank on 2 rank(s)"
    ]


@pytest.mark.slow
def test_one_process_and_two_ranks_are_compared_by_report(tmp_path, capsys):
    """The issue's case: the same config (threads unset) on 1 process and on 2 ranks of this node;
    ``hpcfl report`` names the thread counts, and runs that agree get no note."""
    cfg = synthetic_config(tmp_path, rounds=1, algorithm="fedavg", threads=None)
    one, two, again = tmp_path / "one", tmp_path / "two", tmp_path / "again"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for argv in (
        mpiexec_cmd(2, "run", str(cfg), "--run-dir", str(two)),
        mpiexec_cmd(1, "run", str(cfg), "--run-dir", str(one), "--set", "comm=local", "threads=2"),
    ):
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
    cores = len(os.sched_getaffinity(0))
    assert read_record(two)["threads_per_rank"] == [max(1, cores // 2)] * 2
    capsys.readouterr()
    assert main(["report", str(one), str(two), "--out", str(tmp_path / "rep")]) == 0
    err = capsys.readouterr().err
    if cores // 2 != 2:
        assert (
            f"hpcfl: note: {one} and {two} share a config but ran with threads 2 thread(s) per rank on 1 "
            f"rank(s) vs {max(1, cores // 2)} thread(s) per rank on 2 rank(s)"
        ) in err
    assert main(["run", str(cfg), "--run-dir", str(again), "--set", "threads=2"]) == 0
    capsys.readouterr()
    assert main(["report", str(one), str(again), "--out", str(tmp_path / "rep2")]) == 0
    assert "note" not in capsys.readouterr().err
    assert json.loads((one / "determinism.json").read_text()) == read_record(again)


def test_threads_beyond_the_machine_are_bounded_with_a_note(tmp_path):
    """Issue 44: ``threads: 100000`` segfaulted inside torch with no message; the threads are now
    bounded by the cores this process may use, with one note, and the run records what it used."""
    from tests.helpers import run_cli

    cores = len(os.sched_getaffinity(0))
    cfg = synthetic_config(tmp_path, rounds=1, algorithm="fedavg", threads=100000)
    run = tmp_path / "run"
    proc = run_cli("run", str(cfg), "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr
    # (a busy host adds the oversubscription note, tested in test_cpu_contention.py: not this test's)
    notes = [ln for ln in proc.stderr.splitlines() if ln.startswith("hpcfl: note:") and "busy" not in ln]
    assert notes == [
        f"hpcfl: note: threads: 100000 is more than the {cores} cores this process may use; using {cores}"
    ]
    assert read_record(run)["threads_per_rank"] == [cores]


def test_the_entk_costs_a_run_is_given_are_recorded_and_bad_ones_refused(tmp_path, capsys, monkeypatch):
    """``$HPCFL_ENTK_COSTS`` chooses each layer's eNTK form, so it changes TCT's stage 2 (issue 51):
    the run's record holds the file and its constants, a resume without it says so, and a NaN or
    negative constant is one line before any work (it was accepted)."""
    from hpcfl.entk import costs
    from tests.helpers import one_line_error

    fitted = {**costs.CPU_COSTS, "mac": 0.05}
    good = tmp_path / "costs.json"
    good.write_text(json.dumps({"device": "cpu", "fitted": fitted}))
    monkeypatch.setenv(costs.COSTS_ENV, str(good))
    costs.fitted_file.cache_clear()
    cfg = synthetic_config(tmp_path, rounds=2, algorithm="fedavg")
    run = tmp_path / "run"
    assert main(["run", str(cfg), "--run-dir", str(run), "--set", "rounds=1"]) == 0
    assert read_record(run)["entk_costs"] == {"file": str(good), "device_type": "cpu", "fitted": fitted}
    monkeypatch.delenv(costs.COSTS_ENV)
    capsys.readouterr()
    assert main(["run", str(cfg), "--run-dir", str(run), "--resume"]) == 0
    assert f"HPCFL_ENTK_COSTS unset, the run began with {good}" in capsys.readouterr().err
    for i, value in enumerate((float("nan"), -1.0)):
        bad = tmp_path / f"bad{i}.json"
        bad.write_text(json.dumps({"device": "cuda", "fitted": {**costs.CUDA_COSTS, "mac": value}}))
        monkeypatch.setenv(costs.COSTS_ENV, str(bad))
        line = one_line_error(capsys, ["run", str(cfg), "--run-dir", str(tmp_path / f"r{i}")])
        assert f"fitted constant 'mac' is {value}" in line and "entk_layer_costs.py" in line
        assert not (tmp_path / f"r{i}" / "metrics.jsonl").exists()
    costs.fitted_file.cache_clear()


def test_a_tct_run_records_the_entk_path_it_used(tmp_path, capsys, monkeypatch):
    """Issue 55: the eNTK path's settings are config keys (``entk:``), each overridden by its
    environment variable, and a run that computes eNTK features records the EFFECTIVE values, their
    sources and the method; the costs file named by the config is the one in force (its constants
    recorded), and a resume with autotuning switched says so."""
    from hpcfl.entk import costs, settings
    from tests.helpers import tiny_tct_config

    for name in (costs.COSTS_ENV, settings.CUDA_GRAPH_ENV, settings.AUTOTUNE_ENV):
        monkeypatch.delenv(name, raising=False)
    fitted = {**costs.CPU_COSTS, "term": 2.0}
    table = tmp_path / "costs.json"
    table.write_text(json.dumps({"device": "cpu", "fitted": fitted}))
    costs.fitted_file.cache_clear()
    monkeypatch.setenv(settings.AUTOTUNE_ENV, "1")  # overrides the config's false
    cfg = tiny_tct_config(tmp_path)
    run = tmp_path / "run"
    sets = [
        f"entk.costs={table}",
        "entk.cuda_graph=true",
        "entk.triton_autotune=false",
        "entk.native=false",
        "stage2.method=fused",
    ]
    assert main(["run", str(cfg), "--run-dir", str(run), "--set", *sets]) == 0
    record = read_record(run)
    assert record["entk"] == {
        "method": "fused",
        "costs": str(table),
        "costs_from": "config",
        "cuda_graph": True,
        "cuda_graph_from": "config",
        "triton_autotune": True,
        "triton_autotune_from": "HPCFL_TRITON_AUTOTUNE",
        "native": False,
        "native_from": "config",
        "native_kernel": "off: switched off (config)",
    }
    assert record["entk_costs"] == {"file": str(table), "device_type": "cpu", "fitted": fitted}
    assert (run / "features.zarr").exists()  # the run computed eNTK features under these settings
    assert settings.active() == settings.resolve(), "the run's settings are no longer in force"
    monkeypatch.delenv(settings.AUTOTUNE_ENV)
    capsys.readouterr()
    assert main(["run", str(cfg), "--run-dir", str(run), "--resume", "--set", *sets, "rounds=1"]) == 0
    assert "entk.triton_autotune False, the run began with True" in capsys.readouterr().err
    costs.fitted_file.cache_clear()


def test_an_ntkfl_run_records_its_jacobian_method_and_fedavg_none(tmp_path):
    """NTK-FL's Jacobians are on the eNTK path too (its ``params.jacobian`` is the method); an
    algorithm that computes neither records no ``entk`` entry (test above: FedAvg's exact record)."""
    cfg = synthetic_config(
        tmp_path,
        rounds=1,
        algorithm="ntkfl",
        dataset_options={"n_train": 200, "n_test": 100, "seed": 3},
        params={"grid": [10, 20], "jacobian": "fused"},
    )
    run = tmp_path / "run"
    assert main(["run", str(cfg), "--run-dir", str(run)]) == 0
    entk = read_record(run)["entk"]
    assert entk["method"] == "fused" and entk["costs"] is None and entk["costs_from"] == "config"
