"""``hpcfl sweep`` / ``hpcfl status SWEEP_DIR`` / ``hpcfl report SWEEP_DIR`` (hpcfl.sweep).

Grid expansion, naming and validation without running anything; a 2 × 2 × 2 local sweep on
Fashion-MNIST killed mid-way and re-run, which finishes only the missing points and ends equal to an
uninterrupted sweep; the mean ± std tables against a direct computation from the runs' metrics; a
failed point recorded in one line; the validation split of the learning-rate search disjoint from
the clients' data and the test set, and the choice made on it alone. With the real local SLURM
(``-m slurm``): a sweep queued as one job array of two 2-rank tasks.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from hpcfl.cli.main import main
from hpcfl.errors import ConfigError
from hpcfl.sweep.grid import Axis, combine_axes, expand, parse_grid_arg, point_name, read_grid_file
from hpcfl.sweep.plan import read_sweep
from hpcfl.sweep.select import choose
from tests.cluster import slurm as cluster_module
from tests.cluster.slurm import SlurmCluster
from tests.helpers import hpcfl_cmd, run_cli, synthetic_config, write_config

slurm_cluster = cluster_module.slurm_cluster

GRID = ["--grid", "algorithm=fedavg,scaffold", "partition=dir:0.1,dir:0.5", "--seeds", "2"]


# ---------------------------------------------------------------------------------------------
# the grid


def test_grid_values_are_typed_and_expanded_in_order() -> None:
    axes = [parse_grid_arg("algorithm=fedavg,scaffold"), parse_grid_arg("partition=dir:0.1,dir:0.5")]
    axes = combine_axes(axes, 2, base_seed=5)
    assert axes[-1] == Axis("seed", (5, 6))
    assert parse_grid_arg("lr=0.1,1e-3").values == (0.1, 1e-3)  # numbers, as --set reads them
    points = expand(axes, "fedavg")
    assert len(points) == 8
    assert [p.name for p in points[:3]] == [
        "algorithm=fedavg,partition=dir-0.1,seed=5",
        "algorithm=fedavg,partition=dir-0.1,seed=6",
        "algorithm=fedavg,partition=dir-0.5,seed=5",
    ]
    assert points[0].values == {"algorithm": "fedavg", "partition": "dir:0.1", "seed": 5}
    assert [p.name for p in expand(axes, "fedavg")] == [p.name for p in points]  # stable


def test_algorithm_scoped_axis_varies_only_its_algorithm(tmp_path: Path) -> None:
    axes = [parse_grid_arg("algorithm=fedavg,fedprox"), parse_grid_arg("fedprox.mu=0.01,0.1")]
    points = expand(axes, "fedavg")
    assert [p.values for p in points] == [
        {"algorithm": "fedavg"},
        {"algorithm": "fedprox", "fedprox.mu": 0.01},
        {"algorithm": "fedprox", "fedprox.mu": 0.1},
    ]
    assert points[2].overrides(axes) == {"algorithm": "fedprox", "params.mu": 0.1}
    grid = write_config(
        tmp_path / "g.yaml", grid={"algorithm": ["fedavg", "fedprox"], "fedprox.mu": [0.01, 0.1]}, seeds=3
    )
    file_axes, seeds = read_grid_file(grid)
    assert file_axes == axes and seeds == 3


def test_points_whose_names_coincide_are_refused() -> None:
    with pytest.raises(ConfigError, match="get the same name"):
        expand([Axis("partition", ("dir:0.1", "dir-0.1"))], "fedavg")
    assert len(point_name({"model_options": {"width": 10**200}})) <= 150


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--grid", "lr=0.1,-1"], ("grid point lr=-1:", "'lr' must be > 0")),
        (["--grid", "lrr=0.1,0.2"], ("grid point lrr=0.1:", "did you mean 'lr'")),
        (["--grid", "algorithm=fedavg,fedavgg"], ("grid point algorithm=fedavgg:", "unknown algorithm")),
        (["--grid", "lr"], ("--grid expects KEY=V1,V2",)),
        (["--grid", "lr=0.1,0.1"], ("the value 0.1 is given twice",)),
        (["--grid", "lr=0.1", "lr=0.2"], ("grid key 'lr' is given twice",)),
        (["--grid", "name=a,b"], ("'name' is set by the sweep",)),
        (["--seeds", "0"], ("--seeds must be at least 1",)),
        (["--seeds", "2", "--grid", "seed=1,2"], ("not both",)),
        ([], ("needs at least one axis",)),
        (["--grid", "lr=0.1", "-j", "0"], ("-j/--parallel must be at least 1",)),
        (["--validation", "0.1", "--grid", "lr=0.1"], ("give --search",)),
        (["--search", "lr=0.1,0.2", "--validation", "1.5"], ("--validation must be a fraction",)),
        (
            ["--search", "lr=0.1,0.2", "--grid", "algorithm=fedavg,tct"],
            ("grid point algorithm=tct", "validation"),
        ),
    ],
)
def test_bad_sweeps_fail_in_one_line_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], fragments: tuple[str, ...]
) -> None:
    cfg = synthetic_config(tmp_path)
    out = tmp_path / "sweep"
    code = main(["sweep", str(cfg), "--out", str(out), *argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("hpcfl: error:"), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert not out.exists()  # nothing written, nothing run


def test_a_point_dir_holding_another_config_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = synthetic_config(tmp_path)
    point = tmp_path / "sweep" / "runs" / "lr=0.1"
    point.mkdir(parents=True)
    (point / "config.yaml").write_text("name: lr=0.1\nlr: 0.5\n")
    assert main(["sweep", str(cfg), "--out", str(tmp_path / "sweep"), "--grid", "lr=0.1"]) == 2
    assert "holds a run of another config" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# a local sweep on Fashion-MNIST: killed and re-run, against an uninterrupted one


def _fmnist_config(tmp_path: Path, data_root: Path) -> Path:
    return write_config(
        tmp_path / "fmnist.yaml",
        name="tiny",
        dataset="fashion-mnist",
        data_root=str(data_root),
        download=False,
        partition="dir:0.5",
        num_clients=4,
        model="mlp",
        algorithm="fedavg",
        rounds=3,
        local_steps=2,
        batch_size=32,
        lr=0.05,
        seed=0,
        threads=1,
        progress=False,
    )


@pytest.fixture(scope="module")
def reference_sweep(tmp_path_factory: pytest.TempPathFactory, data_root: Path) -> Path:
    """The 2 × 2 × 2 Fashion-MNIST sweep run without interruption (in this process)."""
    tmp = tmp_path_factory.mktemp("reference")
    out = tmp / "sweep"
    assert main(["sweep", str(_fmnist_config(tmp, data_root)), "--out", str(out), *GRID]) == 0
    return out


def _rows(run_dir: Path) -> list[tuple[int, float, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["round"], r["test_accuracy"], r["test_loss"]) for r in rows]


def test_killed_sweep_reruns_only_missing_points_and_matches(
    reference_sweep: Path, tmp_path: Path, data_root: Path
) -> None:
    cfg = _fmnist_config(tmp_path, data_root)
    out = tmp_path / "sweep"
    argv = hpcfl_cmd("sweep", str(cfg), "--out", str(out), *GRID)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    runs = out / "runs"

    def mid_point() -> bool:  # two points finished and a third past its first checkpoint
        done = list(runs.glob("*/DONE")) if runs.exists() else []
        started = [p for p in runs.glob("*/checkpoints/LATEST") if not (p.parents[1] / "DONE").exists()]
        # (not earlier: a kill between the first checkpoint's rename and its LATEST leaves a run
        # that the runner refuses to resume on purpose; see hpcfl.runner.checkpoint.latest_round)
        return len(done) >= 2 and bool(started)

    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not mid_point():
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, "the sweep never got part-way through a third point"
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    finished = {d.parent.name: d.stat().st_mtime_ns for d in runs.glob("*/DONE")}
    interrupted = [m.parent.name for m in runs.glob("*/metrics.jsonl") if m.parent.name not in finished]
    assert 2 <= len(finished) < 8 and len(interrupted) == 1

    status = subprocess.run(hpcfl_cmd("status", str(out)), env=env, capture_output=True, text=True)
    assert status.returncode == 0, status.stderr
    line = next(ln for ln in status.stdout.splitlines() if ln.startswith(interrupted[0]))
    assert "stopped round" in line and line.endswith("/3"), status.stdout

    rerun = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{len(finished)} already finished, {8 - len(finished)} to run" in rerun.stderr
    assert f"{interrupted[0]}: resumed" in rerun.stderr
    ran = [ln for ln in rerun.stderr.splitlines() if ": ran (" in ln or ": resumed (" in ln]
    assert len(ran) == 8 - len(finished)
    for name, mtime in finished.items():  # untouched
        assert (runs / name / "DONE").stat().st_mtime_ns == mtime
    reference = {d.name: _rows(d) for d in (reference_sweep / "runs").iterdir()}
    assert {d.name: _rows(d) for d in runs.iterdir()} == reference  # bit-identical metrics


def test_report_tables_equal_a_direct_computation(
    reference_sweep: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """summary.csv and report.md against numpy on the runs' metrics.jsonl: the headline last-k mean
    (k = 2 here, of 3 rounds) ± std over seeds, rounds to target on the running mean of 2 rounds,
    final and best accuracy."""
    assert main(["report", str(reference_sweep), "--last", "2", "--window", "2"]) == 0
    md = capsys.readouterr().out
    report = reference_sweep / "report"
    assert (report / "curves.png").stat().st_size > 0
    table = {(r["method"], r["column"]): r for r in csv.DictReader((report / "summary.csv").open())}
    assert len(table) == 4
    target = float(next(iter(table.values()))["target"])
    for (method, column), row in table.items():
        lasts, finals, bests, reached = [], [], [], []
        for seed in (0, 1):
            name = f"algorithm={method},partition={column.replace(':', '-')},seed={seed}"
            rows = [
                json.loads(x)
                for x in (reference_sweep / "runs" / name / "metrics.jsonl").read_text().splitlines()
            ]
            accs = np.array([r["test_accuracy"] for r in rows])
            lasts.append(accs[-2:].mean())
            finals.append(accs[-1])
            bests.append(accs.max())
            smooth = np.array([accs[max(0, i - 1) : i + 1].mean() for i in range(len(accs))])
            hit = np.flatnonzero(smooth >= target)
            reached += [rows[hit[0]]["round"]] if hit.size else []
        assert int(row["n"]) == 2 and int(row["last_k"]) == 2 and int(row["window"]) == 2
        assert float(row["last_k_mean"]) == pytest.approx(np.mean(lasts), abs=1e-12)
        assert float(row["last_k_std"]) == pytest.approx(np.std(lasts, ddof=1), abs=1e-12)
        assert float(row["final_mean"]) == pytest.approx(np.mean(finals), abs=1e-12)
        assert float(row["final_std"]) == pytest.approx(np.std(finals, ddof=1), abs=1e-12)
        assert float(row["best_mean"]) == pytest.approx(np.mean(bests), abs=1e-12)
        assert float(row["best_std"]) == pytest.approx(np.std(bests, ddof=1), abs=1e-12)
        assert int(row["reached"]) == len(reached)
        assert float(row["rounds_to_target_mean"]) == pytest.approx(np.mean(reached), abs=1e-12)
        cell = f"{100 * np.mean(lasts):.2f} ± {100 * np.std(lasts, ddof=1):.2f}"
        assert f"| {method} |" in md and cell in md
    assert "| method | dir:0.1 | dir:0.5 |" in md
    assert md.index("Last-2 test accuracy") < md.index("Final test accuracy")  # the headline first


def test_rerunning_a_finished_sweep_runs_nothing(
    reference_sweep: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _fmnist_config(tmp_path, data_root)
    assert main(["sweep", str(cfg), "--out", str(reference_sweep), *GRID]) == 0
    assert "8 already finished, 0 to run" in capsys.readouterr().err
    assert len(read_sweep(reference_sweep).points) == 8


# ---------------------------------------------------------------------------------------------
# failures, status, extension


def test_report_of_a_sweep_stopped_before_a_whole_column_ran_warns_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A sweep killed mid-way can leave a column of the table with no finished point: its panel of
    curves.png had no lines and matplotlib warned "No artists with labels found to put in legend"
    (issue 51). The panel says so, the legend holds every method drawn, and nothing is warned."""
    import warnings

    cfg = synthetic_config(tmp_path, rounds=2, algorithm="fedavg", num_clients=4)
    out = tmp_path / "sweep"
    assert (
        main(["sweep", str(cfg), "--out", str(out), "--grid", "lr=0.01,0.05", "partition=iid,dir:0.5"]) == 0
    )
    for run in (out / "runs").glob("*partition=dir-0.5*"):  # as if killed before these began
        (run / "DONE").unlink()
        (run / "metrics.jsonl").unlink()
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["report", str(out)]) == 0
    assert (out / "report" / "curves.png").stat().st_size > 0
    assert "| 0.05 | " in capsys.readouterr().out


def test_failed_point_is_recorded_and_the_sweep_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = synthetic_config(tmp_path, rounds=2, algorithm="fedavg")
    out = tmp_path / "sweep"
    assert main(["sweep", str(cfg), "--out", str(out), "--grid", "lr=1e12,0.05"]) == 1
    assert (out / "runs" / "lr=0.05" / "DONE").exists()
    error = (out / "runs" / "lr=1e+12" / "FAILED").read_text().strip()
    assert error.count("\n") == 0 and "lr" in error
    capsys.readouterr()
    assert main(["status", str(out)]) == 1
    text = capsys.readouterr().out
    assert f"failed: {error}" in text and "1 failed, 1 done" in text
    # a second seed extends the same sweep: the finished points stay, only the new ones run
    assert main(["sweep", str(cfg), "--out", str(out), "--grid", "lr=0.05", "--seeds", "2"]) == 0
    assert "0 already finished, 2 to run" in capsys.readouterr().err
    names = [p.name for p in read_sweep(out).points]
    assert names == ["lr=1e+12", "lr=0.05", "lr=0.05,seed=7", "lr=0.05,seed=8"]


# ---------------------------------------------------------------------------------------------
# the learning-rate search on a validation split


def test_validation_split_is_disjoint_from_training_and_test(tmp_path: Path) -> None:
    from hpcfl.comm import LocalComm
    from hpcfl.config import load_config
    from hpcfl.data import partition
    from hpcfl.runner.federation import build_federation

    cfg = load_config(str(synthetic_config(tmp_path)), ["validation=0.05"])
    fed = build_federation(cfg, LocalComm())
    full = partition(
        fed.dataset.train.y, cfg.partition, cfg.num_clients, seed=cfg.seed, num_classes=fed.dataset.num_classes,
        min_size=cfg.min_client_size,
    )  # fmt: skip
    val = set(fed.validation.tolist())
    trained = [set(p.tolist()) for p in fed.parts]
    assert all(not (val & t) for t in trained)  # the clients never train on it
    for whole, kept in zip(full, trained, strict=True):  # from each client: 5%, at least one
        held = set(whole.tolist()) - kept
        assert kept <= set(whole.tolist()) and held <= val
        assert len(held) == max(1, round(0.05 * len(whole)))
    assert len(val) == sum(len(p) for p in full) - sum(len(t) for t in trained)
    # indices into the training split only: the test split is another tensor, never indexed
    assert (
        max(val) < len(fed.dataset.train.y)
        and fed.dataset.test.x.data_ptr() != fed.dataset.train.x.data_ptr()
    )
    x = fed.dataset.train.x[fed.validation].flatten(1)
    test_rows = {tuple(r.tolist()) for r in fed.dataset.test.x.flatten(1)[:, :8]}
    assert not any(tuple(r.tolist()) in test_rows for r in x[:, :8])  # no validation sample is a test sample


def test_choice_is_made_on_validation_not_test() -> None:
    """Value 1 is best on validation, value 0 on test (not seen here): value 1 is chosen."""
    choice = choose([0.01, 0.1], {0: [0.50, 0.52], 1: [0.61, 0.59]})
    assert choice is not None and choice.value == 0.1 and choice.val_mean == pytest.approx(0.60)
    assert choose([0.01, 0.1], {0: [], 1: []}) is None  # every candidate failed
    assert choose([0.01, 0.1], {0: [0.6], 1: [0.6]}).value == 0.01  # ties: the first given


def test_search_reports_the_test_accuracy_of_the_value_chosen_on_validation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The choice is the best mean over seeds of each seed's last-2 validation mean (of 3 rounds),
    and the cell reports that value's last-2 test mean."""
    cfg = synthetic_config(tmp_path, rounds=3, algorithm="fedavg")
    out = tmp_path / "sweep"
    argv = ["sweep", str(cfg), "--out", str(out), "--grid", "algorithm=fedavg,fedprox", "--seeds", "2"]
    assert main([*argv, "--search", "lr=0.001,0.05", "--validation", "0.05"]) == 0
    assert main(["report", str(out), "--last", "2"]) == 0
    capsys.readouterr()
    table = {r["method"]: r for r in csv.DictReader((out / "report" / "summary.csv").open())}
    for method in ("fedavg", "fedprox"):
        val, test = {}, {}
        for lr in (0.001, 0.05):
            runs = [_all(out / "runs" / f"algorithm={method},lr={lr},seed={s}") for s in (7, 8)]
            val[lr] = np.mean([np.mean([r["val_accuracy"] for r in rows[-2:]]) for rows in runs])
            test[lr] = [np.mean([r["test_accuracy"] for r in rows[-2:]]) for rows in runs]
        chosen = max(val, key=lambda lr: (val[lr], -lr))
        assert float(table[method]["chosen"]) == chosen
        assert float(table[method]["last_k_mean"]) == pytest.approx(np.mean(test[chosen]), abs=1e-12)
    md = (out / "report" / "report.md").read_text()
    assert "the test set played no part in the choice" in md and "last 2 evaluated rounds" in md


def test_a_personalised_search_is_chosen_by_the_clients_own_models_on_their_validation_shares(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """FedPer's server model is the shared body with the initial head: its ``val_accuracy`` says
    nothing of the deployed models. With ``client_eval``, the search is chosen by each client's own
    model on its validation share (``personal_val_acc_mean``), and selection.csv says so."""
    cfg = synthetic_config(tmp_path, rounds=3, algorithm="fedper", client_eval=0.25, num_clients=4)
    out = tmp_path / "sweep"
    argv = ["sweep", str(cfg), "--out", str(out), "--seeds", "2", "--search", "lr=0.001,0.05,0.2"]
    assert main([*argv, "--validation", "0.2"]) == 0
    assert main(["report", str(out), "--last", "2"]) == 0
    capsys.readouterr()
    val = {}
    for lr in (0.001, 0.05, 0.2):
        runs = [_all(out / "runs" / f"lr={lr},seed={s}") for s in (7, 8)]
        val[lr] = np.mean([np.mean([r["personal_val_acc_mean"] for r in rows[-2:]]) for rows in runs])
    chosen = max(val, key=lambda lr: (val[lr], -lr))
    selection = list(csv.DictReader((out / "report" / "selection.csv").open()))
    assert {r["metric"] for r in selection} == {"personal_val_acc_mean"}
    assert [float(r["lr"]) for r in selection if r["chosen"] == "True"] == [chosen]
    assert {float(r["lr"]): float(r["val_last2_mean"]) for r in selection} == pytest.approx(val, abs=1e-12)


def test_a_personalised_search_without_client_eval_says_what_it_is_chosen_by(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without ``client_eval`` a personalised method's clients' own models are never scored, so its
    search is chosen by the server model's ``val_accuracy`` (issue 51: silently); one note per such
    method says so when the sweep is planned, none where client_eval is set or for FedAvg."""
    cfg = synthetic_config(tmp_path, rounds=1, num_clients=4)
    argv = ["sweep", str(cfg), "--search", "lr=0.01,0.1", "--dry-run"]
    grid = ["--grid", "algorithm=fedper,ditto,fedavg"]
    assert main([*argv, "--out", str(tmp_path / "a"), *grid]) == 0
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("hpcfl: note: --search")]
    assert [n.split()[4] for n in notes] == ["ditto's", "fedper's"]
    assert all("add --set client_eval=0.2 to choose by personal_val_acc_mean" in n for n in notes)
    assert main([*argv, "--out", str(tmp_path / "b"), *grid, "--set", "client_eval=0.2"]) == 0
    assert "hpcfl: note: --search" not in capsys.readouterr().err


def _all(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------
# on the real local SLURM: one job array


def _submit_array(
    cluster: SlurmCluster, tmp_path: Path, out: Path, rounds: int, grid: str, *, ranks: int, parallel: int
) -> tuple[subprocess.CompletedProcess, str, list[str]]:
    """``hpcfl sweep --executor slurm`` of the synthetic config over ``grid`` into ``out``: one job
    array of ``ranks``-rank tasks, ``parallel`` at a time. Returns the CLI's result, the array id
    and the command line (to submit it again)."""
    cfg = synthetic_config(tmp_path, rounds=rounds)
    argv = ["sweep", str(cfg), "--out", str(out), "--grid", grid, "--executor", "slurm"]
    argv += ["--ntasks-per-node", str(ranks), "-c", "1", "--time", "10", "--array-parallelism", str(parallel)]
    proc = run_cli(*argv, env=cluster.env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc, proc.stdout.strip(), argv


@pytest.mark.slurm
def test_slurm_sweep_is_one_job_array_of_mpi_tasks_that_requeue(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Two points queued as ONE array (ids ARRAY_0, ARRAY_1), each task a 2-rank MPI job. SLURM's
    stop signal to task 1 mid-run: it checkpoints, requeues itself and finishes every round, as a
    single submitted run does. Status follows both to done; a re-run queues nothing."""
    rounds = 24
    out = tmp_path / "sweep"
    proc, array_id, argv = _submit_array(
        slurm_cluster, tmp_path, out, rounds, "lr=0.02,0.05", ranks=2, parallel=2
    )
    assert "submitted job array" in proc.stderr and "(2 tasks)" in proc.stderr
    runs = out / "runs"

    def wait(check, what: str) -> None:
        deadline = time.monotonic() + 300
        while not check():
            assert time.monotonic() < deadline, f"{what}\n{slurm_cluster.log_tails()}"
            time.sleep(0.2)

    second = runs / "lr=0.05"
    wait(
        lambda: (second / "metrics.jsonl").exists() and len(_rows_if_any(second)) >= 2, "two rounds of task 1"
    )
    slurm_cluster.run("scancel", "--signal=USR2", f"{array_id}_1")
    wait(lambda: all((runs / f"lr={lr}" / "DONE").exists() for lr in ("0.02", "0.05")), "both points done")
    log = (out / "slurm" / f"{array_id}_1_0_log.err").read_text()
    assert "stopped by a signal after round" in log, log
    for task, lr in enumerate(("0.02", "0.05")):
        record = json.loads((runs / f"lr={lr}" / "slurm" / "jobs.jsonl").read_text().splitlines()[-1])
        assert record["job_id"] == f"{array_id}_{task}" and record["ranks"] == 2
        assert (out / "slurm" / f"{array_id}_{task}_1_log.out").exists()  # the task's second rank ran
        assert [r[0] for r in _rows(runs / f"lr={lr}")] == list(range(1, rounds + 1))
    script = next((out / "slurm").glob(f"{array_id}_submission.sh")).read_text()
    assert "#SBATCH --array=0-1%2" in script and "#SBATCH --ntasks-per-node=2" in script
    status = run_cli("status", str(out), env=slurm_cluster.env)
    assert status.returncode == 0 and "2 done" in status.stdout, status.stdout
    again = run_cli(*argv, env=slurm_cluster.env, timeout=120)
    assert again.returncode == 0 and "2 already finished, 0 to run" in again.stderr, again.stderr


def test_status_of_a_queued_array_asks_slurm_once_for_all_points(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Three points as one array run one at a time: status shows the first running and the other
    two queued behind the array's limit, with ONE squeue call (and no scontrol) for the sweep, not
    one per point. squeue, sacct and scontrol are SLURM's own, behind a shim that logs each call."""
    out = tmp_path / "sweep"
    _, array_id, _ = _submit_array(
        slurm_cluster, tmp_path, out, 2000, "lr=0.01,0.02,0.05", ranks=1, parallel=1
    )
    shim, calls = tmp_path / "shim", tmp_path / "calls.log"
    shim.mkdir()
    for tool in ("squeue", "sacct", "scontrol"):
        real = subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip()
        (shim / tool).write_text(f'#!/bin/sh\necho {tool} >> "{calls}"\nexec {real} "$@"\n')
        (shim / tool).chmod(0o755)
    env = {**slurm_cluster.env, "PATH": f"{shim}:{os.environ['PATH']}"}
    try:
        deadline = time.monotonic() + 120
        while True:  # until task 0 has logged a round: it runs, tasks 1 and 2 wait
            if (out / "runs" / "lr=0.01" / "metrics.jsonl").exists():
                break
            assert time.monotonic() < deadline, slurm_cluster.log_tails()
            time.sleep(0.2)
        calls.unlink(missing_ok=True)
        proc = run_cli("status", str(out), "--json", env=env)
        assert proc.returncode == 0, proc.stderr
        points = {p["name"]: p for p in map(json.loads, proc.stdout.splitlines())}
        assert points["lr=0.01"]["state"] == "running"
        for task, name in ((1, "lr=0.02"), (2, "lr=0.05")):
            assert points[name]["state"] == "queued" and points[name]["job_id"] == f"{array_id}_{task}"
            assert points[name]["error"].startswith("JobArrayTaskLimit"), points[name]
        assert calls.read_text().split() == ["squeue"]
    finally:
        slurm_cluster.run("scancel", array_id)


def _rows_if_any(run_dir: Path) -> list[str]:
    return [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------
# N at a time, and hpcfl compare on the same runner


def test_points_run_two_at_a_time_equal_one_at_a_time(tmp_path: Path) -> None:
    cfg = synthetic_config(tmp_path, rounds=2, algorithm="fedavg")  # threads: 1, so bit-identical
    argv = ["sweep", str(cfg), "--grid", "lr=0.02,0.05", "partition=dir:0.5,iid"]
    assert main([*argv, "--out", str(tmp_path / "one")]) == 0
    assert main([*argv, "--out", str(tmp_path / "two"), "-j", "2"]) == 0
    for point in (tmp_path / "one" / "runs").iterdir():
        assert _rows(tmp_path / "two" / "runs" / point.name) == _rows(point)


def test_compare_runs_its_configs_as_points_and_reuses_finished_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = synthetic_config(tmp_path, name="a", rounds=2, algorithm="fedavg")
    b = write_config(
        tmp_path / "b.yaml", **{**yaml.safe_load(a.read_text()), "name": "b", "algorithm": "scaffold"}
    )
    out = tmp_path / "cmp"
    assert main(["compare", str(a), str(b), "--out", str(out)]) == 0
    first = capsys.readouterr().out
    assert "a: running (fedavg, dir:0.5)" in first and (out / "b" / "DONE").exists()
    assert main(["compare", str(a), str(b), "--out", str(out)]) == 0
    again = capsys.readouterr().out
    assert f"a: already finished in {out / 'a'}, reusing it" in again
    assert again.splitlines()[-4:] == first.splitlines()[-4:]  # the same table


def test_status_and_report_of_an_unusable_sweep_dir_say_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = synthetic_config(tmp_path)
    out = tmp_path / "sweep"
    assert main(["sweep", str(cfg), "--out", str(out), "--grid", "lr=0.1,0.2", "--dry-run"]) == 0
    assert not out.exists()  # a dry run writes nothing
    out.mkdir()
    (out / "sweep.json").write_text(
        '{"name": "x", "axes": [], "points": [{"name": "lr=0.1", "values": {}, "run_dir": "runs/lr=0.1"}]}'
    )
    capsys.readouterr()
    assert main(["report", str(out)]) == 2
    assert "no point has finished yet" in capsys.readouterr().err
    (out / "sweep.json").write_text('{"name": "x", "axes": [')
    for command in ("status", "report"):
        assert main([command, str(out)]) == 2
        err = capsys.readouterr().err
        assert "sweep.json is damaged" in err and err.count("\n") == 1, err
