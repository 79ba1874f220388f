"""The peers harness (benchmarks/peers, issue 60) hands every framework hpcfl's own experiment.

No peer environment is needed: these check, in hpcfl's venv, that what the peers are given is what
hpcfl does — the model (layers, parameter order, initial weights, outputs), the client shuffles,
the bundle's partition and participant draws, one FedAvg round of the peers' plain loop against
hpcfl's — and the harness's own contract: a missing environment is one line and exit 2, a record
is written atomically, the summary's tolerance rule.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpcfl.data import load_dataset, partition
from hpcfl.models import build_model
from hpcfl.runner.federation import client_generator as hpcfl_client_generator
from hpcfl.training.sgd import LocalSchedule, batch_indices

REPO = Path(__file__).resolve().parent.parent
PEERS = REPO / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS))

import experiment  # noqa: E402
import harness  # noqa: E402
import peer_common as pc  # noqa: E402


def test_simplecnn_equals_hpcfls_model() -> None:
    """Same parameter count, state_dict keys and shapes, initial weights for a seed, and outputs."""
    ours = pc.initial_model(7)
    torch.manual_seed(7)
    theirs = build_model("simplecnn", (1, 28, 28), 10)
    assert pc.num_params(ours) == sum(p.numel() for p in theirs.parameters()) == 356_234
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b)
    assert all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a), "initial weights differ"
    torch.manual_seed(1)
    theirs.load_state_dict({k: torch.randn_like(v) for k, v in b.items()})
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(5, 1, 28, 28)
    assert torch.equal(ours(x), theirs(x))


def test_client_shuffle_equals_hpcfls() -> None:
    """The peers' generator is hpcfl's, and one epoch's batches are hpcfl's (last partial batch kept)."""
    n, bs = 70, 32
    for seed, rnd, k in [(0, 0, 0), (2, 49, 99), (1, 3, 17)]:
        ours = torch.randperm(n, generator=pc.client_generator(seed, rnd, k))
        hpcfl = batch_indices(
            n, LocalSchedule(lr=0.05, batch_size=bs, weight_decay=0.0), hpcfl_client_generator(seed, rnd, k)
        )
        assert [b.tolist() for b in hpcfl] == [ours[i : i + bs].tolist() for i in range(0, n, bs)]
        assert [len(b) for b in hpcfl] == [32, 32, 6]


def _fedavg_round(exp: pc.Experiment, model: torch.nn.Module, seed: int, rnd: int) -> None:
    """One round of the plain sample-weighted FedAvg every peer runs (peer_common's loop)."""
    states, weights = [], []
    start = pc.get_weights(model)
    for k in exp.draw(seed, rnd):
        pc.set_weights(model, start)
        x, y = exp.client_data(k)
        pc.train_one_epoch(
            model, x, y, exp.spec["batch_size"], exp.spec["lr"], pc.client_generator(seed, rnd - 1, k)
        )
        states.append(pc.get_weights(model))
        weights.append(x.shape[0])
    pc.set_weights(model, pc.weighted_average(states, weights))


def test_bundle_is_hpcfls_experiment_and_one_round_agrees(tmp_path: Path, data_root: Path) -> None:
    """clients.json is hpcfl's dir:0.5 partition, draws.json the participants an `hpcfl run` trains
    (run through the bundle's plug-in dataset), and two rounds of the peers' plain FedAvg loop end
    where hpcfl's rounds end (same weighting, shuffles, last batch, no weight decay)."""
    from hpcfl import config_from_dict, run_experiment

    spec = {**experiment.SPEC, "rounds": 2, "seeds": [0, 3]}
    bundle = experiment.build(tmp_path / "bundle", str(data_root), spec)
    exp = pc.load_experiment(bundle)
    ds = load_dataset("fashion-mnist", data_root, download=False)
    assert torch.equal(exp.train_x, ds.train.x) and torch.equal(exp.test_y, ds.test.y)
    parts = partition(ds.train.y, "dir:0.5", 100, seed=0, num_classes=10, min_size=10)
    assert exp.clients == [p.tolist() for p in parts]
    assert exp.spec["num_params"] == 356_234

    seed = 3
    import hpcfl_bundle  # noqa: F401  (registers peers-bundle in this process)
    from run_hpcfl import hpcfl_config

    cfg = hpcfl_config(bundle, exp.spec, seed, 2, "1proc") | {
        "eval_every": 1,
        "progress": False,
        "threads": 1,
    }
    result = run_experiment(config_from_dict(cfg), tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["participants"] for r in rows] == exp.draws[seed]
    saved = json.loads((tmp_path / "run" / "partition.json").read_text())
    assert [c["indices"] for c in saved["clients"]] == exp.clients

    torch.set_num_threads(1)
    model = pc.initial_model(seed, exp)
    for rnd in (1, 2):
        _fedavg_round(exp, model, seed, rnd)
    ours = torch.cat([p.detach().flatten() for p in model.parameters()])
    theirs = result.server.x[: ours.numel()]
    assert torch.allclose(ours, theirs, rtol=0, atol=2e-5), float((ours - theirs).abs().max())
    acc, _ = pc.evaluate(model, exp.test_x, exp.test_y)
    assert abs(acc - rows[-1]["test_accuracy"]) <= 2e-4


def _harness(args: list[str], env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), **env_extra}
    cmd = [sys.executable, str(PEERS / "harness.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--frameworks", "flower"],
            "harness: peer 'flower' has no environment: run `bash benchmarks/peers/setup.sh flower`",
        ),
        (
            ["--frameworks", "hpcfl", "flwr"],
            "harness: unknown framework 'flwr'; known: hpcfl, flower, pfl, blazefl, fedlab",
        ),
        (
            ["--frameworks", "hpcfl", "--modes", "ray9"],
            "harness: none of the modes ['ray9'] is a cpu mode of hpcfl",
        ),
        (
            ["--frameworks", "hpcfl", "--algorithms", "fedprox"],
            "harness: unknown algorithm 'fedprox'; known: fedavg, fedadam, fedyogi, fedadagrad, fedavgm",
        ),
        (
            ["--frameworks", "hpcfl", "pfl", "--algorithms", "fedadam"],
            "harness: framework 'pfl' runs fedavg only, not fedadam",
        ),
    ],
)
def test_harness_refuses_in_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    out = _harness([*args, "--out", str(tmp_path / "out")], {"PEERS_DIR": str(tmp_path / "peers")})
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(message), out.stderr
    assert not (tmp_path / "out").exists()


def test_failed_environment_is_a_row_not_a_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """setup.sh leaves FAILED with its reason: the peer gets one failed row naming it."""
    (tmp_path / "fedlab").mkdir()
    (tmp_path / "fedlab" / "FAILED").write_text("ERROR: No matching distribution found for fedlab==1.3.0\n")
    monkeypatch.setenv("PEERS_DIR", str(tmp_path))
    python, why = harness.framework_python("fedlab")
    assert (
        python is None
        and why == "environment did not build: ERROR: No matching distribution found for fedlab==1.3.0"
    )
    row = harness.row_of(
        {
            "framework": "fedlab",
            "version": None,
            "mode": "m",
            "mode_key": "m",
            "seed": 0,
            "status": "failed",
            "error": why,
        }
    )
    assert row["status"] == "failed" and row["error"] == why and row["seconds_per_round"] is None


def test_write_record_is_atomic(tmp_path: Path) -> None:
    """A record is complete or absent: a failed write leaves the previous record and no temp file."""
    path = tmp_path / "sub" / "rec.json"
    pc.write_record(path, {"framework": "x", "round_s": [1.0, 2.0]})
    assert json.loads(path.read_text()) == {"framework": "x", "round_s": [1.0, 2.0]}
    with pytest.raises(TypeError):
        pc.write_record(path, {"framework": "y", "bad": object()})
    assert json.loads(path.read_text())["framework"] == "x"
    assert sorted(p.name for p in path.parent.iterdir()) == ["rec.json"]


def test_process_tree_rss_counts_children() -> None:
    """A child holding 300 MB raises the tree's sampled RSS by about that much."""
    sampler = pc.ProcessTreeRss()
    alone = sampler.sample()
    code = "import sys, numpy as np; a = np.ones(300 * 2**20, dtype=np.uint8); print('up', flush=True); sys.stdin.read()"
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        assert child.pid in sampler.tree_pids()
        assert sampler.sample() - alone > 300 * 2**20
    finally:
        child.communicate("", timeout=30)
    assert sampler.peak_mb * 2**20 - alone > 300 * 2**20


def _row(
    fw: str, mode: str, seed: int, s: float, acc: float, algorithm: str | None = None
) -> dict[str, object]:
    rec = {
        "framework": fw,
        "version": "1",
        "mode": mode,
        "mode_key": mode,
        "algorithm": algorithm,
        "seed": seed,
        "status": "ok",
        "error": None,
        "round_s": [9.0, s, s, 3 * s],
        "round_eval_s": [9.0, s, s, 3 * s + 1],
        "samples_per_round": [100, 100, 100, 100],
        "eval": [{"round": 4, "accuracy": acc}],
        "peak_rss_mb": 10.0,
        "startup_s": 1.0,
    }
    return harness.row_of(rec)


def test_summary_ratio_and_accuracy_tolerance() -> None:
    """Median of rounds 2..R, mean with evaluation, ratio to hpcfl's 1 process, and the accuracy rule
    |diff| <= max(2 points, 2 x pooled std)."""
    rows = [_row("hpcfl", "1proc", s, 1.0, a) for s, a in [(0, 0.80), (1, 0.82), (2, 0.81)]]
    rows += [_row("flower", "1actor", s, 2.0, a) for s, a in [(0, 0.80), (1, 0.81), (2, 0.79)]]
    rows += [_row("pfl", "sim", s, 0.5, a) for s, a in [(0, 0.70), (1, 0.71), (2, 0.72)]]
    assert rows[0]["seconds_per_round"] == 1.0  # median of 1, 1, 3
    assert rows[0]["seconds_per_round_with_eval"] == pytest.approx((1 + 1 + 4) / 3)
    assert rows[0]["samples_per_s"] == pytest.approx(300 / 5)
    summary = {s["framework"]: s for s in harness.summarise(rows)}
    assert summary["flower"]["ratio_to_hpcfl"] == pytest.approx(2.0)
    assert summary["flower"]["accuracy_diff"] == pytest.approx(-0.01)
    assert (
        summary["flower"]["accuracy_tolerance"] == pytest.approx(0.02)
        and summary["flower"]["accuracy_within"]
    )
    assert (
        summary["pfl"]["ratio_to_hpcfl"] == pytest.approx(0.5) and summary["pfl"]["accuracy_within"] is False
    )


#: Flower 1.42's defaults (flwr/serverapp/strategy/fedadam.py etc.), in hpcfl's keys, written out
#: here independently of server_opt_check.CASES: FedAdagrad's β1 is FedOpt's 0, FedAvgM's momentum 0
FLOWER_1_42_DEFAULTS = {
    "fedadam": {"server_lr": 0.1, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3},
    "fedyogi": {"server_lr": 0.01, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3},
    "fedadagrad": {"server_lr": 0.1, "beta1": 0.0, "tau": 1e-3},
    "fedavgm": {"server_lr": 1.0, "beta": 0.0},
}


@pytest.mark.parametrize("algorithm", sorted(FLOWER_1_42_DEFAULTS))
def test_hpcfl_server_optimiser_config_is_flowers_defaults(tmp_path: Path, algorithm: str) -> None:
    """run_hpcfl's ``--algorithm`` config: hpcfl's algorithm of that name with Flower's default
    hyper-parameters as its params (validated by hpcfl's own config), the rest the bundle's FedAvg
    experiment unchanged."""
    from run_hpcfl import hpcfl_config

    from hpcfl import config_from_dict

    spec = {**experiment.SPEC, "num_params": 356_234}
    fedavg = hpcfl_config(tmp_path, spec, 1, 7, "1proc")
    cfg = hpcfl_config(tmp_path, spec, 1, 7, "1proc", algorithm)
    assert fedavg["algorithm"] == "fedavg" and fedavg["params"] == {"weighting": "samples"}
    assert fedavg["name"] == "peers-1proc-1" and cfg["name"] == f"peers-{algorithm}-1proc-1"
    assert cfg["algorithm"] == algorithm and cfg["params"] == FLOWER_1_42_DEFAULTS[algorithm]
    different = {k for k in cfg if cfg[k] != fedavg[k]}
    assert different == {"name", "algorithm", "params"}
    built = config_from_dict(cfg)
    assert built.algorithm == algorithm
    assert {k: getattr(built.params, k) for k in FLOWER_1_42_DEFAULTS[algorithm]} == FLOWER_1_42_DEFAULTS[
        algorithm
    ]
    assert built.lr == spec["lr"]  # the clients train at the bundle's lr (Flower's eta_l is unused)


def test_both_runners_name_the_same_server_optimisers() -> None:
    """hpcfl's and Flower's runners offer the same algorithms (read by the harness without importing
    them), each Flower strategy is the class the unit check compared with hpcfl's algorithm of that
    name, and the other peers' runners stay FedAvg's."""
    import run_flower
    import run_hpcfl
    from server_opt_check import CASES

    assert harness.runner_algorithms("hpcfl") == harness.runner_algorithms("flower") == harness.ALGORITHMS
    assert run_hpcfl.ALGORITHMS == run_flower.ALGORITHMS == harness.ALGORITHMS
    assert harness.runner_algorithms("pfl") == ("fedavg",)
    for algorithm in harness.SERVER_OPTIMISERS:
        flower_class, case = run_flower.STRATEGIES[algorithm]
        assert CASES[case][0] == flower_class and CASES[case][2] == algorithm
        assert CASES[case][3] == run_hpcfl.FLOWER_DEFAULTS[algorithm] == FLOWER_1_42_DEFAULTS[algorithm]


def test_plan_runs_server_optimisers_on_their_runners_in_the_default_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --frameworks a server optimiser runs where a runner has it (hpcfl, Flower), in each
    framework's default mode, after FedAvg's every mode; FedAvg's plan is unchanged."""
    for fw in ("flower", "pfl", "blazefl", "fedlab"):
        (tmp_path / fw / "bin").mkdir(parents=True)
        (tmp_path / fw / "bin" / "python").touch()
        (tmp_path / fw / "READY").touch()
    monkeypatch.setenv("PEERS_DIR", str(tmp_path))
    fedavg = harness.make_plan(list(harness.FRAMEWORKS), ["fedavg"], None, "cpu", explicit=False)
    assert [(f, m) for _, f, m in fedavg] == [
        (f, m) for f in harness.FRAMEWORKS for m in harness.choose_modes(f, ["all"])
    ]
    plan = harness.make_plan(list(harness.FRAMEWORKS), ["fedavg", "fedadam"], None, "cpu", explicit=False)
    assert plan[: len(fedavg)] == fedavg
    assert plan[len(fedavg) :] == [("fedadam", "hpcfl", "1proc"), ("fedadam", "flower", "1actor")]


def test_summary_groups_by_algorithm_against_hpcfls_same_algorithm() -> None:
    """Each algorithm's rows are compared with hpcfl's run of the same algorithm; the table gains
    the algorithm column only when a server optimiser is in it."""
    rows = [_row("hpcfl", "1proc", s, 1.0, a) for s, a in [(0, 0.80), (1, 0.82), (2, 0.81)]]
    rows += [_row("hpcfl", "1proc", s, 1.0, a, "fedadam") for s, a in [(0, 0.70), (1, 0.72), (2, 0.71)]]
    rows += [_row("flower", "1actor", s, 3.0, a, "fedadam") for s, a in [(0, 0.69), (1, 0.70), (2, 0.71)]]
    summary = {(s["algorithm"], s["framework"]): s for s in harness.summarise(rows)}
    assert set(summary) == {("fedavg", "hpcfl"), ("fedadam", "hpcfl"), ("fedadam", "flower")}
    flower = summary["fedadam", "flower"]
    assert flower["accuracy_diff"] == pytest.approx(-0.01) and flower["accuracy_within"]
    assert flower["ratio_to_hpcfl"] == pytest.approx(3.0)
    assert summary["fedadam", "hpcfl"]["accuracy_diff"] == pytest.approx(0.0)
    doc = {
        "conditions": {
            "experiment": "e",
            "machine": "m",
            "load_start": [],
            "load_end": [],
            "rounds": 4,
            "seeds": [0],
        },
        "rows": rows,
        "summary": harness.summarise(rows),
        "records": [],
    }
    table = harness.markdown(doc)
    assert (
        table.startswith("# Server optimisers at Flower's defaults")
        and "| fedadam | flower | 1actor |" in table
    )
    doc["rows"] = rows[:3]
    doc["summary"] = harness.summarise(rows[:3])
    assert "| hpcfl | 1proc | 1 | 3 |" in harness.markdown(doc) and "fedadam" not in harness.markdown(doc)
