"""Files hpcfl did not write, or not for this run (issue 44, "Tracebacks instead of one line"):
a checkpoint of another run, a garbled client-state store, a sweep manifest pointing outside the
sweep, and metrics rows ``report``/``status`` cannot use. Each is one line naming the file and the
problem; a checkpoint falls back to the older one, rows are skipped and the rest is reported."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from hpcfl.cli.main import main
from hpcfl.config import load_config
from hpcfl.report import summarise
from hpcfl.runner import run_experiment
from tests.helpers import final_state, one_line_error, synthetic_config


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# a checkpoint that passes the zip check but is not this run's


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A FedAvg run stopped after round 2 of 3, the uninterrupted reference, and a SCAFFOLD run."""
    base = tmp_path_factory.mktemp("ckpt")
    cfg = synthetic_config(base, algorithm="fedavg", rounds=3)
    ref = run_experiment(load_config(cfg), base / "ref")
    assert main(["run", str(cfg), "--run-dir", str(base / "run"), "--set", "rounds=2"]) == 0
    assert main(["run", str(cfg), "--run-dir", str(base / "scaffold"), "--set", "algorithm=scaffold"]) == 0
    torch.save(ref.server.x, base / "ref_x.pt")
    return {"cfg": cfg, "run": base / "run", "scaffold": base / "scaffold", "ref_x": base / "ref_x.pt"}


def _foreign_server(kind: str, runs: dict[str, Path], dest: Path) -> str:
    """Replace ``dest`` (a server.pt) by a zip-intact file of another run; the expected mismatch."""
    if kind == "pickled_object":
        torch.save({"round": 2, "server": {}, "extra": {}, "args": argparse.Namespace(lr=0.1)}, dest)
        return "it holds pickled objects (argparse.Namespace) that a checkpoint never holds"
    if kind == "other_layout":
        torch.save({"round": 2, "state": {"x": torch.zeros(3)}}, dest)
        return "it has no 'server', 'extra': another file layout"
    shutil.copy(runs["scaffold"] / "checkpoints" / "round_000002" / "server.pt", dest)
    return "its server state has fields c, x; this run's algorithm has x"


@pytest.mark.parametrize("kind", ["pickled_object", "other_layout", "other_algorithm"])
def test_checkpoint_of_another_run_falls_back_to_the_older_one(runs, tmp_path, capsys, kind):
    run = tmp_path / "run"
    shutil.copytree(runs["run"], run)
    what = _foreign_server(kind, runs, run / "checkpoints" / "round_000002" / "server.pt")
    capsys.readouterr()
    assert main(["run", str(runs["cfg"]), "--run-dir", str(run), "--resume", "--set", "rounds=3"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert (
        f"hpcfl: note: the newest checkpoint is damaged (round_000002/server.pt is not this run's: {what}"
    ) in err
    assert "resuming from the older complete checkpoint round_000001" in err
    assert torch.equal(final_state(run), torch.load(runs["ref_x"], weights_only=True))  # bit for bit
    assert [r["round"] for r in _rows(run)] == [1, 2, 3]


def test_no_checkpoint_of_this_run_left_is_one_line(runs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs["run"], run)
    for r in ("round_000001", "round_000002"):
        _foreign_server("other_algorithm", runs, run / "checkpoints" / r / "server.pt")
    err = one_line_error(capsys, ["run", str(runs["cfg"]), "--run-dir", str(run), "--resume"])
    assert err == (
        "hpcfl: error: cannot resume: round_000002/server.pt is not this run's: its server state has fields "
        "c, x; this run's algorithm has x, and no older complete checkpoint is sound; start over with "
        "--overwrite"
    )


def test_client_file_of_another_algorithm_falls_back(tmp_path, capsys):
    cfg = synthetic_config(tmp_path, rounds=2)  # SCAFFOLD: client files hold c_k
    run = tmp_path / "run"
    assert main(["run", str(cfg), "--run-dir", str(run)]) == 0
    client = run / "checkpoints" / "round_000002" / "clients" / "client_1.pt"
    torch.save({"previous": torch.zeros(3)}, client)  # a MOON-like state
    capsys.readouterr()
    assert main(["run", str(cfg), "--run-dir", str(run), "--resume", "--set", "rounds=3"]) == 0
    err = capsys.readouterr().err
    assert (
        "round_000002/clients/client_1.pt is not this run's: its client state has fields previous; "
        "this run's algorithm has h, last_local"
    ) in err
    assert [r["round"] for r in _rows(run)] == [1, 2, 3]


# the client-state store


@pytest.mark.parametrize("member", ["field_h", "present", "crc32"])
def test_garbled_zarr_json_of_a_client_state_array_is_one_line(tmp_path, capsys, member):
    cfg = synthetic_config(tmp_path, rounds=2, client_state_memory="disk")
    run = tmp_path / "run"
    assert main(["run", str(cfg), "--run-dir", str(run)]) == 0
    meta = run / "client_states_train.zarr" / member / "zarr.json"
    meta.write_text(meta.read_text()[:27])
    err = one_line_error(capsys, ["run", str(cfg), "--run-dir", str(run), "--resume", "--set", "rounds=3"])
    assert err.startswith(f"hpcfl: error: {meta} of the client-state store is damaged (JSONDecodeError")
    assert err.endswith(
        "restore that file, or delete the store and resume with --reset-client-states naming every client (they start again)"
    )
    # the way out it names works
    shutil.rmtree(run / "client_states_train.zarr")
    argv = ["run", str(cfg), "--run-dir", str(run), "--resume", "--reset-client-states", "0,1,2,3"]
    assert main([*argv, "--set", "rounds=3"]) == 0
    assert [r["round"] for r in _rows(run)] == [1, 2, 3]


# a sweep manifest


def test_sweep_point_outside_the_sweep_is_refused(tmp_path, capsys):
    cfg = synthetic_config(tmp_path, rounds=1, algorithm="fedavg")
    out = tmp_path / "sweep"
    assert main(["sweep", str(cfg), "--out", str(out), "--seeds", "2"]) == 0
    other = tmp_path / "elsewhere"
    shutil.copytree(out / "runs" / "seed=7", other)
    manifest = json.loads((out / "sweep.json").read_text())
    manifest["points"][0]["run_dir"] = str(other)
    (out / "sweep.json").write_text(json.dumps(manifest))
    want = (
        f"hpcfl: error: {out / 'sweep.json'}: point 'seed=7' names run directory {str(other)!r}, outside "
        "the sweep; set it back to runs/seed=7 (or remove sweep.json and re-run the hpcfl sweep command "
        "that made it)"
    )
    for argv in (["status", str(out)], ["report", str(out), "--out", str(tmp_path / "rep")]):
        assert one_line_error(capsys, argv) == want
    assert one_line_error(capsys, ["sweep", str(cfg), "--out", str(out), "--seeds", "3"]) == want
    manifest["points"][0]["run_dir"] = "runs/../../elsewhere"
    (out / "sweep.json").write_text(json.dumps(manifest))
    assert "outside the sweep" in one_line_error(capsys, ["status", str(out)])


# rows report and status did not write


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("rows")
    run = base / "run"
    assert (
        main(["run", str(synthetic_config(base, algorithm="fedavg", rounds=3)), "--run-dir", str(run)]) == 0
    )
    return run


_BAD_ROWS = {
    "round_text": ({"round": "two"}, "'round' is 'two', not a round number"),
    "accuracy_text": ({"test_accuracy": "high"}, "'test_accuracy' is 'high', not a finite number"),
    "accuracy_nan": ({"test_accuracy": float("nan")}, "'test_accuracy' is nan, not a finite number"),
    "seconds_inf": ({"seconds": float("inf")}, "'seconds' is inf, not a finite number"),
    "no_round": ({"round": None}, "it has no 'round'"),
    "no_accuracy": ({"test_accuracy": None}, "it has no 'test_accuracy'"),
    "non_utf8": (None, "is damaged and was skipped"),
}


def test_report_and_status_skip_rows_they_did_not_write(finished, tmp_path, capsys):
    """Every kind of foreign row at once between the run's first and last rows: each is named with
    its line and skipped; the report and status are made of the two rows hpcfl wrote."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    lines = (run / "metrics.jsonl").read_bytes().splitlines()
    bad = []
    for change, _ in _BAD_ROWS.values():
        if change is None:
            bad.append(lines[1].replace(b'"stage": "train"', b'"stage": "tr\xff\xfein"'))
        else:
            row = {**json.loads(lines[1]), **change}
            bad.append(json.dumps({k: v for k, v in row.items() if v is not None}).encode())
    (run / "metrics.jsonl").write_bytes(b"\n".join([lines[0], *bad, lines[2]]) + b"\n")
    good = [json.loads(lines[0]), json.loads(lines[2])]
    capsys.readouterr()
    summary = summarise(run)  # the rows the report is made of
    assert [r["round"] for r in summary.rows] == [1, 3]
    assert summary.final_accuracy == good[1]["test_accuracy"]
    assert summary.best_accuracy == max(r["test_accuracy"] for r in good)
    notes = capsys.readouterr().err.splitlines()
    want = []
    for number, (change, problem) in enumerate(_BAD_ROWS.values(), start=2):
        where = f"hpcfl: note: {run / 'metrics.jsonl'} line {number}"
        want.append(f"{where} {problem}" if change is None else f"{where} was skipped: {problem}")
    assert notes == want
    assert main(["report", str(run), "--out", str(tmp_path / "rep")]) == 0
    out, err = capsys.readouterr()
    assert (
        "Traceback" not in err
        and f"{100 * good[1]['test_accuracy']:.2f}%" in (tmp_path / "rep" / "report.md").read_text()
    )
    assert main(["status", str(run)]) == 0
    out, err = capsys.readouterr()
    assert f"rounds   3/3  test accuracy {good[1]['test_accuracy']}" in out
    assert err.splitlines() == want
