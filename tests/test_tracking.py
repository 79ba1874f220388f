"""Issue 28: per-client and fine-tune evaluation, and the TensorBoard / MLflow / W&B views of
``metrics.jsonl`` (each logger's tests skip, with the reason, where its package is missing)."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from hpcfl.cli.main import main
from hpcfl.comm import LocalComm
from hpcfl.config import load_config
from hpcfl.data import partition
from hpcfl.files import read_jsonl
from hpcfl.runner import run_experiment
from hpcfl.runner.client_eval import sampled_clients, spread
from hpcfl.runner.federation import build_federation
from hpcfl.runner.loggers import scalar_names, wandb_records
from hpcfl.training.evaluate import evaluate
from tests.helpers import REPO, final_state, kill_after_rows, mpiexec_cmd, run_cli, synthetic_config


def _cfg(tmp_path: Path, **keys):
    tmp_path.mkdir(parents=True, exist_ok=True)
    base = dict(algorithm="fedavg", rounds=3, client_eval=0.2, num_clients=5)
    return synthetic_config(tmp_path, **{**base, **keys})


# -- per-client evaluation ----------------------------------------------------------------------


def test_spread_counts_every_client_once():
    accs = [0.1 * i for i in range(1, 21)]  # 20 clients: worst/best 10 % are 2 clients each
    s = spread(accs, "client_acc")
    assert s["client_acc_p10"] == pytest.approx((0.1 + 0.2) / 2)
    assert s["client_acc_p90"] == pytest.approx((1.9 + 2.0) / 2)
    assert s["client_acc_min"] == pytest.approx(0.1)
    assert s["client_acc_mean"] == pytest.approx(sum(accs) / 20)
    assert s["client_acc_std"] == pytest.approx(
        torch.tensor(accs, dtype=torch.float64).std(correction=0).item()
    )
    assert spread([0.5, math.nan], "x")["x_mean"] == 0.5  # a diverged fine-tuning is left out


def test_held_out_shares_are_disjoint_from_training_and_validation(tmp_path):
    cfg = load_config(_cfg(tmp_path, validation=0.1))
    fed = build_federation(cfg, LocalComm())
    plain = build_federation(load_config(_cfg(tmp_path, validation=0.1, client_eval=0.0)), LocalComm())
    original = partition(
        fed.dataset.train.y,
        cfg.partition,
        cfg.num_clients,
        seed=cfg.seed,
        num_classes=10,
        min_size=cfg.min_client_size,
    )
    assert fed.client_eval is not None and fed.validation is not None
    assert torch.equal(fed.validation, plain.validation)  # validation draws as before client_eval
    val = set(fed.validation.tolist())
    for k, share in enumerate(fed.client_eval):
        held, train = set(share.tolist()), set(fed.parts[k].tolist())
        assert held and not held & train and not held & val
        assert held | train <= set(original[k].tolist())  # the client's own data only
        assert len(held) == round(0.2 * len(set(plain.parts[k].tolist())))


def test_client_values_equal_a_direct_evaluation_of_the_final_model(tmp_path):
    cfg = load_config(_cfg(tmp_path))
    run = tmp_path / "run"
    result = run_experiment(cfg, run)
    last = read_jsonl(run / "client_metrics.jsonl")[-1]
    assert last["round"] == 3 and len(read_jsonl(run / "client_metrics.jsonl")) == 3
    fed = build_federation(cfg, LocalComm())
    fed.flat.load(final_state(run))
    direct = {}
    for k, share in enumerate(fed.client_eval):
        x, y = fed.dataset.train.x[share], fed.dataset.train.y[share]
        direct[str(k)] = evaluate(fed.flat.model, x, y, LocalComm())
    assert {k: (v["accuracy"], v["loss"]) for k, v in last["clients"].items()} == direct
    assert all(v["n"] == int(fed.client_eval[int(k)].numel()) for k, v in last["clients"].items())
    row = result.metrics[-1]
    assert "client_metrics" not in row  # the per-client values live in their own file
    assert {k: row[k] for k in spread([], "client_acc")} == spread(
        [a for a, _ in direct.values()], "client_acc"
    )
    assert row["client_eval_clients"] == 5


def test_with_validation_every_model_is_also_scored_on_each_clients_validation_share(tmp_path):
    """``validation`` + ``client_eval``: the global model's ``val_accuracy`` per client is a direct
    evaluation on that client's own validation share (its slice of the run's validation set), and
    the fine-tuned model is the one scored on the held-out share (its two figures from one tuning);
    the ``*_val_acc_*`` spreads are of those values. What a personalised method's lr is chosen by."""
    from hpcfl.runner.client_eval import finetune_generator
    from hpcfl.training.sgd import LocalSchedule

    cfg = load_config(_cfg(tmp_path, validation=0.2, finetune_eval={"steps": 3, "lr": 0.05}))
    run = tmp_path / "run"
    result = run_experiment(cfg, run)
    fed = build_federation(cfg, LocalComm())
    assert fed.validation_parts is not None
    assert torch.equal(torch.cat(fed.validation_parts), fed.validation)
    last = read_jsonl(run / "client_metrics.jsonl")[-1]["clients"]
    final = final_state(run)
    fed.flat.load(final)
    schedule = LocalSchedule(lr=0.05, batch_size=cfg.batch_size, steps=3, weight_decay=cfg.weight_decay)
    val_accs, tuned_accs = [], []
    for k, share in enumerate(fed.validation_parts):
        x, y = fed.dataset.train.x[share], fed.dataset.train.y[share]
        fed.flat.load(final)
        assert last[str(k)]["val_accuracy"] == evaluate(fed.flat.model, x, y, LocalComm())[0]
        tuned, _ = fed.trainer.train(
            final,
            fed.client_data(k),
            finetune_generator(cfg.seed, 2, k),
            schedule=schedule,  # round 3, counted from 0
        )
        fed.flat.load(tuned)
        assert last[str(k)]["finetune_val_accuracy"] == evaluate(fed.flat.model, x, y, LocalComm())[0]
        held = fed.client_eval[k]
        assert (
            last[str(k)]["finetune_accuracy"]
            == evaluate(fed.flat.model, fed.dataset.train.x[held], fed.dataset.train.y[held], LocalComm())[0]
        )
        val_accs.append(last[str(k)]["val_accuracy"])
        tuned_accs.append(last[str(k)]["finetune_val_accuracy"])
    row = result.metrics[-1]
    assert {k: row[k] for k in spread([], "client_val_acc")} == spread(val_accs, "client_val_acc")
    assert {k: row[k] for k in spread([], "finetune_val_acc")} == spread(tuned_accs, "finetune_val_acc")


class CountingComm(LocalComm):
    """One process that records the length of every allreduced tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def allreduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.sizes.append(tensor.numel())
        return super().allreduce(tensor)


def test_an_evaluated_round_reduces_test_validation_and_client_counts_once(tmp_path):
    runs = {}
    for name, keys in {"plain": dict(client_eval=0.0), "clients": dict(validation=0.1)}.items():
        comm = CountingComm()
        rows = run_experiment(load_config(_cfg(tmp_path / name, **keys)), tmp_path / name / "run", comm=comm)
        runs[name] = (comm.sizes, rows.metrics)
    (plain, _), (counted, rows) = runs["plain"], runs["clients"]
    assert len(counted) == len(plain)  # validation and 5 clients' table add no allreduce
    # test (correct, loss, n), validation, and per client (accuracy, loss, val_accuracy, n): with
    # ``validation``, each client's model is also scored on its own validation share
    joint = 3 + 3 + 5 * 4
    assert counted.count(joint) == len(rows) == 3
    assert all("val_accuracy" in r and "client_acc_mean" in r and "client_val_acc_mean" in r for r in rows)


_TCT = dict(
    algorithm="tct",
    partition="classes:2",
    stage1={"rounds": 1},
    stage2={"p": 300, "rounds": 1, "local_steps": 20, "auto_lr": True},
)


def test_tct_stage2_clients_are_the_final_linear_model_on_their_held_out_features(tmp_path):
    from hpcfl.features import open_feature_store
    from hpcfl.tct.features import compute_features, convexified_model, feature_meta
    from hpcfl.tct.problem import LinearProblem, centred_one_hot, design_matrix, federated_moments
    from hpcfl.tct.solvers import ClosedFormSolver

    cfg = load_config(
        _cfg(
            tmp_path,
            **{**_TCT, "stage2": {**_TCT["stage2"], "rounds": 2}},
            finetune_eval={"steps": 3, "lr": 0.05},
        )
    )
    run = tmp_path / "run"
    result = run_experiment(cfg, run)
    rows = read_jsonl(run / "client_metrics.jsonl")
    assert [r["round"] for r in rows] == [1, 2, 3] and [m["stage"] for m in result.metrics][1:] == [
        "stage2"
    ] * 2
    # the direct evaluation: the stage-1 model convexified, the shares' features computed afresh,
    # standardised with the training features' moments, times the final W
    fed = build_federation(cfg, LocalComm())
    cfg2 = cfg.params.stage2
    fed.flat.load(torch.load(run / "stage1_model.pt", weights_only=True))
    model = convexified_model(fed.flat.model, cfg2)
    meta = feature_meta(model, cfg2)
    train = open_feature_store(run / "features.zarr", expect=meta)
    raw = {k: train.read_client(k) for k in range(5)}
    moments = federated_moments({k: z for k, (z, _) in raw.items()}, LocalComm(), p=meta.p, clients=5)
    w = result.server.x.view(meta.p + 1, 10)
    lr = result.metrics[-1]["stage2_lr"]
    direct, tuned = {}, {}
    for k, share in enumerate(fed.client_eval):
        x, y = fed.dataset.train.x[share], fed.dataset.train.y[share]
        z = torch.cat(list(compute_features(model, x, cfg2, meta)))
        held = LinearProblem(design_matrix(z, moments), centred_one_hot(y, 10), y)
        own = LinearProblem(design_matrix(raw[k][0], moments), centred_one_hot(raw[k][1], 10), raw[k][1])
        w_k = ClosedFormSolver(own).local_steps(w, torch.zeros_like(w), lr, 3)  # at η2: see the docstring
        for out, v in ((direct, w), (tuned, w_k)):
            scores = held.z @ v
            out[str(k)] = (
                float((scores.argmax(1) == y).sum()) / y.numel(),
                float(0.5 * ((scores - held.y) ** 2).sum(1).sum()) / y.numel(),
            )
    last = rows[-1]["clients"]
    assert {k: (v["accuracy"], v["loss"]) for k, v in last.items()} == direct
    assert {k: (v["finetune_accuracy"], v["finetune_loss"]) for k, v in last.items()} == tuned
    assert (
        result.metrics[-1]["client_acc_mean"]
        == spread([a for a, _ in direct.values()], "client_acc")["client_acc_mean"]
    )


def test_a_seeded_sample_of_clients_is_evaluated_and_stated(tmp_path):
    cfg = load_config(_cfg(tmp_path, client_eval_clients=2, rounds=2))
    result = run_experiment(cfg, tmp_path / "run")
    rows = read_jsonl(tmp_path / "run" / "client_metrics.jsonl")
    for rnd, row in enumerate(rows):
        assert sorted(map(int, row["clients"])) == sampled_clients(5, 2, cfg.seed, rnd)
    assert [r["client_eval_clients"] for r in result.metrics] == [2, 2]


def test_finetune_evaluation_leaves_the_trajectory_bit_identical(tmp_path):
    plain = run_experiment(load_config(_cfg(tmp_path / "a")), tmp_path / "a" / "run")
    tuned_cfg = load_config(_cfg(tmp_path / "b", finetune_eval={"steps": 4, "lr": 0.05}))
    tuned = run_experiment(tuned_cfg, tmp_path / "b" / "run")
    assert torch.equal(final_state(tmp_path / "a" / "run"), final_state(tmp_path / "b" / "run"))
    for a, b in zip(plain.metrics, tuned.metrics, strict=True):
        assert (a["test_accuracy"], a["test_loss"], a["client_acc_mean"]) == (
            b["test_accuracy"],
            b["test_loss"],
            b["client_acc_mean"],
        )
    last = tuned.metrics[-1]
    assert 0 <= last["finetune_acc_p10"] <= last["finetune_acc_mean"] <= last["finetune_acc_p90"] <= 1
    clients = read_jsonl(tmp_path / "b" / "run" / "client_metrics.jsonl")[-1]["clients"]
    assert all("finetune_accuracy" in v for v in clients.values())


def test_finetune_only_at_the_last_round(tmp_path):
    cfg = load_config(_cfg(tmp_path, finetune_eval={"steps": 2, "lr": 0.05, "rounds": "last"}))
    rows = run_experiment(cfg, tmp_path / "run").metrics
    assert ["finetune_acc_mean" in r for r in rows] == [False, False, True]


@pytest.mark.mpi
@pytest.mark.parametrize(
    "keys", [{}, _TCT, {"algorithm": "fedper"}], ids=["fedavg", "tct", "fedper-personal-states-in-memory"]
)
def test_client_evaluation_on_one_and_two_ranks_is_bit_identical(tmp_path, keys):
    """Also a personalised method under full participation: its heads stay in each rank's memory,
    and each client's personal model is scored on the rank that trains it."""
    cfg = _cfg(tmp_path, finetune_eval={"steps": 2, "lr": 0.05}, rounds=2, **keys)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    one = run_cli("run", str(cfg), "--run-dir", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    two = subprocess.run(
        mpiexec_cmd(2, "run", str(cfg), "--run-dir", str(tmp_path / "two")),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr
    a = read_jsonl(tmp_path / "one" / "client_metrics.jsonl")
    b = read_jsonl(tmp_path / "two" / "client_metrics.jsonl")
    assert a == b and len(a) == 2
    if keys.get("algorithm") == "fedper":
        assert not (tmp_path / "two" / "client_states_train.zarr").exists()  # the memory path
        assert all("personal_accuracy" in c for c in b[-1]["clients"].values())


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("client_eval=1.5", "'client_eval' must be in [0, 1)"),
        ("finetune_eval.steps=3", "set client_eval"),
        ("client_eval_clients=0", "'client_eval_clients' must be > 0"),
        ("loggers=[tensorbored]", "'loggers' must be a list of tensorboard, mlflow, wandb"),
    ],
)
def test_bad_evaluation_and_logger_keys_give_one_line(tmp_path, capsys, override, fragment):
    cfg = synthetic_config(tmp_path)
    code = main(["run", str(cfg), "--run-dir", str(tmp_path / "r"), "--set", override])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and "Traceback" not in err
    assert lines[-1].startswith("hpcfl: error:") and fragment in lines[-1], lines


@pytest.mark.parametrize(("key", "value"), [("client_eval", "0.2"), ("heldout_clients", "2")])
def test_raw_input_evaluation_of_a_projected_ntk_model_is_refused_in_one_line(tmp_path, capsys, key, value):
    """client_eval and held-out clients score the configured network on raw inputs, which a CP-NTK-FL
    run with a projection never trains (the held-out case was a traceback: a size mismatch)."""
    from tests.test_ntkfl import _small_cfg

    cfg = _small_cfg(tmp_path, "cp-ntkfl", params={"beta": 0.5, "projection_dim": 30, "keep": 0.2})
    code = main(["run", str(cfg), "--run-dir", str(tmp_path / "r"), "--set", f"{key}={value}"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and "Traceback" not in err
    assert lines[-1].startswith("hpcfl: error:") and f"set {key}: 0 or params.projection_dim: 0" in lines[-1]


def test_a_missing_logger_package_names_the_pip_install(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    cfg = synthetic_config(tmp_path)
    code = main(["run", str(cfg), "--run-dir", str(tmp_path / "r"), "--set", "loggers=[wandb]"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and "Traceback" not in err and len(lines) == 1
    assert "pip install 'hpcfl[wandb]'" in lines[0]
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


# -- loggers ------------------------------------------------------------------------------------


def _expected(run: Path) -> dict[str, dict[int, float]]:
    """Every scalar of metrics.jsonl: name -> {round: value}."""
    out: dict[str, dict[int, float]] = {}
    for row in read_jsonl(run / "metrics.jsonl"):
        for name, value in scalar_names(row).items():
            out.setdefault(name, {})[int(row["round"])] = value
    return out


def _tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={event_accumulator.SCALARS: 0}, purge_orphaned_data=False
    )
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _wandb_history(run: Path) -> list[dict[str, float]]:
    """The history rows of the offline run segments, in the segments' start-time order (name ->
    value, with ``_step``), read back with W&B's own protobuf classes (:func:`wandb_records`)."""
    return [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for path in sorted(run.glob("wandb/offline-run-*/run-*.wandb"))  # named by start time
        for r in wandb_records(path)
        if r.WhichOneof("record_type") == "history"
    ]


def _check_tensorboard(run: Path, expected: dict[str, dict[int, float]]) -> None:
    board = _tensorboard_scalars(run / "tensorboard")
    assert set(board) >= set(expected)
    for name, by_round in expected.items():
        steps = [s for s, _ in board[name]]
        assert steps == sorted(by_round), (name, steps)  # once each, in order: no duplicate, no gap
        assert [v for _, v in board[name]] == pytest.approx([by_round[s] for s in steps], rel=1e-6)


def _check_mlflow(run: Path, expected: dict[str, dict[int, float]]) -> None:
    from mlflow import MlflowClient

    record = json.loads((run / "loggers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=record["tracking_uri"])
    for name in ("test/accuracy", "clients/client_acc_mean", "comm/bytes_up", "time/seconds"):
        got = sorted((m.step, m.value) for m in client.get_metric_history(record["run_id"], name))
        assert [s for s, _ in got] == sorted(expected[name])
        assert [v for _, v in got] == pytest.approx([expected[name][s] for s, _ in got])
    mlrun = client.get_run(record["run_id"])
    assert set(mlrun.data.metrics) == set(expected)
    assert mlrun.data.params["lr"] == "0.05" and mlrun.data.params["client_eval"] == "0.2"
    assert mlrun.info.status == "FINISHED"
    assert "figures/partition.png" in [a.path for a in client.list_artifacts(record["run_id"], "figures")]


def test_tensorboard_holds_every_scalar_once_across_a_kill_and_resume(tmp_path):
    """The event files read back with tensorboard's reader (no purging of orphaned steps, so a
    duplicate would show) after SIGKILL + --resume: every scalar of metrics.jsonl at its round."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    cfg = _cfg(tmp_path, rounds=5, loggers=["tensorboard"], num_clients=4)
    run = tmp_path / "run"
    kill_after_rows(cfg, run, rows=3)
    assert json.loads((run / "loggers.json").read_text())["tensorboard"]["through"] >= 1
    resumed = run_cli("run", str(cfg), "--run-dir", str(run), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    expected = _expected(run)
    assert sorted(expected["test/accuracy"]) == [1, 2, 3, 4, 5]
    for name in ("train/local_loss", "comm/bytes_up", "time/compute_s", "clients/client_acc_p10"):
        assert name in expected
    _check_tensorboard(run, expected)


def test_mlflow_and_wandb_hold_the_rows_params_and_figures(tmp_path, monkeypatch):
    """MLflow's local store read back with MlflowClient (metrics at their rounds, params, figures);
    W&B's offline run directory read back with W&B's own protobuf records (the history)."""
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline by default
    cfg = load_config(_cfg(tmp_path, rounds=3, loggers=["mlflow", "wandb"], num_clients=4))
    run = tmp_path / "run"
    try:
        run_experiment(cfg, run)
    finally:  # stop the W&B service this process started; its address must not reach later runs
        import wandb

        wandb.teardown()
        os.environ.pop("WANDB_SERVICE", None)
    expected = _expected(run)
    _check_mlflow(run, expected)
    history = [r for r in _wandb_history(run) if "test/accuracy" in r]
    assert [r["_step"] for r in history] == [1, 2, 3]
    for r in history:
        for name, by_round in expected.items():
            assert r[name] == pytest.approx(by_round[r["_step"]]), name


@pytest.mark.slow
def test_every_logger_across_a_kill_and_resume(tmp_path, monkeypatch):
    """All three loggers through SIGKILL + --resume (about a minute): TensorBoard and MLflow hold
    every step once; W&B's two offline segments (one per invocation) hold every step once between
    them, and loggers.json names them and the `wandb sync` command that uploads them as one run."""
    for name in ("tensorboard", "mlflow", "wandb"):
        pytest.importorskip(name, reason=f"the {name} extra is not installed")
    # a W&B run started in this test process leaves its service's address in the environment; the
    # killed and the resumed run must each have their own, as separate jobs do
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
    cfg = _cfg(tmp_path, rounds=5, loggers=["tensorboard", "mlflow", "wandb"], num_clients=4)
    run = tmp_path / "run"
    kill_after_rows(cfg, run, rows=3)
    resumed = run_cli("run", str(cfg), "--run-dir", str(run), "--resume", env={"WANDB_SILENT": "true"})
    assert resumed.returncode == 0, resumed.stderr
    expected = _expected(run)
    _check_tensorboard(run, expected)
    _check_mlflow(run, expected)
    # the segments, synced in start-time order as `wandb sync --id` does, hold every step once
    steps = [r["_step"] for r in _wandb_history(run) if "test/accuracy" in r]
    assert steps == [1, 2, 3, 4, 5]
    record = json.loads((run / "loggers.json").read_text())["wandb"]
    assert record["through"] == 5
    segments = sorted(p.name for p in run.glob("wandb/offline-run-*"))
    assert record["segments"] == segments and len(segments) == 2
    assert (
        record["sync"]
        == f"wandb sync --id {record['run_id']} -p hpcfl wandb/{segments[0]} wandb/{segments[1]}"
    )


def test_a_sweep_point_is_grouped_under_the_sweep(tmp_path, monkeypatch):
    """Two points of one sweep: one TensorBoard directory per point under the sweep, MLflow child
    runs of one parent run named after the sweep, one W&B group named after the sweep."""
    for name in ("tensorboard", "mlflow", "wandb"):
        pytest.importorskip(name, reason=f"the {name} extra is not installed")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    from mlflow import MlflowClient

    from hpcfl.runner.loggers import open_loggers

    sweep = tmp_path / "sw"
    (sweep / "runs").mkdir(parents=True)
    (sweep / "sweep.json").write_text(json.dumps({"name": "mysweep"}))
    ids = []
    for point in ("p0", "p1"):
        (sweep / "runs" / point).mkdir()
        loggers = open_loggers(
            ["tensorboard", "mlflow", "wandb"], sweep / "runs" / point, {"name": point, "lr": 0.1}
        )
        loggers.flush([{"round": 1, "test_accuracy": 0.5}])
        loggers.close(finished=True)
        ids.append(json.loads((sweep / "runs" / point / "loggers.json").read_text())["mlflow"])
        assert _tensorboard_scalars(sweep / "tensorboard" / point)["test/accuracy"] == [(1, 0.5)]
        logs = (sweep / "runs" / point).glob("wandb/offline-run-*/run-*.wandb")
        runs = [r.run for path in logs for r in wandb_records(path) if r.WhichOneof("record_type") == "run"]
        assert runs and all(r.run_group == "mysweep" for r in runs)
    import wandb

    wandb.teardown()  # the W&B service this process started
    os.environ.pop("WANDB_SERVICE", None)
    client = MlflowClient(tracking_uri=ids[0]["tracking_uri"])
    parents = {client.get_run(i["run_id"]).data.tags["mlflow.parentRunId"] for i in ids}
    assert len(parents) == 1
    parent = client.get_run(parents.pop())
    assert parent.info.run_name == "mysweep"
    assert client.get_experiment(parent.info.experiment_id).name == "mysweep"


# -- reports ------------------------------------------------------------------------------------


def test_report_shows_the_client_distribution_and_the_sweep_table_its_p10(tmp_path):
    import csv

    import numpy as np

    from hpcfl.report import write_report
    from hpcfl.report.methods import Cell
    from hpcfl.report.protocol import Protocol
    from hpcfl.report.summary import summarise
    from hpcfl.sweep.report import protocol_markdown, summary_csv

    runs = []
    for seed in (1, 2):
        cfg = load_config(_cfg(tmp_path / f"s{seed}", seed=seed, finetune_eval={"steps": 2, "lr": 0.05}))
        run_experiment(cfg, tmp_path / f"r{seed}")
        runs.append(tmp_path / f"r{seed}")
    write_report(runs, tmp_path / "rep")
    assert (tmp_path / "rep" / "clients.png").stat().st_size > 0
    table = list(csv.DictReader((tmp_path / "rep" / "clients.csv").open()))
    for run, line in zip(runs, table, strict=True):
        last = read_jsonl(run / "metrics.jsonl")[-1]
        assert float(line["client_acc_p10"]) == last["client_acc_p10"]
        assert float(line["finetune_acc_mean"]) == last["finetune_acc_mean"]
    assert "fine-tuned mean" in (tmp_path / "rep" / "report.md").read_text()

    summaries = [summarise(r) for r in runs]
    assert summaries[0].final_clients == read_jsonl(runs[0] / "client_metrics.jsonl")[-1]["clients"]
    cell = Cell("fedavg", "dir:0.5", summaries)
    protocol = Protocol(last_k=2)
    md = "\n".join(protocol_markdown([cell], protocol, 0.5))
    assert "Worst-10 % client accuracy" in md
    row = next(csv.DictReader(summary_csv([cell], 0.5, protocol).splitlines()))
    per_seed = [np.mean([r["client_acc_p10"] for r in s.rows[-2:]]) for s in summaries]
    assert float(row["client_acc_p10_mean"]) == pytest.approx(np.mean(per_seed), abs=1e-12)
    assert float(row["client_acc_p10_std"]) == pytest.approx(np.std(per_seed, ddof=1), abs=1e-12)


def test_rounds_a_kill_left_in_doubt_are_written_once(tmp_path):
    """A kill in the middle of a flush (rounds named ``pending`` in loggers.json, written to the
    backends, ``through`` not yet advanced): the resume settles them from the backends, so
    TensorBoard and MLflow still hold every round exactly once."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    from hpcfl.runner.loggers import open_loggers

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"round": r, "test_accuracy": r / 10, "seconds": 1.0 + r} for r in range(1, 5)]
    config = {"name": "doubt", "lr": 0.1}
    first = open_loggers(["tensorboard", "mlflow"], run, config)
    first.flush(rows[:2])
    first.pending = {"tensorboard": 3, "mlflow": 3}  # what flush records before writing round 3
    first._save()
    for logger in first.loggers:
        logger.log(3, scalar_names(rows[2]))
    first.loggers[0].writer.close()  # the process dies here: round 3 written, through still 2
    again = open_loggers(["tensorboard", "mlflow"], run, config)
    again.flush(rows[:3])  # the catch-up of the rows a checkpoint covers
    again.flush(rows)
    again.close(finished=True)
    board = _tensorboard_scalars(run / "tensorboard")
    assert [s for s, _ in board["test/accuracy"]] == [1, 2, 3, 4]
    from mlflow import MlflowClient

    record = json.loads((run / "loggers.json").read_text())["mlflow"]
    history = MlflowClient(tracking_uri=record["tracking_uri"]).get_metric_history(
        record["run_id"], "test/accuracy"
    )
    assert sorted(m.step for m in history) == [1, 2, 3, 4]
