"""`hpcfl report`: rounds and bytes to a target, the speed-up over FedAvg, drift and conformal figures."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from hpcfl.report.summary import RunSummary
from hpcfl.report.targets import cumulative_bytes, rounds_to_target, target_rows


def _run(
    name: str, algorithm: str, accs: list[float], *, every: int = 1, per_round: float = 100.0
) -> RunSummary:
    rows = [
        {"round": every * (i + 1), "test_accuracy": a, "bytes_up": per_round, "bytes_down": per_round / 2}
        for i, a in enumerate(accs)
    ]
    return RunSummary(name, algorithm, "dir:0.1", rows[-1]["round"], accs[-1], max(accs), 0.0, rows)


def test_bytes_to_target_charge_every_round_between_logged_rows() -> None:
    run = _run("a", "fedpvr", [0.2, 0.5, 0.7], every=5)
    assert cumulative_bytes(run.rows) == [750.0, 1500.0, 2250.0]
    assert rounds_to_target(run, 0.5) == (10, 1500.0)
    assert rounds_to_target(run, 0.9) == (None, None)


def test_speedup_is_against_the_fedavg_run_of_the_same_partition() -> None:
    fedavg = _run("fa", "fedavg", [0.1, 0.3, 0.5, 0.6, 0.7, 0.8])
    pvr = _run("pvr", "fedpvr", [0.3, 0.6, 0.8])
    slow = _run("slow", "scaffold", [0.1, 0.2, 0.3])
    rows = {t.run.name: t for t in target_rows([pvr, fedavg, slow], 0.6)}
    assert rows["fa"].rounds == 4 and rows["fa"].speedup == 1.0
    assert rows["pvr"].rounds == 2 and rows["pvr"].speedup == 2.0 and rows["pvr"].baseline == "fa"
    assert rows["slow"].rounds is None and rows["slow"].speedup is None


def test_report_of_real_runs_has_targets_drift_heatmap_and_conformal_curves(tmp_path: Path) -> None:
    from hpcfl.config import load_config
    from hpcfl.runner.experiment import run_experiment
    from tests.helpers import run_cli, synthetic_config

    dirs = []
    for algo in ("fedavg", "fedpvr"):
        (tmp_path / algo).mkdir()
        cfg = synthetic_config(
            tmp_path / algo,
            name=algo,
            algorithm=algo,
            rounds=3,
            drift_diversity=True,
            conformal=True,
            dataset_options={"n_train": 600, "n_test": 200, "seed": 3},
        )
        run_experiment(load_config(cfg), tmp_path / algo / "run")
        dirs.append(tmp_path / algo / "run")
    proc = run_cli("report", *map(str, dirs), "--out", str(tmp_path / "rep"), "--target", "1")
    assert proc.returncode == 0, proc.stderr
    rep = tmp_path / "rep"
    for f in (
        "report.md",
        "report.csv",
        "targets.csv",
        "accuracy.png",
        "drift_diversity.png",
        "conformal.png",
    ):
        assert (rep / f).stat().st_size > 0, f
    targets = {r["run"]: r for r in csv.DictReader((rep / "targets.csv").open())}
    # every run clears 1% in its first round: bytes are that round's traffic, speed-up 1
    for algo, run_dir in zip(("fedavg", "fedpvr"), dirs, strict=True):
        first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
        assert int(targets[algo]["rounds_to_target"]) == 1
        assert float(targets[algo]["bytes_to_target"]) == first["bytes_up"] + first["bytes_down"]
        assert float(targets[algo]["speedup_vs_fedavg"]) == 1.0
    # FedPVR sends a control variate beside the model (on the MLP every Linear layer is trailing,
    # so it covers the whole model: twice FedAvg's traffic, counted)
    assert float(targets["fedpvr"]["bytes_to_target"]) > float(targets["fedavg"]["bytes_to_target"])
    md = (rep / "report.md").read_text()
    assert "Rounds to 1% test accuracy" in md and "LAC 90%" in md
    assert sum(1 for _ in csv.DictReader((rep / "conformal.csv").open())) == 2 * 2 * 3


@pytest.mark.parametrize("target", ["0", "150"])
def test_target_out_of_range_is_one_line(tmp_path: Path, target: str) -> None:
    from tests.helpers import run_cli

    proc = run_cli("report", str(tmp_path), "--target", target)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "--target" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
