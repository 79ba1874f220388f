"""Clients never trained on (``heldout_clients``): who is held out, that they never take part,
and that their figures are what a direct evaluation of the final models gives; bad values are one
line; a stopped and resumed run ends bit-identical."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcfl.comm import LocalComm
from hpcfl.config import config_from_dict
from hpcfl.data import load_dataset, load_partition, partition
from hpcfl.errors import ConfigError
from hpcfl.runner import run_experiment
from hpcfl.runner.federation import build_federation, participation_of
from hpcfl.training.evaluate import evaluate
from tests.helpers import REPO, final_state, mpiexec_cmd, stop_after_rows, synthetic_config, write_config
from tests.test_bad_input import _fails_cleanly


def _config(data_root: Path, **extra: Any) -> dict[str, Any]:
    """Fashion-MNIST, 6 clients of which 2 held out, 2 of the other 4 per round, 3 short rounds."""
    return dict(
        name="heldout",
        data_root=str(data_root),
        dataset="fashion-mnist",
        partition="dir:0.5",
        num_clients=6,
        heldout_clients=2,
        clients_per_round=2,
        client_eval=0.2,
        model="mlp",
        rounds=3,
        local_steps=3,
        lr=0.05,
        batch_size=32,
        seed=4,
        threads=1,
        progress=False,
        **extra,
    )


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("heldout_clients=-1", "config key 'heldout_clients' must be in [0, num_clients)"),
        ("heldout_clients=4", "got 4 with num_clients 4"),
        ("heldout_clients=9", "got 9 with num_clients 4"),
        ("heldout_clients=two", "heldout_clients"),
    ],
)
def test_bad_heldout_clients_is_one_line(tmp_path, capsys, override, fragment):
    cfg = synthetic_config(tmp_path)  # 4 clients
    _fails_cleanly(capsys, ["run", str(cfg), "--run-dir", str(tmp_path / "r"), "--set", override], fragment)


def test_more_ranks_than_training_clients_is_one_line(tmp_path, capsys, monkeypatch):
    cfg = synthetic_config(tmp_path)  # 4 clients
    monkeypatch.setenv("PMI_SIZE", "4")
    monkeypatch.setenv("PMI_RANK", "0")
    argv = ["run", str(cfg), "--run-dir", str(tmp_path / "r"), "--set", "heldout_clients=1"]
    _fails_cleanly(capsys, argv, "4 ranks but only 3 clients that train")


def test_participation_counts_the_training_clients_only():
    cfg = config_from_dict(dict(num_clients=10, heldout_clients=4, participation=0.5))
    assert participation_of(cfg).count == 3  # half of the 6 that train
    cfg = config_from_dict(dict(num_clients=10, heldout_clients=4, clients_per_round=6))
    assert participation_of(cfg).count is None  # all 6 that train


def test_client_level_dp_counts_only_the_training_clients_as_sampled():
    """4 of 6 clients per round with 2 held out is everyone who trains: no sampling to amplify."""
    keys = dict(num_clients=6, clients_per_round=4, privacy={"level": "client", "noise_multiplier": 1.0})
    config_from_dict(keys)  # 4 of 6: sampled
    with pytest.raises(ConfigError, match="privacy.level=client needs sampled participation"):
        config_from_dict({**keys, "heldout_clients": 2})


@pytest.fixture(scope="module")
def ditto_run(tmp_path_factory, data_root) -> tuple[dict[str, Any], Path]:
    cfg = _config(data_root, algorithm="ditto", params={"lam": 0.5, "personal_epochs": 2})
    run_dir = tmp_path_factory.mktemp("heldout") / "ditto"
    run_experiment(config_from_dict(cfg), run_dir)
    return cfg, run_dir


def test_heldout_clients_never_train_and_their_figures_are_direct_evaluations(ditto_run):
    cfg_dict, run_dir = ditto_run
    cfg = config_from_dict(cfg_dict)
    held = json.loads((run_dir / "determinism.json").read_text())["heldout_clients"]
    assert len(held) == 2 and len(set(held)) == 2 and all(0 <= k < 6 for k in held)

    # the partition the run started from; the run's clients are the others, renumbered in order
    ds = load_dataset("fashion-mnist", cfg.data_root)
    parts = partition(
        ds.train.y, cfg.partition, 6, seed=cfg.seed, num_classes=10, min_size=cfg.min_client_size
    )
    trained = [k for k in range(6) if k not in held]
    rows = _rows(run_dir)
    drawn = {trained[i] for row in rows for i in row["participants"]}
    assert drawn and not drawn & set(held)  # participants, as partition ids, never a held-out one
    held_samples = set(torch.cat([parts[k] for k in held]).tolist())
    saved = load_partition(run_dir / "partition.json").parts  # what the run's clients train on
    assert len(saved) == 4
    assert not set(torch.cat(list(saved)).tolist()) & held_samples  # no sample of theirs trains

    # their evaluation shares: a split of their own data (the rest is what Ditto adapts on)
    fed = build_federation(cfg, LocalComm(), ds)
    assert fed.heldout is not None and list(fed.heldout.ids) == held
    for k, train, ev in zip(held, fed.heldout.train, fed.heldout.evaluation, strict=True):
        assert sorted(torch.cat([train, ev]).tolist()) == sorted(parts[k].tolist()) and ev.numel() > 0
    ev = torch.cat(list(fed.heldout.evaluation))

    # heldout_accuracy: the final global model on their evaluation shares
    server_x = final_state(run_dir)
    fed.flat.load(server_x)
    acc, loss = evaluate(fed.flat.model, ds.train.x[ev], ds.train.y[ev], LocalComm())
    last = rows[-1]
    assert last["heldout_accuracy"] == acc
    assert last["heldout_loss"] == pytest.approx(loss, rel=1e-6)  # float32 sums over other batches

    # heldout_personal_accuracy: Ditto's adaptation by hand, from the final global model w: the
    # global update from w, then v trained from w with the pull λ(v − w) for personal_epochs passes
    # on the client's training share, with the adaptation's generator; v is scored
    from hpcfl.algorithms import ClientData
    from hpcfl.algorithms.fedrep import passes
    from hpcfl.runner.heldout import _ADAPT_SALT
    from hpcfl.training.batched import LinearCorrection
    from hpcfl.training.seeds import seeded_generator

    trainer, P = fed.trainer, fed.algorithm.num_params
    correct = n = 0.0
    for j in range(len(held)):
        idx, kid = fed.heldout.train[j], 4 + j
        data = ClientData(k=kid, x=ds.train.x[idx], y=ds.train.y[idx])
        gen = seeded_generator(cfg.seed, _ADAPT_SALT, cfg.rounds - 1, kid)
        trainer.train_tallies(server_x, data, gen)  # the global update draws its batches first
        pull = LinearCorrection(pull=0.5, anchor=server_x[:P])
        v, _ = trainer.train_tallies(
            server_x, data, gen, correction=pull, schedule=passes(trainer.schedule, 2)
        )
        fed.flat.load(v)
        e = fed.heldout.evaluation[j]
        a, _ = evaluate(fed.flat.model, ds.train.x[e], ds.train.y[e], LocalComm())
        correct += round(a * e.numel())
        n += e.numel()
    assert last["heldout_personal_accuracy"] == correct / n
    assert last["heldout_personal_accuracy"] != last["heldout_accuracy"]  # the adaptation did something


def test_heldout_run_stopped_and_resumed_is_bit_identical(ditto_run, tmp_path):
    cfg_dict, reference = ditto_run
    cfg = config_from_dict(cfg_dict)
    run_dir = tmp_path / "resumed"
    run_experiment(cfg, run_dir, stop=stop_after_rows(run_dir, 2))
    assert len(_rows(run_dir)) == 2
    result = run_experiment(cfg, run_dir, resume=True)
    assert torch.equal(result.server.x, final_state(reference))
    keys = ("heldout_accuracy", "heldout_loss", "heldout_personal_accuracy", "heldout_personal_loss")
    for a, b in zip(_rows(run_dir), _rows(reference), strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
        assert a["participants"] == b["participants"]


@pytest.mark.mpi
def test_heldout_figures_on_two_ranks_equal_one_rank(ditto_run, tmp_path):
    """The held-out clients are placed on ranks; each rank evaluates (and adapts) its clients whole,
    so 2 ranks give the 1-rank run's state and figures bit for bit."""
    cfg_dict, reference = ditto_run
    cfg = write_config(tmp_path / "cfg.yaml", **cfg_dict)
    proc = subprocess.run(
        mpiexec_cmd(2, "run", str(cfg), "--run-dir", str(tmp_path / "r2")),
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert torch.equal(final_state(tmp_path / "r2"), final_state(reference))
    keys = ("heldout_accuracy", "heldout_loss", "heldout_personal_accuracy", "heldout_personal_loss")
    for a, b in zip(_rows(tmp_path / "r2"), _rows(reference), strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
