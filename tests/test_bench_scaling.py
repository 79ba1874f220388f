"""``hpcfl bench scaling``: the efficiency / allreduce-model / projection arithmetic on made-up
timings, the report files, and real (tiny) worker runs at 1 rank and, under mpiexec, at 2 ranks."""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcfl.bench import scaling as sc
from hpcfl.files import read_jsonl


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sc.add_arguments(parser)
    return parser.parse_args(list(argv))


def _raw(model: str, clients: int, ranks: int, train_s: float, eval_s: float = 0.0, **extra: Any) -> dict:
    """A made-up raw row as a worker writes it (only the fields the summary reads)."""
    row = {
        "config": "scaling",
        "model": model,
        "clients": clients,
        "ranks": ranks,
        "nodes": 1,
        "threads": 1,
        "samples_per_client": 200,
        "samples_per_round": 200 * clients,
        "compute_s": 0.9 * train_s,
        "allreduce_s": 0.1 * train_s,
        "allreduce_wait_s": 0.0,
        "train_s": train_s,
        "eval_s": eval_s,
        "payload_floats": 1000,
        "oversubscribed": False,
    }
    row.update(extra)
    return row


# ---- the allreduce model ---------------------------------------------------------------------


def test_ring_allreduce_time_follows_the_formula() -> None:
    assert sc.ring_allreduce_s(1, 1e9, 1e-6, 1e9) == 0.0, "one rank communicates nothing"
    assert sc.ring_allreduce_s(2, 4e6, 1e-6, 1e9) == pytest.approx(2e-6 + 4e-3)
    assert sc.ring_allreduce_s(4, 4e6, 1e-6, 1e9) == pytest.approx(6e-6 + 1.5 * 4e-3)


@pytest.mark.parametrize("ranks", [(2,), (2, 4, 8)])
def test_fit_recovers_alpha_and_beta(ranks: tuple[int, ...]) -> None:
    alpha, beta = 7e-6, 3e9
    samples = [(r, n, sc.ring_allreduce_s(r, n, alpha, beta)) for r in ranks for n in sc.PROBE_SIZES]
    got_alpha, got_beta = sc.fit_alpha_beta(samples)
    assert got_alpha == pytest.approx(alpha, rel=1e-6), "latency"
    assert got_beta == pytest.approx(beta, rel=1e-6), "bandwidth"


def test_fit_never_returns_a_negative_latency() -> None:
    # pure bandwidth plus a slight negative offset: the unconstrained fit would give alpha < 0
    samples = [(2, n, n / 1e9 - 1e-7) for n in (1e5, 1e6, 1e7)]
    alpha, beta = sc.fit_alpha_beta(samples)
    assert alpha == 0.0 and 0.9e9 < beta < 1.1e9


# ---- efficiencies on made-up measurements ----------------------------------------------------


def test_strong_and_weak_efficiency_from_rows() -> None:
    raw = [
        _raw("simplecnn", 10, 1, 2.0),
        _raw("simplecnn", 10, 2, 1.1),
        _raw("simplecnn", 50, 1, 10.0),
        _raw("simplecnn", 100, 2, 10.5),
        _raw("simplecnn", 100, 1, 20.0),
        _raw("simplecnn", 100, 4, 8.0, oversubscribed=True),
    ]
    rows = {(r["clients"], r["ranks"]): r for r in sc.summarize_rows(raw, eval_every=1)}
    assert rows[(10, 1)]["strong_eff"] is None, "the base has no efficiency of its own"
    assert rows[(10, 2)]["strong_eff"] == pytest.approx(2.0 / (2 * 1.1))
    assert rows[(100, 2)]["weak_eff"] == pytest.approx(10.0 / 10.5)
    assert rows[(100, 2)]["weak_base"] == "R=1,K=50"
    assert rows[(100, 2)]["strong_eff"] == pytest.approx(20.0 / (2 * 10.5))
    assert rows[(100, 4)]["strong_eff"] == pytest.approx(20.0 / (4 * 8.0))
    assert rows[(100, 4)]["weak_eff"] is None, "(R=1, K=25) was not measured"
    assert rows[(100, 4)]["oversubscribed"] is True
    assert rows[(10, 2)]["rounds_per_s"] == pytest.approx(1 / 1.1)
    assert rows[(10, 2)]["samples_per_s"] == pytest.approx(2000 / 1.1)
    assert rows[(10, 2)]["allreduce_share"] == pytest.approx(0.1)


def test_evaluation_is_amortised_over_eval_every() -> None:
    raw = [_raw("mlp", 10, 1, 2.0, eval_s=1.0), _raw("mlp", 10, 2, 1.0, eval_s=0.5)]
    rows = {r["ranks"]: r for r in sc.summarize_rows(raw, eval_every=5)}
    assert rows[1]["round_s"] == pytest.approx(2.2)
    assert rows[2]["round_s"] == pytest.approx(1.1)
    assert rows[2]["strong_eff"] == pytest.approx(1.0)
    assert rows[1]["eval_share"] == pytest.approx(0.2 / 2.2)


def test_repeated_measurements_keep_the_fastest() -> None:
    raw = [
        _raw("mlp", 10, 2, 1.5, slurm_job_id="11"),
        _raw("mlp", 10, 2, 1.2, slurm_job_id="12"),
        _raw("mlp", 10, 2, 1.3, slurm_job_id="12"),
    ]
    (row,) = sc.summarize_rows(raw, eval_every=1)
    assert row["train_s"] == 1.2 and row["measurements"] == 3 and row["slurm_job_ids"] == "11,12"


def test_rows_at_different_node_counts_stay_apart() -> None:
    raw = [_raw("mlp", 16, 1, 16.0), _raw("mlp", 16, 8, 2.5), _raw("mlp", 16, 8, 2.2, nodes=2)]
    rows = sc.summarize_rows(raw, eval_every=1)
    assert len(rows) == 3
    effs = sorted(r["strong_eff"] for r in rows if r["ranks"] == 8)
    assert effs == pytest.approx([16 / (8 * 2.5), 16 / (8 * 2.2)])


# ---- the projection --------------------------------------------------------------------------


def _cm(**kw: Any) -> sc.ComputeModel:
    base = dict(
        model="m",
        per_client_s=0.1,
        eval_1rank_s=0.0,
        payload_floats=1000,
        samples_per_client=200,
        eval_every=1,
        source="made up",
    )
    base.update(kw)
    return sc.ComputeModel(**base)


def test_projected_round_counts_stragglers_and_the_buffer() -> None:
    net = sc.Network("n", 1e-6, 1e9, "made up")
    p = sc.projected_round(_cm(), net, ranks=3, clients=10)
    assert p["compute_s"] == pytest.approx(0.4), "ceil(10/3) = 4 clients on the slowest rank"
    assert p["allreduce_s"] == pytest.approx(4e-6 + 4 / 3 * 8 * (1000 + 2 * 10 + 2 + 3 * 3) / 1e9)
    assert p["eval_s"] == pytest.approx(4e-6 + 4 / 3 * 24 / 1e9), "eval: only its counts' allreduce"
    assert p["round_s"] == pytest.approx(p["compute_s"] + p["allreduce_s"] + p["eval_s"])
    assert p["samples_per_s"] == pytest.approx(2000 / p["round_s"])
    with pytest.raises(ValueError):
        sc.projected_round(_cm(), net, ranks=11, clients=10)


def test_projection_efficiencies() -> None:
    free = sc.Network("free", 0.0, math.inf, "no communication cost")
    weak = sc.project(_cm(), free, sc.powers_of_two(512), lambda r: 10 * r, "weak")
    assert [p["ranks"] for p in weak][-1] == 512
    assert all(p["efficiency"] == pytest.approx(1.0) for p in weak), "free network: perfect weak scaling"
    strong = sc.project(_cm(), free, sc.powers_of_two(512), lambda r: 1000, "strong")
    at = {p["ranks"]: p for p in strong}
    assert at[1]["efficiency"] == 1.0
    assert at[512]["efficiency"] == pytest.approx(1000 / (512 * 2)), "2 clients per rank, 1000/512 ideal"
    slow = sc.Network("slow", 1e-3, 1e8, "slow")
    s2 = {p["ranks"]: p for p in sc.project(_cm(), slow, [1, 2, 4], lambda r: 4, "strong")}
    assert s2[4]["efficiency"] < s2[2]["efficiency"] < 1.0
    assert sc.project(_cm(), free, [1, 2, 8], lambda r: 4, "strong")[-1]["ranks"] == 2, "R > K skipped"


def test_build_projection_is_labelled_and_uses_the_probe() -> None:
    rows = sc.summarize_rows([_raw("simplecnn", 10, 1, 2.0), _raw("simplecnn", 10, 2, 1.0)], 5)
    probe = {"ranks": 2, "nodes": 1, "alpha_s": 3e-6, "beta_Bps": 5e9, "mpi": "MPICH"}
    proj = sc.build_projection(
        rows, probe, eval_every=5, max_ranks=512, strong_clients=1000, weak_clients_per_rank=10
    )
    assert "PROJECTION" in proj["label"]
    assert [n["name"] for n in proj["networks"]] == ["measured", "IB-like"]
    assert "shared-memory" in proj["networks"][0]["source"]
    assert proj["inputs"][0]["per_client_s"] == pytest.approx(0.9 * 2.0 / 10)
    assert {p["ranks"] for p in proj["strong"]["rows"]} == set(sc.powers_of_two(512))
    assert all(p["projection"] for p in proj["weak"]["rows"])


# ---- report files and a real worker ----------------------------------------------------------


def test_summarize_writes_csv_json_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    point = tmp_path / "nodes1-ranks2"
    point.mkdir()
    for row in (_raw("simplecnn", 10, 1, 2.0), _raw("simplecnn", 10, 2, 1.05)):
        (tmp_path if row["ranks"] == 1 else point).joinpath(sc.ROWS_FILE).open("a").write(
            json.dumps(row) + "\n"
        )
    (point / sc.PROBE_FILE).write_text(json.dumps({"ranks": 2, "nodes": 1, "alpha_s": 1e-6, "beta_Bps": 1e9}))
    args = _args("--summarize", str(tmp_path))
    assert sc.run_cli(args) == 0
    for name in ("scaling.csv", "scaling.json", "scaling.png", "scaling_time_split.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    report = json.loads((tmp_path / "scaling.json").read_text())
    assert report["projection"]["label"] == sc.PROJECTION_LABEL
    assert report["acceptance"]["strong_eff_simplecnn_1_to_2_ranks"]["min"] == pytest.approx(2 / 2.1)
    assert report["machine"]["cpu_model"]  # the machine the figures came from (issue 66)
    with open(tmp_path / "scaling.csv") as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == 2 and all(row["cpu_model"] == report["machine"]["cpu_model"] for row in table)
    assert "PROJECTION" in capsys.readouterr().out


def test_bench_dispatcher_registers_scaling_and_entk() -> None:
    from hpcfl.cli.main import build_parser

    args = build_parser().parse_args(["bench", "scaling", "--summarize", "x"])
    assert args.func is sc.run_cli
    assert build_parser().parse_args(["bench", "entk"]).bench_kind == "entk"


def _check_row(row: dict[str, Any], ranks: int) -> None:
    assert row["ranks"] == ranks and row["clients"] == 2 and row["model"] == "mlp"
    assert row["timed_rounds"] == 1 and len(row["per_round"]) == 1, "warm-up round dropped"
    assert row["samples_per_client"] == 20 and row["samples_per_round"] == 40
    assert row["compute_s"] > 0 and row["train_s"] >= row["compute_s"] and row["eval_s"] > 0
    assert row["allreduce_s"] >= 0 and row["buffer_bytes"] == 8 * (
        row["payload_floats"] + 2 * 2 + 2 + 3 * ranks
    )
    assert row["nodes"] == 1 and row["threads"] == 1


def test_worker_measures_one_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in sc.LAUNCHED_VARS:
        monkeypatch.delenv(var, raising=False)
    from hpcfl.comm.local import LocalComm

    identity: list[bool] = []  # per allreduce of the run: whether it handed back its own buffer
    reduce = LocalComm.allreduce

    def spy(self: LocalComm, tensor: torch.Tensor) -> torch.Tensor:
        out = reduce(self, tensor)
        identity.append(out is tensor)
        return out

    monkeypatch.setattr(LocalComm, "allreduce", spy)
    threads = torch.get_num_threads()
    args = _args(
        "--worker", "--models", "mlp", "--clients", "2", "--clients-per-rank", "0",
        "--samples-per-client", "20", "--test-samples", "40", "--rounds", "2", "--out", str(tmp_path),
    )  # fmt: skip
    try:
        assert sc.run_cli(args) == 0
    finally:
        torch.set_num_threads(threads)
    (row,) = read_jsonl(tmp_path / sc.ROWS_FILE)
    _check_row(row, ranks=1)
    # one rank: the allreduce is the identity (no copy, no wait), whatever the clock says under load
    assert len(identity) >= 2 and all(identity), identity
    assert row["allreduce_wait_s"] == 0 and row["train_s"] >= row["allreduce_s"]


@pytest.mark.mpi
def test_launcher_sweeps_one_and_two_ranks(tmp_path: Path) -> None:
    args = _args(
        "--ranks", "1,2", "--models", "mlp", "--clients", "2", "--clients-per-rank", "0",
        "--samples-per-client", "20", "--test-samples", "40", "--rounds", "2", "--out", str(tmp_path),
        "--probe-budget", "0.01", "--timeout", "120",
    )  # fmt: skip
    assert sc.run_cli(args) == 0
    rows = {r["ranks"]: r for r in read_jsonl(tmp_path / sc.ROWS_FILE)}
    assert sorted(rows) == [1, 2]
    _check_row(rows[2], ranks=2)
    (probe,) = read_jsonl(tmp_path / sc.PROBE_FILE)
    assert probe["ranks"] == 2 and probe["alpha_s"] >= 0 and probe["beta_Bps"] > 0
    report = json.loads((tmp_path / "scaling.json").read_text())
    two = [r for r in report["rows"] if r["ranks"] == 2]
    assert two[0]["strong_eff"] is not None and two[0]["strong_base"] == "R=1,K=2"
    assert report["projection"]["networks"][0]["name"] == "measured"


def test_requeued_slurm_job_skips_what_it_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for var in sc.LAUNCHED_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    earlier = _raw("mlp", 2, 1, 1.0, slurm_job_id="77", slurm_restart_count=0)
    (tmp_path / sc.ROWS_FILE).write_text(json.dumps(earlier) + "\n")
    args = _args(
        "--worker", "--models", "mlp", "--clients", "2", "--clients-per-rank", "0", "--out", str(tmp_path)
    )
    assert sc.run_cli(args) == 0
    assert len(read_jsonl(tmp_path / sc.ROWS_FILE)) == 1, "nothing measured twice"
    assert "already measured by this job" in capsys.readouterr().out
