"""System heterogeneity (issue 42): unequal local work, stragglers and dropped participants.

The contract suite (tests/test_contract.py) checks every algorithm's resume bit-identity, 1-vs-2-rank
equality and bytes with the section on; here: the draws themselves, the bad inputs, and what the
round does with them (the server step over what arrived, a dropped client's state untouched, the
work each participant actually did reaching FedNova's and SCAFFOLD's formulas, vectorised groups).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcfl.algorithms.system import SystemModel, SystemSection, WorkSection, read_trace
from hpcfl.cli.main import main
from hpcfl.comm import LocalComm
from hpcfl.config import config_from_dict
from hpcfl.runner import run_experiment
from hpcfl.runner.federation import build_federation, client_generator
from hpcfl.training.sgd import LocalSchedule, local_norm
from tests.helpers import REPO, synthetic_config, write_config
from tests.test_bad_input import _fails_cleanly
from tests.test_contract import BASE

SIZES = (40, 55, 70, 90, 30, 64)
BASE_SCHEDULE = LocalSchedule(lr=0.1, batch_size=16, epochs=5)


def _model(seed: int = 1, schedule: LocalSchedule = BASE_SCHEDULE, **work: Any) -> SystemModel:
    model = SystemModel.of(SystemSection(work=WorkSection(**work)), seed, schedule, SIZES)
    assert model is not None
    return model


# -- the draws -------------------------------------------------------------------------------------


def test_uniform_work_is_a_pure_function_of_seed_round_and_client_and_covers_its_bounds() -> None:
    m = _model(kind="uniform", low=2, high=5)
    who = (0, 2, 3, 5)
    first = m.draw(0, 7, 8, who)
    assert first == m.draw(0, 7, 8, who)  # same inputs, same draw (any rank, any resume)
    assert m.draw(0, 7, 8, (3,)).work[3] == first.work[3]  # a client's work ignores the others
    seen = [m.draw(0, r, r + 1, who).work[k] for r in range(200) for k in who]
    assert set(seen) == {2, 3, 4, 5}
    assert abs(sum(seen) / len(seen) - 3.5) < 0.15  # 800 draws: the mean of U{2..5} is 3.5
    assert m.draw(0, 7, 8, who) != m.draw(1, 7, 8, who)  # another stage draws anew
    steps = first.steps[3]
    assert steps == first.work[3] * math.ceil(SIZES[3] / 16)  # epochs → steps of that client


def test_lognormal_work_stays_within_its_bounds() -> None:
    m = _model(kind="lognormal", low=1, high=4, mu=0.5, sigma=1.0)
    seen = [m.draw(0, r, r + 1, (0, 1)).work[k] for r in range(300) for k in (0, 1)]
    assert min(seen) == 1 and max(seen) == 4 and len(set(seen)) == 4


def test_stragglers_are_a_fraction_of_the_round_doing_less_work_or_dropped() -> None:
    who = (0, 1, 2, 3, 4, 5)
    keep = _model(kind="stragglers", fraction=0.5)
    drop = _model(kind="stragglers", fraction=0.5, drop=True)
    for r in range(50):
        kept, dropped = keep.draw(0, r, r + 1, who), drop.draw(0, r, r + 1, who)
        assert len(kept.stragglers) == 3 and kept.stragglers == dropped.stragglers
        assert set(kept.work) == set(kept.stragglers) and not kept.dropped
        assert all(1 <= kept.work[k] <= 4 for k in kept.stragglers)  # [1, E − 1], E = 5
        assert dropped.dropped == kept.stragglers and not dropped.work
    nobody = _model(kind="stragglers", fraction=0.0).draw(0, 0, 1, who)
    assert nobody.stragglers == () and nobody.steps == {k: 5 * math.ceil(SIZES[k] / 16) for k in who}


def test_dropout_probability_and_trace(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("round,client\n3,1\n3,4\n")
    section = SystemSection()
    section.dropout.probability = 0.2
    section.dropout.trace = str(trace)
    m = SystemModel.of(section, 4, BASE_SCHEDULE, SIZES)
    assert m is not None
    drops = [len(m.draw(0, r, r + 1, tuple(range(6))).dropped) for r in range(500)]
    assert abs(sum(drops) / 3000 - 0.2) < 0.025  # 3000 Bernoulli(0.2) draws: ±3.4 standard errors
    assert {1, 4} <= set(m.draw(0, 2, 3, tuple(range(6))).dropped)  # the trace names 1-based rounds


# -- bad input: one line, before any work --------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["system.dropout.probability=1.5"], ("'system.dropout.probability' must be in [0, 1]",)),
        (["system.dropout.probability=-0.1"], ("must be in [0, 1]",)),
        (["system.dropout.probability=1"], ("every participant of every round would drop",)),
        (["system.work.kind=uniform", "system.work.low=5", "system.work.high=2"], ("reversed", "5 > high 2")),
        (["system.work.kind=gaussian"], ("'system.work.kind' must be one of",)),
        (["system.work.kind=fixed", "system.work.per_client=[1,2]"], ("one work value per client (4)",)),
        (["system.work.kind=stragglers", "system.work.fraction=1.2"], ("'system.work.fraction'",)),
        (["system.work.kind=stragglers", "system.work.fraction=0.5"], ("local_epochs >= 2",)),
        (["system.work.unit=epochs", "local_steps=3"], ("unit' is epochs but local_steps is set",)),
        # issue 51: beyond numpy's int64 bound of the draw (a ValueError traceback before)
        (["system.work.kind=uniform", f"system.work.high={2**63}"], ("'system.work.high' must be <= 2^62",)),
        (
            ["system.work.kind=lognormal", f"system.work.high={2**64}"],
            ("'system.work.high' must be <= 2^62",),
        ),
        (["system.work.kind=uniform", "system.work.high=3", "params.form=one_model"], ("one_model",)),
        (
            [
                "system.dropout.probability=0.1",
                "algorithm=fedavg",
                "clients_per_round=2",
                "privacy.level=client",
                "privacy.noise_multiplier=1",
            ],
            ("cannot be combined",),
        ),
    ],
)
def test_bad_system_settings_fail_in_one_line(tmp_path: Path, capsys, overrides, fragments) -> None:
    cfg = synthetic_config(tmp_path)
    argv = ["run", str(cfg), "--run-dir", str(tmp_path / "r"), "--set", *overrides]
    _fails_cleanly(capsys, argv, *fragments)
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("round,client\n2,9\n", "names client 9, but the run has clients 0..3"),
        ("round,client\n0,1\n", "names round 0, but rounds start at 1"),
        ("client,round\n1,2\n", "must start with the header line 'round,client'"),
        ("round,client\n1,x\n", "line 2: expected two integers"),
        (None, "cannot be read"),
    ],
)
def test_bad_trace_fails_in_one_line(tmp_path: Path, capsys, text: str | None, fragment: str) -> None:
    trace = tmp_path / "trace.csv"
    if text is not None:
        trace.write_text(text)
    cfg = synthetic_config(tmp_path, system={"dropout": {"trace": str(trace)}})
    _fails_cleanly(capsys, ["run", str(cfg), "--run-dir", str(tmp_path / "r")], fragment)


def test_lognormal_work_with_a_huge_mean_or_spread_is_clipped_to_high(tmp_path: Path) -> None:
    """exp(N(mu, sigma²)) overflows a float for mu = 1000 (an ``OverflowError`` traceback before
    issue 51); the draw is clipped to ``high`` as the section says, whatever its size."""
    for work in ({"mu": 1000.0, "sigma": 1.0}, {"mu": 0.0, "sigma": 1e6}):
        m = _model(kind="lognormal", low=1, high=3, **work)
        seen = {m.draw(0, r, r + 1, (0, 1, 2)).work[k] for r in range(40) for k in (0, 1, 2)}
        assert seen == {3} if work["mu"] else seen == {1, 3}  # sigma 1e6: exp(z) is 0 or huge
    system = {"work": {"kind": "lognormal", "mu": 1000.0, "sigma": 1.0, "low": 1, "high": 2}}
    result = run_experiment(
        config_from_dict(_tiny(algorithm="fedavg", rounds=2, system=system)), tmp_path / "r"
    )
    assert result.finished and all(r["work_steps"] == [2, 2, 2, 2] for r in result.metrics)


def test_a_trace_with_a_byte_order_mark_reads_as_without(tmp_path: Path) -> None:
    """Spreadsheet programs save CSV with a UTF-8 byte-order mark; its header was refused."""
    plain, marked = tmp_path / "plain.csv", tmp_path / "marked.csv"
    plain.write_text("round,client\n2,1\n3,0\n")
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    cfg = config_from_dict(_tiny(algorithm="fedavg", system={"dropout": {"trace": str(marked)}}))
    model = build_federation(cfg, LocalComm()).system
    assert model is not None and model.trace == read_trace(plain, 4) == {(2, 1), (3, 0)}


def _trace_run(trace: Path, **extra: Any) -> dict[str, Any]:
    return _tiny(algorithm="scaffold", system={"dropout": {"trace": str(trace)}}, **extra)


def test_a_run_in_legs_reads_one_trace_and_ends_as_one_run(tmp_path: Path) -> None:
    """A trace naming rounds beyond this invocation's ``rounds`` is accepted (it was refused, so a
    run could not be done in legs with one trace): 2 rounds, then ``--resume`` with 4, equal bit for
    bit to 4 rounds at once, the trace's round-3 failure included."""
    trace = tmp_path / "trace.csv"
    trace.write_text("round,client\n1,2\n3,1\n")
    whole = run_experiment(config_from_dict(_trace_run(trace, rounds=4)), tmp_path / "whole")
    first = run_experiment(config_from_dict(_trace_run(trace, rounds=2)), tmp_path / "legs")
    assert first.finished and [r["dropped"] for r in first.metrics] == [[2], []]
    second = run_experiment(config_from_dict(_trace_run(trace, rounds=4)), tmp_path / "legs", resume=True)
    assert [r["dropped"] for r in whole.metrics] == [[2], [], [1], []]
    assert torch.equal(second.server.x, whole.server.x)
    assert (tmp_path / "legs" / "dropout_trace.csv").read_bytes() == trace.read_bytes()


def test_a_trace_changed_before_a_resume_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    """The trace is read again on every start: an edit between a kill and ``--resume`` silently
    changed the resumed rounds. The run keeps the trace it started with and refuses another one;
    the same trace resumes, and ``--overwrite`` starts over with the new one."""
    trace = tmp_path / "trace.csv"
    trace.write_text("round,client\n1,2\n")
    path = write_config(tmp_path / "c.yaml", **_trace_run(trace, rounds=2))
    run = ["run", str(path), "--run-dir", str(tmp_path / "r")]
    assert main([*run, "--set", "rounds=1"]) == 0
    trace.write_text("round,client\n1,2\n2,0\n")
    line = _fails_cleanly(capsys, [*run, "--resume"], "system.dropout.trace", "changed since the run started")
    assert "--overwrite" in line and len(_rows(tmp_path / "r")) == 1
    trace.write_text("round,client\n1,2\n")
    assert main([*run, "--resume"]) == 0 and len(_rows(tmp_path / "r")) == 2
    trace.write_text("round,client\n2,0\n")
    assert main([*run, "--overwrite"]) == 0
    assert [r["dropped"] for r in _rows(tmp_path / "r")] == [[], [0]]


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def _counted_draws(monkeypatch) -> list[int]:
    """The rounds ``SystemModel.draw`` is called for, in call order (the real draw, counted)."""
    draws: list[int] = []
    real = SystemModel.draw

    def counted(self: SystemModel, stage: int, rnd: int, row_round: int, who: tuple[int, ...]) -> Any:
        draws.append(rnd)
        return real(self, stage, rnd, row_round, who)

    monkeypatch.setattr(SystemModel, "draw", counted)
    return draws


def test_the_draws_are_made_round_by_round_not_all_up_front(tmp_path: Path, monkeypatch) -> None:
    """Every round's draw was made before round 1 (30 s for 10,000 rounds of 100 participants,
    deaf to SIGTERM meanwhile): a run of 500 rounds stopped after its first draws only the rounds it
    reaches, and the first one once (issue 55: it was drawn twice, up front to refuse a round
    without arrivals and again when it ran)."""
    from hpcfl.runner import StopRequest

    draws = _counted_draws(monkeypatch)
    stop = StopRequest()
    stop.requested = True  # as a SIGTERM arriving before round 1 ends
    system = {"dropout": {"probability": 0.1}}
    cfg = config_from_dict(_tiny(algorithm="fedavg", rounds=500, system=system))
    result = run_experiment(cfg, tmp_path / "r", stop=stop)
    assert result.rounds_done == 1 and draws == [0]


@pytest.mark.parametrize("algorithm", ["fedavg", "fedbuff"])
def test_under_a_virtual_clock_a_run_of_100000_rounds_draws_only_what_it_reaches(
    tmp_path: Path, monkeypatch, algorithm: str
) -> None:
    """Issue 63: under ``system.clock`` every round's draw (and an asynchronous run's whole schedule)
    was made before round 1, so a run of 100,000 rounds started 300 s later than one of 10. Now a run
    of 100,000 rounds stopped after its first draws the rounds (asynchronous: dispatches from the model
    versions) it reaches, the first one once, and its row says what a run of 10 rounds says."""
    from hpcfl.runner import StopRequest

    system = {"dropout": {"probability": 0.1}, "clock": {"speed": {"kind": "lognormal", "mu": 3.0}}}
    params = {"buffer_size": 2, "concurrency": 3} if algorithm == "fedbuff" else {}
    rows = []
    for rounds in (10, 100_000):
        draws = _counted_draws(monkeypatch)
        stop = StopRequest()
        stop.requested = True  # as a SIGTERM arriving before round 1 ends
        cfg = config_from_dict(_tiny(algorithm=algorithm, rounds=rounds, system=system, params=params))
        result = run_experiment(cfg, tmp_path / str(rounds), stop=stop)
        assert result.rounds_done == 1
        rows.append(result.metrics[0])
        if algorithm == "fedavg":
            assert draws == [0]
        else:  # dispatches from version 0 (the first step) and 1 (the slots its arrivals freed)
            assert set(draws) <= {0, 1} and len(draws) <= 6
    keys = ("sim_time", "client_updates", "test_accuracy")
    assert [rows[0][k] for k in keys] == [rows[1][k] for k in keys]


def test_the_lazy_clock_equals_every_round_drawn_up_front() -> None:
    """The simulated time each round ends at and the updates so far, recorded as each round is
    taken (issue 63), equal the values the up-front draw of every round gave (the former
    ``RoundDraws``: all rounds drawn, then their slowest arrivals added in order), for 300 rounds
    of unequal work and dropouts, and a resume at round 137 replays them to the same values."""
    from hpcfl.runner.asynchronous import round_seconds
    from hpcfl.runner.federation import model_plan
    from hpcfl.runner.rounds import RoundDraws, _draw_round

    system = {
        "work": {"kind": "uniform", "low": 1, "high": 4, "unit": "steps"},
        "dropout": {"probability": 0.2},
        "clock": {
            "speed": {"kind": "lognormal", "mu": 3.0, "sigma": 1.0},
            "delay": {"kind": "uniform", "low": 0.5, "high": 2.0},
            "per_update": True,
        },
    }
    cfg = config_from_dict(_tiny(algorithm="fedavg", rounds=300, clients_per_round=4, system=system))
    plan = model_plan(build_federation(cfg, LocalComm()))
    assert plan.clock is not None
    eager = [_draw_round(plan, r, 0) for r in range(300)]  # the former up-front draw
    elapsed, updates, total, count = [], [], 0.0, 0
    for r, (who, sys_draw) in enumerate(eager):
        total += round_seconds(plan, r, who, sys_draw, plan.clock)
        count += len(who)
        elapsed.append(total)
        updates.append(count)
    for start in (0, 137):
        draws = RoundDraws(plan, start, 300, 0, None)
        assert draws.timeline is not None
        taken = [draws.take(r) for r in range(start, 300)]
        assert taken == eager[start:]
        ticks = draws.timeline.ticks
        assert [ticks[r].elapsed for r in range(start, 300)] == elapsed[start:]
        assert [ticks[r].updates for r in range(start, 300)] == updates[start:]
        assert draws.drawn == 300  # the replayed rounds before ``start`` and each later one, once


@pytest.mark.parametrize("clock", [False, True], ids=["round-by-round", "virtual-clock"])
def test_every_round_is_drawn_once(tmp_path: Path, monkeypatch, clock: bool) -> None:
    """Issue 55: the ``system`` section is drawn once per round, whether the draw is made up front
    (the first round, the rounds a trace names; every round under a virtual clock) or as the round
    comes."""
    trace = tmp_path / "t.csv"
    trace.write_text("round,client\n3,1\n")
    system: dict[str, Any] = {"dropout": {"probability": 0.2, "trace": str(trace)}}
    if clock:
        system["clock"] = {"speed": {"kind": "lognormal", "mu": 3.0, "sigma": 1.0}}
    cfg = config_from_dict(_tiny(algorithm="fedavg", rounds=4, system=system))
    draws = _counted_draws(monkeypatch)
    result = run_experiment(cfg, tmp_path / "r")
    assert sorted(draws) == [0, 1, 2, 3]
    assert result.metrics[2]["dropped"] and 1 in result.metrics[2]["dropped"]


def test_a_round_without_arrivals_is_refused_by_name_before_any_round(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("round,client\n" + "".join(f"3,{k}\n" for k in range(4)))
    cfg = synthetic_config(tmp_path, system={"dropout": {"trace": str(trace)}})
    _fails_cleanly(
        capsys, ["run", str(cfg), "--run-dir", str(tmp_path / "r")], "round 3: every participant (4)"
    )
    metrics = tmp_path / "r" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # refused before round 1 ran


# -- what a round does with the draw --------------------------------------------------------------------


def _tiny(**extra: Any) -> dict[str, Any]:
    return {**BASE, "name": "sys", "clients_per_round": None, **extra}


def test_server_step_averages_exactly_the_uploads_that_arrived(tmp_path: Path) -> None:
    """FedAvg, round 1, client 2 dropped by the trace: the new model is Σ n_k y_k / Σ n_k over the
    three clients that arrived (p_k renormalised), each trained from its own generator."""
    trace = tmp_path / "t.csv"
    trace.write_text("round,client\n1,2\n")
    cfg = config_from_dict(_tiny(algorithm="fedavg", rounds=1, system={"dropout": {"trace": str(trace)}}))
    result = run_experiment(cfg, tmp_path / "r")
    assert result.metrics[-1]["participants"] == [0, 1, 3] and result.metrics[-1]["dropped"] == [2]
    fed = build_federation(cfg, LocalComm())
    x0 = fed.flat.vector.clone()
    total, weight = torch.zeros_like(x0, dtype=torch.float64), 0.0
    for k in (0, 1, 3):
        data = fed.client_data(k)
        y, _ = fed.trainer.train(x0, data, client_generator(cfg.seed, 0, k))
        total += data.n * y.to(torch.float64)
        weight += data.n
    # the runner sums in float64, rounds the sum once, then divides by the arrived clients' weight
    assert torch.equal(result.server.x, total.to(x0.dtype) / weight)


def _client_state(run_dir: Path, k: int) -> dict[str, torch.Tensor]:
    ckpt = run_dir / "checkpoints"
    latest = ckpt / (ckpt / "LATEST").read_text().strip()
    return torch.load(latest / "clients" / f"client_{k}.pt", weights_only=True)


def test_a_dropped_clients_state_stays_as_it_was(tmp_path: Path) -> None:
    """SCAFFOLD (control variates): client 1 dropped in round 2 keeps its round-1 variate bit for bit;
    a client that trained in round 2 has a new one."""
    trace = tmp_path / "t.csv"
    trace.write_text("round,client\n2,1\n")
    system = {"dropout": {"trace": str(trace)}}
    cv = {"form": "control_variates"}  # what ``auto`` picks under a system section
    one = run_experiment(config_from_dict(_tiny(algorithm="scaffold", rounds=1, params=cv)), tmp_path / "a")
    two = run_experiment(
        config_from_dict(_tiny(algorithm="scaffold", rounds=2, params=cv, system=system)), tmp_path / "b"
    )
    assert one.finished and two.finished and two.metrics[-1]["dropped"] == [1]
    assert torch.equal(_client_state(tmp_path / "a", 1)["h"], _client_state(tmp_path / "b", 1)["h"])
    assert not torch.equal(_client_state(tmp_path / "a", 0)["h"], _client_state(tmp_path / "b", 0)["h"])


def test_fednova_normalises_by_the_work_each_participant_did(tmp_path: Path) -> None:
    """Local steps drawn in [1, 4]: τ_eff (computed by FedNova from the steps its local training
    returned) is Σ n_k‖a_k‖₁/Σ n_k over the participants that arrived, from their recorded steps
    (momentum 0.5)."""
    system = {"work": {"kind": "uniform", "low": 1, "high": 4}, "dropout": {"probability": 0.2}}
    cfg = config_from_dict(_tiny(algorithm="fednova", rounds=4, system=system))
    result = run_experiment(cfg, tmp_path / "r")
    sizes = build_federation(cfg, LocalComm()).population.sizes
    assert len({tuple(r["work_steps"]) for r in result.metrics}) > 1  # the work varied
    for row in result.metrics:
        who, steps = row.get("participants", list(range(4))), row["work_steps"]
        n = [sizes[k] for k in who]
        expected = sum(nk * local_norm(s, 0.5) for nk, s in zip(n, steps, strict=True)) / sum(n)
        assert row["tau_eff"] == pytest.approx(expected, rel=1e-6)


def test_fednova_is_not_fedavg_under_unequal_work_but_is_under_equal_work(tmp_path: Path) -> None:
    """Equal work (``fixed``, 2 steps each, momentum 0): FedNova is FedAvg bit for bit (module
    docstring); unequal work: they differ (the objective inconsistency FedNova removes)."""
    equal = {"work": {"kind": "fixed", "per_client": [2, 2, 2, 2]}}
    unequal = {"work": {"kind": "fixed", "per_client": [1, 4, 2, 3]}}
    runs = {}
    for algo in ("fedavg", "fednova"):
        for label, system in (("equal", equal), ("unequal", unequal)):
            cfg = config_from_dict(_tiny(algorithm=algo, rounds=2, momentum=0.0, system=system))
            runs[algo, label] = run_experiment(cfg, tmp_path / f"{algo}-{label}").server.x
    assert torch.equal(runs["fedavg", "equal"], runs["fednova", "equal"])
    assert (runs["fedavg", "unequal"] - runs["fednova", "unequal"]).abs().max() > 1e-4


def test_fednova_uploads_sum_to_the_same_bits_on_one_rank_and_on_two() -> None:
    """Unequal work (issue 51): the round's float64 sum of FedNova's uploads, rounded once, does not
    depend on how the participants are split over ranks. 8 participants of 1-5 plain SGD steps and
    unequal sizes, 200,000 parameters of either sign, all added on one rank or 4 + 4 on two (each
    rank's running sum, then the allreduce's addition): every sum equal bit for bit. With the weight
    n_k/‖a_k‖₁ (before issue 51) the products rounded in float64, and where the terms nearly cancel
    the rounded sums differed (3 parameters here, a third of an MLP's after a few rounds)."""
    from torch import nn

    from hpcfl.algorithms import FedNova, Trainer
    from hpcfl.algorithms.base import ClientData, ClientState, ServerState
    from hpcfl.runner.buffer import BufferLayout
    from hpcfl.runner.rounds import _accumulate
    from hpcfl.training import FlatModel
    from hpcfl.training.layout import StateLayout
    from hpcfl.training.sgd import LocalResult
    from tests.helpers import client_ctx

    model = nn.Linear(1000, 200)
    algo = FedNova(FedNova.Params(), layout=StateLayout.of_model(model))
    trainer = Trainer(FlatModel(model), LocalSchedule(lr=0.1, batch_size=8, steps=1, momentum=0.0))
    ex = algo.exchange(torch.float32)
    layout = BufferLayout.of([(f"sum:{s.name}", s.length) for s in ex.sums] + [("weight", 1), ("count", 1)])
    g = torch.Generator().manual_seed(0)
    server = ServerState(x=torch.zeros(algo.state_size))
    uploads = []
    for k, (n, steps) in enumerate(
        zip((37, 50, 61, 23, 90, 45, 77, 30), (1, 3, 5, 2, 3, 5, 1, 3), strict=True)
    ):
        data = ClientData(k, torch.zeros(n, 1000), torch.zeros(n, dtype=torch.long))
        task = algo.local_task(server, ClientState(), data, client_ctx(trainer))
        y = 0.1 * torch.randn(algo.state_size, generator=g)
        uploads.append(task.finish(y, LocalResult(loss=0.0, steps=steps, finite=True))[0])

    def summed(groups: list[list[int]]) -> torch.Tensor:
        bufs = [layout.allocate(torch.float64, torch.device("cpu")) for _ in groups]
        for buf, group in zip(bufs, groups, strict=True):
            for i in group:
                _accumulate(uploads[i], layout, buf, ex, torch.float64, i, frozenset())
        total = bufs[0]
        for buf in bufs[1:]:
            total = total + buf
        return total

    one, two = summed([list(range(8))]), summed([[0, 2, 4, 6], [1, 3, 5, 7]])
    for s in ex.sums:
        assert torch.equal(
            layout.view(one, f"sum:{s.name}").float(), layout.view(two, f"sum:{s.name}").float()
        )
    assert float(layout.view(one, "weight")) == float(layout.view(two, "weight"))


@pytest.mark.parametrize("algorithm", ["fedprox", "scaffold", "fednova"])
def test_client_batch_under_unequal_work_equals_one_by_one(tmp_path: Path, algorithm: str) -> None:
    system = {"work": {"kind": "uniform", "low": 1, "high": 3}, "dropout": {"probability": 0.2}}
    one = run_experiment(
        config_from_dict(_tiny(algorithm=algorithm, system=system)), tmp_path / "one"
    ).server.x
    grouped = config_from_dict(_tiny(algorithm=algorithm, system=system, client_batch="4"))
    batched = run_experiment(grouped, tmp_path / "b").server.x
    assert float((batched - one).norm() / one.norm()) < 1e-5


def test_the_readme_example_runs_and_is_saved_with_the_run(tmp_path: Path) -> None:
    """The guide's ``system:`` example (its YAML block, read from docs/heterogeneity.md) on the tiny
    federation: it runs, records the stragglers, and the run's saved config holds the section."""
    import yaml

    from hpcfl.files import read_yaml

    readme = (REPO / "docs/heterogeneity.md").read_text()
    section = readme[readme.index("# System heterogeneity") :]
    block = yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])
    keys = {k: v for k, v in _tiny(algorithm="fedprox", rounds=2, local_steps=None).items()}
    path = write_config(tmp_path / "c.yaml", **{**keys, **block})
    assert main(["run", str(path), "--run-dir", str(tmp_path / "r")]) == 0
    saved = read_yaml(tmp_path / "r" / "config.yaml")["system"]
    assert saved["work"] == {**saved["work"], **block["system"]["work"]}
    assert saved["dropout"]["probability"] == block["system"]["dropout"]["probability"]
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert all(len(r["stragglers"]) == round(0.5 * 4) for r in rows)
