"""Asynchronous FL on the virtual clock (issue 54): the clock, the schedule, FedBuff and FedAsync.

Resume bit-identity, 1-vs-2-rank equality, counted bytes and batched training of both methods are
the contract suite's (tests/test_contract.py is parametrised over every registered algorithm)."""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcfl.algorithms import Aggregate, Arrival, Population, ServerContext
from hpcfl.algorithms.asynchronous import staleness_weight
from hpcfl.algorithms.clock import ClockSection, Distribution, VirtualClock, update_samples
from hpcfl.cli.main import main
from hpcfl.comm import LocalComm
from hpcfl.config import config_from_dict
from hpcfl.errors import ConfigError
from hpcfl.runner import run_experiment
from hpcfl.runner.asynchronous import AsyncSchedule, Step, _update, async_schedule, plan_clock
from hpcfl.runner.federation import build_federation, model_plan
from hpcfl.training.layout import StateLayout
from hpcfl.training.seeds import seeded_rng
from tests.helpers import stop_after_rows, synthetic_config
from tests.test_contract import BASE, _rows, two_rank_runs

LOGNORMAL = {
    "speed": {"kind": "lognormal", "mu": 3.0, "sigma": 1.0},
    "delay": {"kind": "uniform", "low": 0.5, "high": 2.0},
}


def _cfg(**extra: Any) -> dict[str, Any]:
    return {**BASE, "name": "async", "num_clients": 6, "clients_per_round": 4, **extra}


# -- the clock ------------------------------------------------------------------------------------


def test_clock_draws_are_pure_functions_of_seed_client_and_round(tmp_path: Path) -> None:
    section = ClockSection(
        speed=Distribution("lognormal", mu=2.0, sigma=1.0), delay=Distribution("constant", 0.5)
    )
    a, b = VirtualClock(section, 7), VirtualClock(section, 7)
    per_client = [a.speed_delay(0, r, k) for r in range(3) for k in range(5)]
    assert per_client == [b.speed_delay(0, r, k) for r in range(3) for k in range(5)]
    assert all(a.speed_delay(0, 0, k) == a.speed_delay(0, 9, k) for k in range(5))  # once per client
    assert len({a.speed_delay(0, 0, k)[0] for k in range(5)}) == 5 and all(s > 0 for s, _ in per_client)
    assert VirtualClock(section, 8).speed_delay(0, 0, 0) != a.speed_delay(0, 0, 0)
    fresh = VirtualClock(dataclasses.replace(section, per_update=True), 7)
    assert fresh.speed_delay(0, 0, 1) != fresh.speed_delay(0, 1, 1)  # drawn per update
    assert fresh.speed_delay(0, 1, 1) == VirtualClock(fresh.section, 7).speed_delay(0, 1, 1)
    speed, delay = a.speed_delay(0, 0, 2)
    assert a.seconds(0, 0, 2, 160) == 160 / speed + delay
    trace = tmp_path / "clock.csv"
    trace.write_text("client,speed,delay\n2,40,1.5\n")
    traced = VirtualClock.of(dataclasses.replace(section, trace=str(trace)), 7, 5)
    assert traced is not None and traced.seconds(0, 3, 2, 80) == 80 / 40 + 1.5
    assert traced.speed_delay(0, 0, 1) == a.speed_delay(0, 0, 1)  # untraced clients: the distribution
    assert update_samples(3, 16, 10) == 30 and update_samples(3, 16, 50) == 48


def test_synchronous_rounds_last_as_long_as_their_slowest_arrival(tmp_path: Path) -> None:
    cfg = config_from_dict(_cfg(algorithm="fedavg", system={"clock": LOGNORMAL}))
    rows = run_experiment(cfg, tmp_path / "r").metrics
    fed = build_federation(cfg, LocalComm())
    clock, schedule = fed.clock, fed.trainer.schedule
    assert clock is not None
    total, updates = 0.0, 0
    for r, row in enumerate(rows):
        who = row.get("participants", range(6))
        assert len(who) == 4
        longest = max(
            clock.seconds(0, r, k, update_samples(schedule.num_steps(n), schedule.batch_size, n))
            for k in who
            for n in [fed.population.sizes[k]]
        )
        total, updates = total + longest, updates + len(who)
        assert row["round_sim_s"] == pytest.approx(longest) and row["sim_time"] == pytest.approx(total)
        assert row["client_updates"] == updates


def test_a_resumed_synchronous_run_keeps_its_simulated_time(tmp_path: Path) -> None:
    cfg = config_from_dict(_cfg(algorithm="fedprox", system={"clock": LOGNORMAL}))
    whole = run_experiment(cfg, tmp_path / "whole").metrics
    stopped = run_experiment(cfg, tmp_path / "s", stop=stop_after_rows(tmp_path / "s", 2))
    assert stopped.rounds_done == 2
    run_experiment(cfg, tmp_path / "s", resume=True)
    keys = ("sim_time", "client_updates", "test_accuracy")
    assert [[r[k] for k in keys] for r in _rows(tmp_path / "s")] == [[r[k] for k in keys] for r in whole]


def test_the_clock_alone_changes_no_result(tmp_path: Path) -> None:
    plain = run_experiment(config_from_dict(_cfg(algorithm="fedavg")), tmp_path / "a")
    timed = run_experiment(
        config_from_dict(_cfg(algorithm="fedavg", system={"clock": LOGNORMAL})), tmp_path / "b"
    )
    assert torch.equal(plain.server.x, timed.server.x) and "sim_time" not in plain.metrics[0]


@pytest.mark.parametrize(
    ("law", "mean", "low"),
    [
        # (the law, its mean, its least value), FLSim's parameterisation (hpcfl.algorithms.clock)
        ({"kind": "gaussian", "mean": 5.0, "sd": 1.0, "min": 0.0}, 5.0, 0.0),
        ({"kind": "half_normal", "sd": 2.0, "min": 1.0}, 1.0 + 2.0 * math.sqrt(2 / math.pi), 1.0),
        ({"kind": "uniform", "mean": 4.0, "min": 1.0}, 4.0, 1.0),
        ({"kind": "exponential", "mean": 3.0}, 3.0, 0.0),
        ({"kind": "per_example_gaussian", "mean": 0.05, "sd": 0.01, "min": 0.01}, 0.05 * 40, 0.01 * 40),
    ],
    ids=lambda v: v["kind"] if isinstance(v, dict) else "",
)
def test_flsims_duration_laws_have_its_means_and_bounds_and_are_pure(
    law: dict, mean: float, low: float
) -> None:
    """Issue 63: FLSim's per-user duration laws (flsim/utils/timing/training_duration_distribution.py):
    4,000 draws of an update of 40 samples have the law's mean (within 4 %) and never go below its
    least value; each draw is a pure function of (seed, client, round), like the speed's."""
    from hpcfl.algorithms.clock import DurationLaw

    section = ClockSection(duration=DurationLaw(**law), per_update=True)
    clock = VirtualClock(section, 3)
    draws = [clock.seconds(0, r, k, 40) for r in range(400) for k in range(10)]
    assert min(draws) >= low and sum(draws) / len(draws) == pytest.approx(mean, rel=0.04)
    assert draws[:50] == [VirtualClock(section, 3).seconds(0, r, k, 40) for r in range(5) for k in range(10)]
    if law["kind"] == "uniform":
        assert max(draws) <= 2 * 4.0 - 1.0
    once = VirtualClock(dataclasses.replace(section, per_update=False), 3)
    assert once.seconds(0, 0, 2, 40) == once.seconds(0, 7, 2, 40)  # once per client by default


def test_poisson_starts_follow_flsims_process_and_wait_for_a_free_slot() -> None:
    """Under ``starts: poisson`` the i-th training starts at the i-th time of a Poisson process
    (gaps −ln(U)/λ, FLSim's PoissonAsyncTrainingStartTimeDistr) or, when every slot was busy then,
    at the arrival that freed one; never more than ``concurrency`` are in flight; and the mean gap
    is 1/λ."""
    from hpcfl.algorithms.clock import StartProcess

    rate, duration = 1.0, 1.5  # about 1.5 in flight: the cap of 4 (and 6 clients) binds now and then
    clock = {"duration": {"kind": "gaussian", "mean": duration}, "starts": {"kind": "poisson", "rate": rate}}
    plan, steps = _schedule("fedbuff", 60, {"buffer_size": 2}, system={"clock": clock})
    times, t = [], 0.0
    starts = StartProcess("poisson", rate)
    for i in range(1, 200):
        t += starts.gap(plan.seed, 0, i)
        times.append(t)
    arrived = {(a.version, a.client): a.time for s in steps for a in s.arrivals}
    moments = set(arrived.values())
    order = [(v, k) for v, s in enumerate(steps) for k in s.dispatched]
    waited = 0
    for i, key in enumerate(order):
        if key not in arrived:
            continue
        begun = arrived[key] - duration
        assert begun == pytest.approx(times[i]) or (
            begun > times[i] and min(abs(begun - m) for m in moments) < 1e-9
        )
        waited += begun != pytest.approx(times[i])
    assert 0 < waited < len(order) / 2  # some starts waited for a free slot, most did not
    spans = [(arrived[key] - duration, arrived[key]) for key in arrived]
    for m in moments:
        assert sum(1 for b, e in spans if b <= m < e) <= 4
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / rate, rel=0.2)


# -- the schedule ---------------------------------------------------------------------------------


def _schedule(algorithm: str, steps: int, params: dict[str, Any], **extra: Any):
    cfg = config_from_dict(_cfg(algorithm=algorithm, params=params, rounds=steps, **extra))
    fed = build_federation(cfg, LocalComm())
    plan = model_plan(fed)
    return plan, async_schedule(plan, steps)


@pytest.mark.parametrize("hetero", [False, True])
def test_the_schedule_is_a_bounded_event_simulation_in_arrival_order(hetero: bool) -> None:
    system = {"clock": {**LOGNORMAL, "per_update": True}}
    if hetero:
        system.update({"work": {"kind": "uniform", "low": 1, "high": 4}, "dropout": {"probability": 0.2}})
    plan, steps = _schedule("fedbuff", 12, {"buffer_size": 3}, system=system)
    assert steps == _schedule("fedbuff", 12, {"buffer_size": 3}, system=system)[1]  # pure
    assert steps[:5] == async_schedule(plan, 5)  # a prefix does not depend on the run's length
    clock = plan.clock
    assert clock is not None
    applied: set[tuple[int, int]] = set()
    last = 0.0
    for t, step in enumerate(steps):
        assert len(step.arrivals) == 3 and len(set(step.dispatched)) == len(step.dispatched)
        for a in step.arrivals:
            assert a.version <= t and a.staleness == t - a.version and a.time >= last
            assert a.client in steps[a.version].dispatched and (a.version, a.client) not in applied
            applied.add((a.version, a.client))
            last = a.time
        assert step.time == last
    # each update was dispatched at second 0 or when another arrived (its slot freed), and at most
    # ``concurrency`` (4) updates are in flight at once
    arrivals = {(a.version, a.client): a.time for s in steps for a in s.arrivals}
    moments = {0.0, *arrivals.values()}
    begun = {key: _dispatch_time(key, end, clock, plan) for key, end in arrivals.items()}
    if not hetero:  # (a dropped update frees its slot at a moment that is no arrival)
        assert all(min(abs(b - m) for m in moments) < 1e-9 for b in begun.values())
    for t in moments:
        assert sum(1 for key, end in arrivals.items() if begun[key] <= t < end) <= 4


def _eager_schedule(plan: Any, steps: int, round_offset: int = 0) -> tuple[Any, ...]:
    """The former up-front schedule (hpcfl before issue 63), verbatim: the reference."""
    algo = plan.algorithm
    clock = plan_clock(plan)
    N, C, K = plan.population.size, algo.concurrency, algo.buffer_size
    heap: list[tuple[float, int, int, int, bool]] = []  # (arrival, seq, client, version, dropped)
    in_flight: set[int] = set()
    dispatched: list[list[int]] = [[]]
    seq = 0

    def dispatch(now: float, version: int) -> bool:
        nonlocal seq
        mine = dispatched[version]
        pool = [k for k in range(N) if k not in in_flight and k not in mine]
        if not pool:
            return False
        # host generator (deliberate): the choice depends on the seed, never on the rank
        rng = seeded_rng(plan.seed, 0x64737063, plan.stage_index, version, len(mine))
        k = pool[int(rng.integers(len(pool)))]
        seconds, dropped = _update(plan, clock, version, round_offset + version + 1, k)
        heapq.heappush(heap, (now + seconds, seq, k, version, dropped))
        seq += 1
        in_flight.add(k)
        mine.append(k)
        return True

    out: list[Step] = []
    now = 0.0
    while len(in_flight) < C and dispatch(now, 0):
        pass
    for t in range(steps):
        buffer: list[Arrival] = []
        while len(buffer) < K:
            if not heap:
                raise ConfigError(
                    f"asynchronous step {round_offset + t + 1}: every update in flight dropped out and no "
                    "client is left to dispatch (system.dropout); lower the dropout or fix the trace"
                )
            now, _, k, version, dropped = heapq.heappop(heap)
            in_flight.discard(k)
            if not dropped:
                buffer.append(Arrival(k, version, now, t - version))
            dispatch(now, t)
        out.append(Step(tuple(dispatched[t]), tuple(buffer), now))
        dispatched.append([])
        while len(in_flight) < C and dispatch(now, t + 1):
            pass
    return tuple(out)


def test_the_lazy_schedule_equals_the_former_up_front_one_and_resumes_to_the_same_steps() -> None:
    """Issue 63: the schedule is simulated step by step as the run reads it (and forgets the steps
    read); for 300 steps of a heterogeneous clock with dropouts it equals the former schedule that
    was simulated whole before step 1, and one read from step 120 on (a resume) gives the same steps."""
    system = {**HETERO_CLOCK}
    plan, lazy = _schedule("fedbuff", 300, {"buffer_size": 3}, system=system)
    assert lazy == _eager_schedule(plan, 300)
    schedule = AsyncSchedule(plan)
    assert [schedule[t] for t in range(120, 300)] == list(lazy[120:])
    with pytest.raises(IndexError):
        schedule[5]  # forgotten: memory does not grow with the steps


def _dispatch_time(key: tuple[int, int], end: float, clock: VirtualClock, plan: Any) -> float:
    v, k = key
    n = plan.population.sizes[k]
    work = plan.system.draw(0, v, v + 1, (k,)).steps[k] if plan.system else plan.trainer.schedule.num_steps(n)
    return end - clock.seconds(0, v, k, update_samples(work, plan.trainer.schedule.batch_size, n))


# -- determinism: resume and ranks under a heterogeneous clock ------------------------------------

#: per-update lognormal speeds, uniform delays, unequal work and dropouts: every draw of the clock
HETERO_CLOCK: dict[str, Any] = {
    "clock": {**LOGNORMAL, "per_update": True},
    "work": {"kind": "uniform", "low": 1, "high": 3},
    "dropout": {"probability": 0.2},
}


def _clocked(name: str) -> dict[str, Any]:
    params = {"buffer_size": 3} if name == "fedbuff" else {"staleness": "hinge", "a": 1.0, "b": 1}
    return _cfg(algorithm=name, name=name, params=params, rounds=6, system=HETERO_CLOCK)


KEYS = (
    "test_accuracy",
    "participants",
    "dropped",
    "sim_time",
    "client_updates",
    "staleness",
    "applied",
    "bytes_up",
)


def _same_rows(a: list[dict], b: list[dict]) -> bool:
    return [[r.get(k) for k in KEYS] for r in a] == [[r.get(k) for k in KEYS] for r in b]


@pytest.mark.parametrize("name", ["fedbuff", "fedasync"])
def test_a_stopped_and_resumed_asynchronous_run_is_bit_identical(tmp_path: Path, name: str) -> None:
    cfg = config_from_dict({**_clocked(name), "checkpoint_every": 1})
    whole = run_experiment(cfg, tmp_path / "whole")
    assert any(r["staleness"] and max(r["staleness"]) > 0 for r in whole.metrics)  # stale updates
    stopped = run_experiment(cfg, tmp_path / "s", stop=stop_after_rows(tmp_path / "s", 3))
    assert stopped.rounds_done == 3 and stopped.server.in_flight > 0  # updates in flight
    resumed = run_experiment(cfg, tmp_path / "s", resume=True)
    assert torch.equal(resumed.server.x, whole.server.x)
    assert _same_rows(_rows(tmp_path / "s"), whole.metrics)


def test_a_run_on_flsims_clock_resumes_bit_identically(tmp_path: Path) -> None:
    """Poisson starts and a half-normal duration per update: a stopped and resumed FedBuff run
    equals the whole one (the schedule is replayed to the checkpoint, issue 63)."""
    clock = {
        "duration": {"kind": "half_normal", "sd": 2.0, "min": 0.5},
        "starts": {"kind": "poisson", "rate": 3.0},
    }
    system = {**HETERO_CLOCK, "clock": {**clock, "per_update": True}}
    cfg = config_from_dict({**_clocked("fedbuff"), "system": system, "checkpoint_every": 1, "eval_every": 2})
    whole = run_experiment(cfg, tmp_path / "whole")
    stopped = run_experiment(cfg, tmp_path / "s", stop=stop_after_rows(tmp_path / "s", 1))
    assert 0 < stopped.rounds_done < 6
    resumed = run_experiment(cfg, tmp_path / "s", resume=True)
    assert torch.equal(resumed.server.x, whole.server.x)
    assert _same_rows(_rows(tmp_path / "s"), whole.metrics)


def test_an_asynchronous_run_checkpoints_every_concurrency_over_k_steps_by_default(tmp_path: Path) -> None:
    """``checkpoint_every: auto``: a FedAsync checkpoint holds every update in flight, so it is written
    every concurrency / K = 4 steps (and at the end), not every step; a number still rules."""
    kept = {}
    for setting in ("auto", 3):
        run_dir = tmp_path / str(setting)
        run_experiment(config_from_dict({**_clocked("fedasync"), "checkpoint_every": setting}), run_dir)
        kept[setting] = sorted(p.name for p in (run_dir / "checkpoints").glob("round_*"))
    assert kept == {"auto": ["round_000004", "round_000006"], 3: ["round_000003", "round_000006"]}


@pytest.mark.mpi
def test_one_rank_and_two_ranks_agree_under_a_heterogeneous_clock(tmp_path: Path) -> None:
    from tests.helpers import final_state

    runs = {name: _clocked(name) for name in ("fedbuff", "fedasync")}
    two = two_rank_runs(tmp_path, runs)
    for name, cfg in runs.items():
        one = run_experiment(config_from_dict(cfg), tmp_path / "one" / name)
        assert torch.equal(final_state(two / name), one.server.x), name
        assert _same_rows(_rows(two / name), one.metrics), name


# -- the server steps -----------------------------------------------------------------------------


def test_fedbuff_and_fedasync_server_steps_follow_their_papers() -> None:
    from hpcfl.algorithms.fedasync import FedAsync, FedAsyncParams
    from hpcfl.algorithms.fedbuff import FedBuff, FedBuffParams

    layout = StateLayout.of_model(torch.nn.Linear(2, 1))  # 3 entries
    x0 = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    y = [
        torch.tensor([2.0, 2.0, 2.0], dtype=torch.float64),
        torch.tensor([0.0, 4.0, 3.0], dtype=torch.float64),
    ]
    pop = Population((10, 10, 10, 10))

    buff = FedBuff(FedBuffParams(buffer_size=2, server_lr=0.5, concurrency=3), layout=layout)
    buff.resolved(pop, None)  # type: ignore[arg-type]
    s0 = buff.init_server(x0)
    # step 0 trains clients 2 and 0 from x0 and applies neither; step 1 applies (1, ?) and (0, 2)
    s1, _ = buff.server_update(
        s0, Aggregate({}, 2.0, 2, {"y": y}), ServerContext(0, (2, 0), pop, lambda t: t)
    )
    assert torch.equal(s1.x, x0) and s1.pending.shape == (2, 3) and s1.in_flight == 2
    arrivals = (Arrival(0, 0, 5.0, 1), Arrival(2, 0, 6.0, 1))
    s2, m = buff.server_update(
        s1, Aggregate({}, 0.0, 0, {"y": []}), ServerContext(1, (), pop, lambda t: t, arrivals=arrivals)
    )
    weight = staleness_weight("polynomial", 1, 0.5, 4)
    assert weight == 2**-0.5
    expected = x0 + 0.5 / 2 * (weight * (y[1] - x0) + weight * (y[0] - x0))
    assert torch.allclose(s2.x, expected, rtol=0, atol=1e-15) and s2.in_flight == 0
    assert s2.pending.shape == (2, 3) and s1.pending_keys.tolist() == [
        [0, 2],
        [0, 0],
    ]  # slots kept, s1 intact
    assert m == {"staleness_mean": 1.0, "staleness_max": 1.0}
    # the next update takes a freed slot: the rows are never copied to a new matrix
    s3, _ = buff.server_update(
        s2, Aggregate({}, 1.0, 1, {"y": [y[1]]}), ServerContext(2, (3,), pop, lambda t: t)
    )
    assert s3.pending.data_ptr() == s2.pending.data_ptr() and s3.in_flight == 1
    assert torch.equal(s3.pending[0], y[1] - s2.x) and s3.pending_keys.tolist()[0] == [2, 3]

    mix = FedAsync(FedAsyncParams(alpha=0.5, staleness="hinge", a=2.0, b=1, concurrency=2), layout=layout)
    mix.resolved(pop, None)  # type: ignore[arg-type]
    t0 = mix.init_server(x0)
    t1, _ = mix.server_update(t0, Aggregate({}, 2.0, 2, {"y": y}), ServerContext(0, (1, 3), pop, lambda t: t))
    t2, m = mix.server_update(
        t1,
        Aggregate({}, 0, 0, {"y": []}),
        ServerContext(3, (), pop, lambda t: t, arrivals=(Arrival(3, 0, 1.0, 3),)),
    )
    alpha_t = 0.5 / (2.0 * (3 - 1) + 1.0)  # hinge: 1 / (a(τ − b) + 1) past b
    assert m["alpha_t"] == alpha_t and torch.allclose(t2.x, (1 - alpha_t) * x0 + alpha_t * y[1], atol=1e-15)
    assert [staleness_weight("hinge", s, 2.0, 1) for s in (0, 1, 2)] == [1.0, 1.0, 1 / 3]
    assert staleness_weight("constant", 9, 1, 1) == 1.0


@pytest.mark.parametrize(("clients", "concurrency", "expected"), [(8, None, 8), (12, None, 10), (12, 4, 4)])
def test_fedbuffs_default_buffer_is_the_papers_k_where_the_concurrency_allows_and_is_recorded(
    tmp_path: Path, clients: int, concurrency: int | None, expected: int
) -> None:
    """Issue 63: the default K was 10 whatever the concurrency, so FedBuff on a federation of 8
    clients was refused by default ("the buffer could never fill"). Now K is the paper's 10 capped at
    the concurrency, and the run's determinism.json says which K it used."""
    params = {"concurrency": concurrency} if concurrency else {}
    cfg = _cfg(algorithm="fedbuff", num_clients=clients, clients_per_round=None, params=params, rounds=2)
    result = run_experiment(config_from_dict(cfg), tmp_path / "r")
    assert result.rounds_done == 2 and [r["client_updates"] for r in result.metrics] == [
        expected,
        2 * expected,
    ]
    record = json.loads((tmp_path / "r" / "determinism.json").read_text())
    assert record["asynchronous"] == {"concurrency": concurrency or clients, "buffer_size": expected}


def test_fedbuff_with_a_full_buffer_and_equal_clients_is_fedavg(tmp_path: Path) -> None:
    """K = concurrency = every client, no staleness weight, equal clocks: each step applies every
    client's fresh update, x + (1/N) Σ (y_k − x) = (1/N) Σ y_k, FedAvg's uniform mean."""
    extra = dict(clients_per_round=None, num_clients=4)
    params = {"buffer_size": 4, "staleness": "constant"}
    buff = run_experiment(config_from_dict(_cfg(algorithm="fedbuff", params=params, **extra)), tmp_path / "b")
    avg = run_experiment(
        config_from_dict(_cfg(algorithm="fedavg", params={"weighting": "uniform"}, **extra)), tmp_path / "a"
    )
    assert all(r["staleness"] == [0, 0, 0, 0] for r in buff.metrics)
    torch.testing.assert_close(buff.server.x, avg.server.x, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["fedbuff", "fedasync"])
def test_every_applied_update_is_recorded_even_between_rows(tmp_path: Path, name: str) -> None:
    params = {"buffer_size": 2} if name == "fedbuff" else {}
    cfg = config_from_dict(
        _cfg(algorithm=name, params=params, rounds=5, eval_every=2, system={"clock": LOGNORMAL})
    )
    rows = run_experiment(cfg, tmp_path / "r").metrics
    plan = model_plan(build_federation(cfg, LocalComm()))
    steps = async_schedule(plan, 5)
    assert [s for r in rows for s in r["staleness"]] == [a.staleness for s in steps for a in s.arrivals]
    assert [k for r in rows for k in r["applied"]] == [a.client for s in steps for a in s.arrivals]
    assert [r["sim_time"] for r in rows] == [steps[1].time, steps[3].time, steps[4].time]
    assert rows[-1]["client_updates"] == sum(len(s.arrivals) for s in steps)


# -- bad input: one line before the first update --------------------------------------------------


def _fails(tmp_path: Path, capsys, overrides: list[str], *fragments: str) -> None:
    algorithm = next((o.split("=")[1] for o in overrides if o.startswith("algorithm=")), "fedbuff")
    params = {"buffer_size": 2} if algorithm == "fedbuff" else {}
    overrides = [o for o in overrides if not o.startswith("algorithm=")]
    cfg = synthetic_config(tmp_path, algorithm=algorithm, clients_per_round=3, params=params)
    code = main(["run", str(cfg), "--run-dir", str(tmp_path / "r"), "--set", *overrides])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and "Traceback" not in err and lines[-1].startswith("hpcfl: error:"), err
    for fragment in fragments:
        assert fragment in lines[-1], (fragment, lines[-1])
    assert (
        not (tmp_path / "r" / "metrics.jsonl").exists() or not (tmp_path / "r" / "metrics.jsonl").read_text()
    )


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (
            ["system.clock.speed.kind=constant", "system.clock.speed.value=0"],
            ("'system.clock.speed.value' must be positive",),
        ),
        (
            ["system.clock.speed.kind=uniform", "system.clock.speed.low=-1", "system.clock.speed.high=5"],
            ("'system.clock.speed.low' must be positive",),
        ),
        (["system.clock.speed.kind=gamma"], ("'system.clock.speed.kind' must be one of",)),
        (
            ["system.clock.speed.kind=constant", "system.clock.speed.value=5", "system.clock.delay.value=-1"],
            ("'system.clock.delay.value' must be non-negative",),
        ),
        (["system.clock.delay.value=2"], ("no speed",)),
        (["params.buffer_size=4"], ("buffer_size (4) is larger than the concurrency (3)",)),
        (
            [
                "system.clock.duration.kind=uniform",
                "system.clock.duration.mean=1",
                "system.clock.duration.min=2",
            ],
            ("'system.clock.duration.mean' (1.0) is below 'system.clock.duration.min' (2.0)",),
        ),
        (
            ["system.clock.duration.kind=half_normal", "system.clock.duration.sd=0"],
            ("'system.clock.duration.sd' (the half-normal's scale) must be > 0",),
        ),
        (
            ["system.clock.duration.kind=exponential", "system.clock.duration.mean=0"],
            ("'system.clock.duration.mean' (the exponential's mean) must be > 0",),
        ),
        (
            [
                "system.clock.duration.kind=exponential",
                "system.clock.duration.mean=2",
                "system.clock.duration.sd=1",
            ],
            ("'system.clock.duration.sd' must be 0 for the exponential law",),
        ),
        (
            [
                "system.clock.duration.kind=gaussian",
                "system.clock.duration.mean=2",
                "system.clock.duration.min=-1",
            ],
            ("'system.clock.duration.min' must be >= 0",),
        ),
        (["system.clock.duration.kind=weibull"], ("'system.clock.duration.kind' must be one of gaussian",)),
        (
            [
                "system.clock.duration.kind=gaussian",
                "system.clock.duration.mean=2",
                "system.clock.speed.kind=constant",
                "system.clock.speed.value=5",
            ],
            ("sets both a speed and a duration law",),
        ),
        (
            [
                "system.clock.speed.kind=constant",
                "system.clock.speed.value=5",
                "system.clock.starts.kind=poisson",
            ],
            ("'system.clock.starts.rate' (Poisson starts per simulated second) must be > 0",),
        ),
        (
            [
                "system.clock.speed.kind=constant",
                "system.clock.speed.value=5",
                "system.clock.starts.kind=poisson",
                "system.clock.starts.rate=-2",
            ],
            ("'system.clock.starts.rate' (Poisson starts per simulated second) must be > 0",),
        ),
        (
            [
                "algorithm=fedavg",
                "system.clock.speed.kind=constant",
                "system.clock.speed.value=5",
                "system.clock.starts.kind=poisson",
                "system.clock.starts.rate=2",
            ],
            ("Poisson training starts apply to an asynchronous algorithm",),
        ),
        (
            ["params.buffer_size=3", "params.concurrency=2"],
            ("'params.buffer_size' (3) is larger than params.concurrency (2)",),
        ),
        (["params.concurrency=9"], ("params.concurrency is 9 but the run has 4 clients",)),
        (
            ["params.staleness=exponential"],
            ("'params.staleness' must be one of constant, polynomial, hinge",),
        ),
        (["params.a=-0.5"], ("'params.a' (the polynomial staleness exponent) must be > 0",)),
        (["params.staleness=hinge", "params.b=-1"], ("'params.b'",)),
        (["params.local=scaffold"], ("'params.local' must be fedavg or fedprox, got 'scaffold'",)),
        (["system.work.kind=stragglers", "system.work.fraction=0.5", "local_epochs=2"], ("asynchronous",)),
        (["algorithm=fedasync", "params.alpha=1.5"], ("'params.alpha' must be in (0, 1]",)),
    ],
)
def test_bad_asynchronous_settings_fail_in_one_line(tmp_path: Path, capsys, overrides, fragments) -> None:
    _fails(tmp_path, capsys, overrides, *fragments)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("client,speed,delay\n7,10,0\n", "names client 7, but the run has clients 0..3"),
        ("client,speed,delay\n1,0,0\n", "speed must be positive"),
        ("client,speed\n1,3\n", "must start with the header line 'client,speed,delay'"),
        ("client,speed,delay\n1,fast,0\n", "line 2: expected 'client,speed,delay'"),
    ],
)
def test_a_bad_clock_trace_fails_in_one_line(tmp_path: Path, capsys, text: str, fragment: str) -> None:
    trace = tmp_path / "clock.csv"
    trace.write_text(text)
    _fails(
        tmp_path,
        capsys,
        ["system.clock.speed.kind=constant", "system.clock.speed.value=5", f"system.clock.trace={trace}"],
        fragment,
    )


# -- hpcfl report: simulated time to target beside rounds and bytes -------------------------------


def test_report_shows_simulated_time_and_updates_to_target(tmp_path: Path) -> None:
    from hpcfl.report import Protocol, summarise, write_report
    from hpcfl.report.targets import target_csv, target_rows

    system = {"clock": LOGNORMAL}
    sync = run_experiment(config_from_dict(_cfg(algorithm="fedavg", rounds=4, system=system)), tmp_path / "a")
    buff = run_experiment(
        config_from_dict(_cfg(algorithm="fedbuff", params={"buffer_size": 2}, rounds=6, system=system)),
        tmp_path / "b",
    )
    runs = [summarise(tmp_path / "a"), summarise(tmp_path / "b")]
    target = min(max(r["test_accuracy"] for r in run.metrics) for run in (sync, buff))
    rows = target_rows(runs, target)
    for t, run in zip(rows, (sync, buff), strict=True):
        hit = next(r for r in run.metrics if r["test_accuracy"] >= target)
        assert t.rounds == hit["round"] and t.sim_time == hit["sim_time"]
        assert t.updates == hit["client_updates"]
    assert "sim_time_to_target,updates_to_target" in target_csv(rows, target).splitlines()[0]
    write_report(
        [tmp_path / "a", tmp_path / "b"], tmp_path / "rep", target=target, protocol=Protocol(window=1)
    )
    text = (tmp_path / "rep" / "report.md").read_text()
    assert (
        f"sim. s to {100 * target:g}%" in text and f"| {rows[1].sim_time:,.1f} | {rows[1].updates} |" in text
    )


# -- issue 61: the clock like the work draws --------------------------------------------------------


@pytest.mark.parametrize(("mu", "sigma"), [(1000.0, 1.0), (-1000.0, 1.0), (0.0, 1e300), (0.0, 1.7e308)])
def test_a_lognormal_clock_draw_is_clipped_to_finite_positive_bounds(mu: float, sigma: float) -> None:
    """mu ±1000 or sigma 1e300 overflowed exp (OverflowError) or drew a speed of 0
    (ZeroDivisionError); the logarithm is now clipped before exp, as ``system.work``'s is."""
    from hpcfl.algorithms.clock import LOGNORMAL_HIGH, LOGNORMAL_LOW

    d = Distribution("lognormal", mu=mu, sigma=sigma)
    clock = VirtualClock(ClockSection(speed=d, delay=d, per_update=True), 7)
    draws = [v for r in range(20) for k in range(3) for v in clock.speed_delay(0, r, k)]
    assert all(LOGNORMAL_LOW <= v <= LOGNORMAL_HIGH for v in draws), draws
    if mu:  # every draw lies beyond the bound on its side
        assert set(draws) == {LOGNORMAL_HIGH if mu > 0 else LOGNORMAL_LOW}
    else:  # a huge spread: both bounds, nothing between
        assert set(draws) == {LOGNORMAL_LOW, LOGNORMAL_HIGH}
    assert all(math.isfinite(clock.seconds(0, r, 1, 10**6)) for r in range(20))


def test_a_run_with_an_extreme_lognormal_clock_runs_with_finite_simulated_time(tmp_path: Path) -> None:
    system = {
        "clock": {"speed": {"kind": "lognormal", "mu": -1000.0}, "delay": {"kind": "lognormal", "mu": 1000.0}}
    }
    rows = run_experiment(
        config_from_dict(_cfg(algorithm="fedavg", rounds=2, system=system)), tmp_path / "r"
    ).metrics
    # each round: the slowest update's samples at 1e-9 samples/s plus a delay of 1e9 s
    assert all(math.isfinite(r["sim_time"]) and r["round_sim_s"] > 1e9 for r in rows)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["system.clock.speed.value=1e-320"], "lasts inf simulated seconds, not a finite number"),
        (["system.clock.speed.value=5", "system.clock.delay.value=1.7e308"], "passes the largest float"),
    ],
)
def test_a_clock_whose_durations_are_not_finite_is_one_line(
    tmp_path: Path, capsys, overrides, fragment
) -> None:
    """A tiny speed or a huge delay made every duration infinite and wrote ``"sim_time": Infinity``
    into metrics.jsonl (not JSON); now one line before any row, for both kinds of run."""
    for algorithm in ("fedbuff", "fedavg"):
        (tmp_path / algorithm).mkdir()
        _fails(
            tmp_path / algorithm,
            capsys,
            ["system.clock.speed.kind=constant", f"algorithm={algorithm}", *overrides],
            fragment,
        )


def test_metrics_lines_are_valid_json_without_nan_or_infinity(tmp_path: Path) -> None:
    """The one writer of metrics.jsonl (and client_metrics.jsonl) writes a figure that is not a
    finite number as null: every line parses under a strict reader."""
    import json

    from hpcfl.files import append_jsonl, read_jsonl

    def strict(line: str) -> Any:
        return json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} literal in {line!r}"))

    path = tmp_path / "m.jsonl"
    row = {"round": 1, "loss": math.nan, "sim_time": math.inf, "x": {"a": -math.inf, "b": [1.5, math.nan]}}
    append_jsonl(path, row)
    append_jsonl(path, {"round": 2, "loss": 0.25})
    assert [strict(line) for line in path.read_text().splitlines()] == [
        {"round": 1, "loss": None, "sim_time": None, "x": {"a": None, "b": [1.5, None]}},
        {"round": 2, "loss": 0.25},
    ]
    assert read_jsonl(path)[1] == {"round": 2, "loss": 0.25}


def _clock_trace_run(tmp_path: Path, trace: Path, rounds: int) -> list[str]:
    cfg = synthetic_config(
        tmp_path,
        algorithm="fedavg",
        rounds=rounds,
        system={"clock": {"speed": {"kind": "constant", "value": 50.0}, "trace": str(trace)}},
    )
    return ["run", str(cfg), "--run-dir", str(tmp_path / "r")]


def test_a_clock_trace_changed_before_a_resume_is_refused_and_the_same_one_resumes_bit_identically(
    tmp_path: Path, capsys
) -> None:
    """``system.clock.trace`` was re-read on ``--resume`` and neither copied nor checked: the run now
    keeps a copy (clock_trace.csv) and refuses another trace in one line, as for the dropout trace;
    the same trace resumes to the simulated times of a run done at once."""
    import json

    trace = tmp_path / "clock.csv"
    trace.write_text("client,speed,delay\n1,7,2.5\n")
    whole = tmp_path / "whole"
    whole.mkdir()
    assert main(_clock_trace_run(whole, trace, 3)) == 0
    run = _clock_trace_run(tmp_path, trace, 3)
    assert main([*run, "--set", "rounds=1"]) == 0
    assert (tmp_path / "r" / "clock_trace.csv").read_bytes() == trace.read_bytes()
    trace.write_text("client,speed,delay\n1,70,2.5\n")
    code = main([*run, "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and "Traceback" not in "\n".join(err)
    assert "system.clock.trace" in err[-1] and "changed since the run started" in err[-1]
    trace.write_text("client,speed,delay\n1,7,2.5\n")
    assert main([*run, "--resume"]) == 0

    def rows(d: Path) -> list[tuple[Any, ...]]:
        lines = (d / "metrics.jsonl").read_text().splitlines()
        return [
            (r["round"], r["sim_time"], r["test_accuracy"], r["test_loss"]) for r in map(json.loads, lines)
        ]

    assert rows(tmp_path / "r") == rows(whole / "r")
