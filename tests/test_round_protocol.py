"""The declared-round contract: results unchanged by the redesign, placement-independent sums,
partial participation, counted bytes, named state slices, validated params."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from hpcfl.config import config_from_dict
from hpcfl.runner import run_experiment
from tests.helpers import REPO

GOLDEN = json.loads((REPO / "tests" / "golden" / "final_state_hashes.json").read_text())


def _sha(x: torch.Tensor) -> str:
    return hashlib.sha256(x.contiguous().numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("algorithm", sorted(GOLDEN))
def test_redesign_keeps_final_parameters_bit_identical(tmp_path: Path, algorithm: str) -> None:
    """Hashes recorded on the code before the redesign (float32 sums in client order on one rank);
    the config is the recorded one, written in its legacy form, with ``reduction: float32``.
    Issue 16 changed TCT's eNTK head on purpose: ``tct`` was re-recorded with the fresh 1-output
    head, and ``tct-head-keep`` (``stage2.head: keep``) still matches the pre-redesign hash.

    Bit-exact float32 results depend on the SIMD kernels chosen for the CPU, so each entry holds
    one hash per PyTorch CPU capability (AVX512 from the first dev machine, AVX2 recorded by
    running commit 0ad1a79 on an AVX2 one); ``tests/golden/record_hashes.py`` adds another."""
    entry = GOLDEN[algorithm]
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in entry["sha256"]:
        pytest.skip(
            f"no {algorithm} hash recorded for CPU capability {capability}: see tests/golden/record_hashes.py"
        )
    cfg = config_from_dict({**entry["config"], "reduction": "float32"})
    result = run_experiment(cfg, tmp_path / "run")
    assert _sha(result.server.x) == entry["sha256"][capability], (algorithm, capability)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _partial_config(tmp_path: Path, **extra):
    from tests.helpers import synthetic_config

    keys = dict(
        num_clients=9,
        clients_per_round=5,
        algorithm="scaffold",
        rounds=5,
        local_steps=3,
        dataset_options={"n_train": 900, "n_test": 100, "seed": 3},
    )
    keys.update(extra)
    return synthetic_config(tmp_path, **keys)


@pytest.mark.mpi
def test_partial_participation_is_bit_identical_on_1_2_and_3_ranks_and_after_resume(tmp_path: Path) -> None:
    """float64 reduction: the same participants and bit-identical parameters whatever the
    placement; on 2 and 3 ranks the client states live in the on-disk store (any rank trains any
    client); a 2-rank run stopped after 3 rounds and resumed on 3 ranks ends identical too. The
    conformal sets, computed from softmax outputs sharded over ranks, agree up to one borderline
    test point (a batch of another size may round a probability differently)."""
    import subprocess

    from hpcfl.config import load_config
    from tests.helpers import final_state, mpiexec_cmd, run_cli

    cfg = _partial_config(tmp_path, conformal=True)
    one = run_experiment(load_config(cfg), tmp_path / "r1")
    env = {"PYTHONPATH": str(REPO)}
    import os

    for n in (2, 3):
        proc = subprocess.run(
            mpiexec_cmd(n, "run", str(cfg), "--run-dir", str(tmp_path / f"r{n}")),
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        assert torch.equal(final_state(tmp_path / f"r{n}"), one.server.x), n
        assert [r["participants"] for r in _rows(tmp_path / f"r{n}")] == [
            r["participants"] for r in one.metrics
        ]
        assert (tmp_path / f"r{n}" / "client_states_train.zarr").is_dir()
        last = _rows(tmp_path / f"r{n}")[-1]
        for key, one_point in (
            ("lac_coverage_90", 1 / 50),
            ("aps_coverage_95", 1 / 50),
            ("aps_set_size_99", 10 / 50),
        ):
            assert abs(last[key] - one.metrics[-1][key]) <= one_point + 1e-12, (n, key)
    # stopped after 3 rounds on 2 ranks, resumed to 5 on 3 ranks
    short = run_cli("run", str(cfg), "--run-dir", str(tmp_path / "rs"), "--set", "rounds=3")
    assert short.returncode == 0, short.stderr
    proc = subprocess.run(
        mpiexec_cmd(
            3,
            "run",
            str(cfg),
            "--run-dir",
            str(tmp_path / "rs"),
            "--resume",
            "--set",
            "client_state_memory=disk",
        ),
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0 and "client_state_memory" in proc.stderr  # memory-form checkpoint, disk run
    proc = subprocess.run(
        mpiexec_cmd(2, "run", str(cfg), "--run-dir", str(tmp_path / "rd"), "--set", "rounds=3"),
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(
        mpiexec_cmd(3, "run", str(cfg), "--run-dir", str(tmp_path / "rd"), "--resume"),
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert torch.equal(final_state(tmp_path / "rd"), one.server.x)


def test_participants_are_a_pure_function_of_seed_and_round() -> None:
    from hpcfl.algorithms.participation import Participation, Population
    from hpcfl.runner.rounds import round_generator

    pop = Population(tuple(range(10, 60)))
    for weighting in ("uniform", "size"):
        part = Participation(count=10, weighting=weighting)
        a = [part.sample(pop, round_generator(0, 0, r)) for r in range(20)]
        b = [part.sample(pop, round_generator(0, 0, r)) for r in range(20)]
        assert a == b and all(len(s) == 10 == len(set(s)) for s in a)
        assert len({tuple(s) for s in a}) > 15  # rounds differ
    big = Participation(count=5, weighting="size")
    counts = torch.zeros(50)
    for r in range(400):
        for k in big.sample(pop, round_generator(1, 0, r)):
            counts[k] += 1
    assert counts[40:].sum() > 2 * counts[:10].sum()  # larger clients are drawn more often


def test_placement_per_round_is_balanced() -> None:
    from hpcfl.comm import place_round

    sizes = [int(s) for s in torch.randint(50, 500, (100,), generator=torch.Generator().manual_seed(0))]
    for ranks in (2, 3, 4, 8, 25):
        placed = place_round(list(range(100)), sizes, ranks)
        assert sorted(k for ks in placed for k in ks) == list(range(100))
        loads = [sum(sizes[k] for k in ks) for ks in placed]
        assert max(loads) <= 1.15 * (sum(loads) / ranks), (ranks, loads)
    assert place_round([3], [10], 2) == [[3], []]  # fewer participants than ranks: a rank idles


def test_counted_bytes_equal_the_declared_exchange(tmp_path: Path) -> None:
    """bytes_up is |S| x the declared sums (SCAFFOLD's control-variate form: model + dc), bytes_down
    |S| x the server state; FedAvg uploads half of that."""
    from hpcfl.config import load_config

    cfg = load_config(_partial_config(tmp_path, rounds=2))
    res = run_experiment(cfg, tmp_path / "s")
    P = res.server.c.numel()
    L = res.server.x.numel()
    row = res.metrics[-1]
    assert row["bytes_up"] == 5 * 4 * (L + P)
    assert row["bytes_down"] == 5 * 4 * (L + P)
    cfg = load_config(_partial_config(tmp_path, rounds=2, algorithm="fedavg", drift_diversity=True))
    row = run_experiment(cfg, tmp_path / "f").metrics[-1]
    assert row["drift_diversity"] and all(
        v >= 1 / 5 - 1e-9 for v in row["drift_diversity"].values()
    )  # >= 1/|S|
    assert row["bytes_up"] == row["bytes_down"] == 5 * 4 * L
    assert row["local_loss_min"] <= row["local_loss"] <= row["local_loss_max"]


def test_state_layout_names_module_slices() -> None:
    from hpcfl.models import build_model
    from hpcfl.training import FlatModel
    from hpcfl.training.layout import StateLayout

    model = build_model("simplecnn", (1, 28, 28), 10)
    layout = StateLayout.of_model(model)
    flat = FlatModel(model)
    assert layout.size == flat.size and layout.num_params == flat.num_params
    last = layout.last_modules(2, "Linear")
    entries = layout.params_of(last)
    mask = layout.mask(entries)
    expected = sum(p.numel() for name, p in model.named_parameters() if name.rsplit(".", 1)[0] in last)
    assert int(mask.sum()) == expected
    for e in entries:  # the slice is the parameter's own storage in the flat vector
        assert torch.equal(
            flat.vector[e.start : e.stop], dict(model.named_parameters())[e.name].detach().flatten()
        )
    from hpcfl.errors import ConfigError

    with pytest.raises(ConfigError, match="did you mean"):
        layout.params_of(["fc22"])


def test_params_are_validated_against_the_algorithm(tmp_path: Path) -> None:
    from hpcfl.config import load_config
    from hpcfl.errors import ConfigError

    assert load_config(None, ["algorithm=fedprox", "params.mu=0.5"]).params.mu == 0.5
    assert load_config(None, ["algorithm=fedprox", "fedprox.mu=0.25"]).params.mu == 0.25  # legacy section
    with pytest.raises(ConfigError, match="did you mean 'params.mu'"):
        load_config(None, ["algorithm=fedprox", "params.muu=0.5"])
    with pytest.raises(ConfigError, match="params.mu"):
        load_config(None, ["algorithm=fedprox", "params.mu=abc"])
    tct = load_config(None, ["algorithm=tct", "stage2.lr=0.001", "params.stage1.rounds=3"])
    assert tct.params.stage2.lr == 0.001 and tct.params.stage1.rounds == 3


# kill -9 with client states on disk, then resume: every algorithm, in tests/test_contract.py


def test_partition_and_report_show_who_participated(tmp_path: Path, data_root: Path) -> None:
    """`hpcfl partition --clients-per-round` prints the very draw `hpcfl run` makes; the report
    says how many of how many clients trained per round. (``hpcfl partition`` reads the real
    Fashion-MNIST labels: ``data_root`` skips it where they are absent.)"""
    from hpcfl.config import load_config
    from tests.helpers import run_cli

    cfg = load_config(_partial_config(tmp_path, algorithm="fedavg", rounds=3, seed=7))
    res = run_experiment(cfg, tmp_path / "run")
    proc = run_cli(
        "partition",
        "--dataset",
        "fashion-mnist",
        "--partition",
        "iid",
        "--num-clients",
        "9",
        "--seed",
        "7",
        "--clients-per-round",
        "5",
        "--rounds",
        "3",
        "--out",
        str(tmp_path / "p"),
    )
    assert proc.returncode == 0, proc.stderr
    printed = [line for line in proc.stdout.splitlines() if line.startswith("round ")]
    assert printed == [
        f"round {r['round']}: clients {' '.join(map(str, r['participants']))}" for r in res.metrics
    ]
    rep = run_cli("report", str(tmp_path / "run"), "--out", str(tmp_path / "rep"))
    assert rep.returncode == 0, rep.stderr
    assert "5 of 9 (each trained" in (tmp_path / "rep" / "report.md").read_text()


@pytest.mark.parametrize("sizes", [(20, 20, 20), (12, 25, 40)])
def test_drift_diversity_equals_a_direct_computation_from_the_client_updates(sizes) -> None:
    """xi_l = sum_i ||w_i m_i,l||^2 / ||sum_i w_i m_i,l||^2 (FedPVR Eq. 2; w_i = n_i, which drops
    out when the sizes are equal), from the round's own sums and one vector of per-layer norms."""
    from torch import nn

    from hpcfl.algorithms import ClientData, FedAvg, Trainer
    from hpcfl.metrics.drift import DriftDiversity
    from hpcfl.training import FlatModel, LocalSchedule
    from hpcfl.training.layout import StateLayout
    from tests.helpers import simulate

    g = torch.Generator().manual_seed(0)
    clients = [
        ClientData(k, torch.randn(n, 6, generator=g) + k, torch.randint(0, 3, (n,), generator=g))
        for k, n in enumerate(sizes)
    ]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    flat = FlatModel(model)
    trainer = Trainer(flat, LocalSchedule(lr=0.1, batch_size=8, steps=4))
    layout = StateLayout.of_model(model)
    algo = FedAvg(FedAvg.Params(), layout=layout)
    x0 = flat.vector.clone()
    rows = []
    simulate(
        algo,
        clients,
        trainer,
        1,
        server=algo.init_server(x0),
        drift=DriftDiversity(layout),
        reduction="float64",
        hook=lambda done, srv, st, row: rows.append(row) or False,
    )
    updates = []
    for c in clients:  # the same local training, by hand
        x, _ = trainer.train(x0, c, torch.Generator())
        updates.append((x - x0).double() * c.n)
    for name, xi in rows[0]["drift_diversity"].items():
        sl = [slice(e.start, e.stop) for e in layout.params_of([name])]
        num = sum(float(sum((u[s] ** 2).sum() for s in sl)) for u in updates)
        total = sum(updates)
        den = float(sum((total[s] ** 2).sum() for s in sl))
        assert xi == pytest.approx(num / den, rel=1e-6), name  # float32 models
    assert set(rows[0]["drift_diversity"]) == {"0", "2"}


def test_float64_sums_are_added_in_draw_order_whatever_the_placement() -> None:
    """A float64 sum has no wider type to accumulate in, so on several ranks each participant gets
    a slot: every split of the participants over ranks, summed as the allreduce sums it, gives the
    bits of one rank's running sum, where per-rank partial sums (the loop's float32 path) do not."""
    from hpcfl.algorithms.base import Exchange, SumSpec, Upload
    from hpcfl.runner.buffer import BufferLayout
    from hpcfl.runner.rounds import _accumulate, _in_draw_order

    g = torch.Generator().manual_seed(0)
    n, length = 5, 1000
    vecs = [torch.randn(length, dtype=torch.float64, generator=g) * 10.0**k for k in range(n)]
    weights = [float(3 + 7 * k) for k in range(n)]
    ex = Exchange(sums=(SumSpec("x", length, torch.float64),))
    running = torch.zeros(length, dtype=torch.float64)
    for v, w in zip(vecs, weights, strict=True):
        running.add_(v, alpha=w)
    layout = BufferLayout.of([("sum:x", length * n), ("weight", 1), ("count", 1), ("weights", n)])
    partial_sums_differ = False
    for split in ([[0, 1, 2, 3, 4]], [[0, 2, 4], [1, 3]], [[4], [0, 1, 2, 3]], [[3], [1], [0, 2, 4]]):
        reduced = torch.zeros(layout.size, dtype=torch.float64)
        partial = torch.zeros(length, dtype=torch.float64)
        for rank in split:
            buf = layout.allocate(torch.float64)
            mine = torch.zeros(length, dtype=torch.float64)
            for i in rank:
                upload = Upload({"x": vecs[i]}, weights[i])
                _accumulate(upload, layout, buf, ex, torch.float64, i, frozenset({"x"}))
                mine.add_(vecs[i], alpha=weights[i])
            reduced += buf  # the allreduce
            partial += mine
        assert torch.equal(_in_draw_order(layout, reduced, ex.sums[0], n), running)
        assert float(layout.view(reduced, "weight")) == sum(weights)
        partial_sums_differ |= not torch.equal(partial, running)
    assert partial_sums_differ  # the placement matters without the slots
