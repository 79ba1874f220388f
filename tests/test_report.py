"""`hpcfl report`: rounds and bytes to a target, the speed-up over FedAvg, drift and conformal figures."""

from __future__ import annotations

import csv
import dataclasses
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


# ---------------------------------------------------------------------------------------------
# the comparison protocol: last-k mean ± std over seeds, rounds to target on a running mean


def test_rounds_to_target_on_the_running_mean_equals_numpy() -> None:
    """An oscillating run: a single spike to 0.6 at round 2 does not reach 0.5 on a mean of 3."""
    import numpy as np

    accs = [0.2, 0.6, 0.3, 0.55, 0.35, 0.6, 0.58, 0.62]
    run = _run("osc", "fedavg", accs, every=2)
    for window in (1, 2, 3, 5):
        for target in (0.3, 0.45, 0.5, 0.55, 0.9):
            smooth = [np.mean(accs[max(0, i - window + 1) : i + 1]) for i in range(len(accs))]
            hit = np.flatnonzero(np.asarray(smooth) >= target)
            want = (None, None) if hit.size == 0 else (2 * (hit[0] + 1), 150.0 * 2 * (hit[0] + 1))
            assert rounds_to_target(run, target, window=window) == want, (window, target)
    assert rounds_to_target(run, 0.5, window=1)[0] == 4
    assert rounds_to_target(run, 0.5, window=3)[0] == 12  # (0.55 + 0.35 + 0.6) / 3


def test_method_table_is_last_k_mean_and_std_over_seeds_of_metrics(tmp_path: Path) -> None:
    """Two seeds each of FedAvg and SCAFFOLD (control-variate form): methods.csv and report.md hold
    numpy's mean ± std (ddof 1) over seeds of each seed's mean test accuracy over its last k rows of
    metrics.jsonl, rounds to target on the running mean, and the form SCAFFOLD ran in."""
    import numpy as np

    from hpcfl.config import load_config
    from hpcfl.report import Protocol, write_report
    from hpcfl.runner.experiment import run_experiment
    from tests.helpers import synthetic_config

    dirs = []
    for algo, params in (("fedavg", {}), ("scaffold", {"form": "control_variates"})):
        for seed in (1, 2):
            here = tmp_path / f"{algo}{seed}"
            here.mkdir()
            cfg = synthetic_config(
                here, name=f"{algo}-s{seed}", algorithm=algo, rounds=5, seed=seed, params=params,
                dataset_options={"n_train": 600, "n_test": 200, "seed": 3},
            )  # fmt: skip
            run_experiment(load_config(cfg), here / "run")
            dirs.append(here / "run")
    protocol = Protocol(last_k=3, window=2)
    write_report(dirs, tmp_path / "rep", target=0.3, protocol=protocol)
    table = {r["method"]: r for r in csv.DictReader((tmp_path / "rep" / "methods.csv").open())}
    assert set(table) == {"fedavg", "scaffold (control_variates)"}
    md = (tmp_path / "rep" / "report.md").read_text()
    for label, run_dirs in (("fedavg", dirs[:2]), ("scaffold (control_variates)", dirs[2:])):
        accs = [
            [json.loads(x)["test_accuracy"] for x in (d / "metrics.jsonl").read_text().splitlines()]
            for d in run_dirs
        ]
        last = [np.mean(a[-3:]) for a in accs]
        row = table[label]
        assert int(row["n"]) == 2 and int(row["last_k"]) == 3
        assert float(row["last_k_mean"]) == pytest.approx(np.mean(last), abs=1e-12)
        assert float(row["last_k_std"]) == pytest.approx(np.std(last, ddof=1), abs=1e-12)
        reached = []
        for a in accs:
            smooth = np.convolve(a, np.ones(2) / 2)[: len(a)]
            smooth[0] = a[0]  # the first round's window holds one round
            hit = np.flatnonzero(smooth >= 0.3)
            reached += [hit[0] + 1] if hit.size else []
        assert int(row["reached"]) == len(reached)
        if reached:
            assert float(row["rounds_to_target_mean"]) == pytest.approx(np.mean(reached), abs=1e-12)
        assert (
            f"| {label} | dir:0.5 | 2 | {100 * np.mean(last):.2f} ± {100 * np.std(last, ddof=1):.2f} |" in md
        )
    assert md.index("last-3 test acc.") < md.index("final test acc.")  # the headline comes first


@pytest.mark.parametrize("option", ["--last", "--window"])
def test_last_and_window_below_one_are_one_line(tmp_path: Path, option: str) -> None:
    from tests.helpers import run_cli

    proc = run_cli("report", str(tmp_path), option, "0")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert option in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_benchmark_protocol_chooses_lr_on_last_k_validation_then_runs_the_seeds(tmp_path: Path) -> None:
    """benchmarks/_runs.py's run_protocol: every lr at the first seed, the choice the best last-2
    mean of val_accuracy (never test), the other seed only at the chosen lr."""
    import sys

    import numpy as np
    import yaml

    from tests.helpers import REPO, synthetic_config

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from _runs import Setting, run_dir_of, run_protocol
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    from hpcfl.report import Protocol

    base = yaml.safe_load(synthetic_config(tmp_path, rounds=3, validation=0.05).read_text())
    base = {k: v for k, v in base.items() if k not in ("lr", "seed", "name")}
    settings = [Setting(a, "dir:0.5", {**base, "algorithm": a}, (0.001, 0.05)) for a in ("fedavg", "fedprox")]
    cells = run_protocol(settings, seeds=[7, 8], out=tmp_path / "b", jobs=1, protocol=Protocol(last_k=2))
    for s, cell in zip(settings, cells, strict=True):
        val = {}
        for lr in s.lrs:
            rows = [json.loads(x) for x in (run_dir_of(tmp_path / "b", s, lr, 7) / "metrics.jsonl").open()]
            val[lr] = np.mean([r["val_accuracy"] for r in rows[-2:]])
        chosen = max(val, key=lambda lr: (val[lr], -lr))
        assert cell.choice is not None and cell.choice.value == chosen
        assert cell.choice.val_mean == pytest.approx(val[chosen], abs=1e-12)
        assert [r.config["seed"] for r in cell.runs] == [7, 8] and {r.config["lr"] for r in cell.runs} == {
            chosen
        }
        other = next(lr for lr in s.lrs if lr != chosen)
        assert not run_dir_of(tmp_path / "b", s, other, 8).exists()


def test_the_form_a_run_recorded_is_shown_over_its_configured_auto(tmp_path: Path) -> None:
    """``form: auto`` in config.yaml, ``scaffold_form`` in metrics.jsonl: the report shows the
    recorded form; without the column, the configured one."""
    import yaml

    from hpcfl.report import summarise

    for name, extra, want in (
        ("rec", {"scaffold_form": "control_variates"}, "control_variates"),
        ("cfg", {}, "auto"),
    ):
        run = tmp_path / name
        run.mkdir()
        cfg = {"name": name, "algorithm": "scaffold", "partition": "dir:0.5", "params": {"form": "auto"}}
        (run / "config.yaml").write_text(yaml.safe_dump(cfg))
        (run / "metrics.jsonl").write_text(json.dumps({"round": 1, "test_accuracy": 0.5, **extra}) + "\n")
        summary = summarise(run)
        assert summary.form == want and summary.label == f"scaffold ({want})"


def _tiny_tct(**extra: object) -> dict:
    """A TCT run of a few seconds: 2 FedAvg rounds, then 2 closed-form stage-2 rounds on p = 50."""
    return dict(
        name="tct",
        dataset="synthetic",
        dataset_options={"n_train": 240, "n_test": 60, "seed": 3, "input_shape": [1, 8, 8], "num_classes": 4},
        partition="dir:0.5",
        num_clients=4,
        model="mlp",
        algorithm="tct",
        local_steps=2,
        lr=0.05,
        batch_size=16,
        seed=0,
        threads=1,
        progress=False,
        params={"stage1": {"rounds": 2}, "stage2": {"p": 50, "rounds": 2, "local_steps": 20}},
        **extra,
    )


def _stop_after_rows(metrics: Path, rows: int):
    """A stop request raised once ``rows`` metrics rows are written (a signal during that round)."""
    from hpcfl.runner import StopRequest

    class StopAfterRows(StopRequest):
        @property  # type: ignore[override]
        def requested(self) -> bool:
            return metrics.exists() and len(metrics.read_text().splitlines()) >= rows

        @requested.setter
        def requested(self, value: bool) -> None:
            pass

    return StopAfterRows()


def test_report_times_every_stage_with_tcts_extraction_and_the_runs_wall_time(tmp_path: Path) -> None:
    """Issue 45 item 4: stage 2's first row carries its setup (the eNTK extraction), every row the
    run's wall clock, continued across a resume; the report's stage times, setup included, add up
    to the run's wall time."""
    from hpcfl.config import config_from_dict
    from hpcfl.report import write_report
    from hpcfl.runner import run_experiment

    cfg = config_from_dict(_tiny_tct())
    run_dir = tmp_path / "tct"
    stopped = run_experiment(cfg, run_dir, stop=_stop_after_rows(run_dir / "metrics.jsonl", 3))
    assert (stopped.rounds_done, stopped.finished) == (3, False)  # checkpointed inside stage 2
    before = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert run_experiment(cfg, run_dir, resume=True).finished
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[:3] == before  # the resume kept the checkpointed rows as they were

    walls = [r["wall_s"] for r in rows]
    assert all(a < b for a, b in zip(walls, walls[1:], strict=False)), walls  # one clock over both processes
    assert [("stage_setup_s" in r) for r in rows] == [False, False, True, True]  # entered, re-entered
    assert [r["stage"] for r in rows] == ["stage1", "stage1", "stage2", "stage2"]

    runs = write_report([run_dir], tmp_path / "rep")
    summary = runs[0]
    assert summary.wall_seconds == walls[-1]
    assert sum(summary.stage_seconds.values()) == pytest.approx(walls[-1], rel=1e-12)
    assert summary.stage_seconds["stage2"] == pytest.approx(walls[3] - walls[1], rel=1e-12)
    setup = rows[2]["stage_setup_s"] + rows[3]["stage_setup_s"]
    assert summary.setup_seconds == {"stage2": pytest.approx(setup, rel=1e-12)}
    assert summary.stage_seconds["stage2"] > setup > 0  # the extraction is counted inside stage 2
    table = next(csv.DictReader((tmp_path / "rep" / "report.csv").open()))
    assert float(table["wall_seconds"]) == walls[-1] and table["setup_seconds"].startswith("stage2:")
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "wall time of the run (s)" in md and f"{walls[-1]:.1f}" in md and "(setup " in md


def test_last_k_labels_say_the_k_really_averaged() -> None:
    """Issue 45 item 7: at the default --last 5, 3-round runs are labelled last-3 (the mean is over
    their 3 rounds), runs of 3 and 7 rounds last-3–5, and runs of 7 rounds last-5."""
    from hpcfl.report.methods import group_methods, method_markdown
    from hpcfl.report.protocol import Protocol, last_k_mean

    three, seven = _run("a", "fedavg", [0.1, 0.2, 0.3]), _run("b", "fedavg", [0.1] * 6 + [0.5])
    protocol = Protocol()
    assert protocol.label([three.rows]) == "3" and last_k_mean(three.rows, 5) == pytest.approx(0.2)
    assert protocol.label([three.rows, seven.rows]) == "3–5"
    assert protocol.label([seven.rows]) == "5" and protocol.label([]) == "5"
    assert protocol.describe([three.rows]).startswith(
        "last-3: the mean test accuracy of a run's last 3 evaluated rounds (all of its evaluated rounds "
        "where it has fewer than --last 5)"
    )
    table = method_markdown(group_methods([three]), protocol, target=0.2)
    assert "| last-3 test acc. (%) |" in table and "last-5" not in table


def test_tcts_stage_1_curve_leaves_fedavgs_visible_in_the_accuracy_plot() -> None:
    """Issue 45 item 7: TCT's stage 1 retraces FedAvg's curve; the run drawn first (FedAvg in the
    comparison) is wider, with larger hollow markers, under the later one, in another style."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hpcfl.report.plots import draw_accuracy

    fedavg = _run("fedavg", "fedavg", [0.1, 0.2, 0.3, 0.32])
    tct = _run("tct", "tct", [0.1, 0.2, 0.3, 0.6])
    fig, ax = plt.subplots()
    try:
        under, over = draw_accuracy(ax, [fedavg, tct])
    finally:
        plt.close(fig)
    assert list(under.get_ydata()[:3]) == list(over.get_ydata()[:3])  # the coinciding stretch
    assert under.get_linewidth() > over.get_linewidth() and under.get_markersize() > over.get_markersize()
    assert under.get_zorder() < over.get_zorder() and under.get_markerfacecolor() == "none"
    assert under.get_marker() != over.get_marker() and under.get_linestyle() != over.get_linestyle()


def test_paired_last_k_differences_match_seeds_not_positions() -> None:
    """Two cells' runs listed in different seed orders, one seed missing from one cell: the paired
    differences are per common seed, in seed order."""
    from hpcfl.report.methods import Cell

    def run(seed: int, accs: list[float]) -> RunSummary:
        return dataclasses.replace(_run(f"s{seed}", "fedavg", accs), config={"seed": seed})

    drop = Cell("drop", "90%", [run(2, [0.1, 0.3, 0.5]), run(0, [0.2, 0.2, 0.2]), run(1, [0.0, 0.4, 0.4])])
    keep = Cell("keep", "90%", [run(0, [0.1, 0.3, 0.5]), run(2, [0.3, 0.5, 0.7])])
    assert keep.paired_last_k(drop, 2) == pytest.approx([0.4 - 0.2, 0.6 - 0.4])
    assert drop.paired_last_k(keep, 2) == pytest.approx([-0.2, -0.2])
