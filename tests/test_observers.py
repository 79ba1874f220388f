"""Round observers (issue 27 item 4): a metric declares its buffer channels and row columns, and the
round loop carries it without knowing it; observers change no result."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hpcfl.algorithms import (
    Channel,
    ClientData,
    FedAvg,
    LocalWork,
    Observer,
    RoundEnd,
    RoundPlan,
    RoundStart,
    Trainer,
)
from hpcfl.algorithms.base import Upload
from hpcfl.algorithms.participation import Population
from hpcfl.algorithms.stage_types import Value
from hpcfl.comm import LocalComm
from hpcfl.runner.buffer import BufferLayout
from hpcfl.runner.observers import RoundWatch, with_standard_observers
from hpcfl.runner.rounds import MemoryStates, round_observers, run_rounds
from hpcfl.training import FlatModel, LocalSchedule
from hpcfl.training.layout import StateLayout


class Census(Observer):
    """A metric the loop has never heard of: one channel of each kind."""

    group = "test"
    columns = ("seen_weight", "seen_ids", "seen_losses", "ranks_done", "starts")

    def __init__(self) -> None:
        self.starts = 0

    def channels(self) -> tuple[Channel, ...]:
        return (
            Channel("census_weight", 1),  # per round: every participant's weight added
            Channel("census_id", 1, "client"),  # per client: k + 1 in client k's slot
            Channel("census_loss", 1, "participant"),  # per participant: its local loss
            Channel("census_rank", 1, "rank"),  # per rank: 1 when its local work is done
        )

    def start(self, start: RoundStart) -> None:
        self.starts += 1

    def client(self, start: RoundStart, k: int, upload: Upload) -> dict[str, Value]:
        return {
            "census_weight": (torch.ones(1, dtype=torch.float64), upload.weight),
            "census_id": float(k + 1),
            "census_loss": upload.metrics["loss"],
        }

    def local_done(self, work: LocalWork) -> dict[str, Value]:
        return {"census_rank": 1.0}

    def row(self, end: RoundEnd, slots: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return {
            "seen_weight": float(slots["census_weight"]),
            "seen_ids": [int(v) - 1 for v in slots["census_id"].tolist() if v > 0],
            "seen_losses": slots["census_loss"].tolist(),
            "ranks_done": float(slots["census_rank"].sum()),
            "starts": self.starts,
        }


def _federation(sizes: tuple[int, ...] = (12, 20, 31)):
    g = torch.Generator().manual_seed(0)
    clients = [
        ClientData(k, torch.randn(n, 6, generator=g) + k, torch.randint(0, 3, (n,), generator=g))
        for k, n in enumerate(sizes)
    ]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    flat = FlatModel(model)
    algo = FedAvg(FedAvg.Params(), layout=StateLayout.of_model(model))
    trainer = Trainer(flat, LocalSchedule(lr=0.1, batch_size=8, steps=3))
    return clients, flat, algo, trainer


def _run(observers: tuple[Observer, ...], rounds: int = 2) -> tuple[torch.Tensor, list[dict]]:
    clients, flat, algo, trainer = _federation()
    by_id = {c.k: c for c in clients}
    server = algo.init_server(flat.vector.clone())
    plan = RoundPlan(
        algorithm=algo,
        comm=LocalComm(),
        data=by_id.__getitem__,
        trainer=trainer,
        population=Population(tuple(c.n for c in clients)),
        generator=lambda rnd, k: torch.Generator().manual_seed(rnd * 10 + k),
        evaluate=lambda s, joint: {"test_accuracy": 0.5},
        observers=observers,
    )
    rows: list[dict] = []
    states = MemoryStates(lambda k: algo.init_client(k, server))
    server, _ = run_rounds(
        plan, server, states, 0, rounds, hook=lambda d, s, st, row: rows.append(row) or False
    )
    return server.x, rows


def test_a_new_metric_is_an_observer_the_loop_carries_without_knowing_it() -> None:
    """Each channel kind lands where declared and is summed by the round's one allreduce; the
    observer's columns sit between the standard ones; the trajectory is the one without it."""
    census = Census()
    x, rows = _run((census,))
    plain_x, plain_rows = _run(())
    assert torch.equal(x, plain_x)  # an observer changes no result
    row = rows[-1]
    assert row["seen_weight"] == 12 + 20 + 31  # Σ n_k, each added with its weight
    assert row["seen_ids"] == [0, 1, 2]
    losses = row["seen_losses"]  # the standard client metrics summarise the same slots
    assert (min(losses), max(losses)) == (row["local_loss_min"], row["local_loss_max"])
    assert sum(losses) / 3 == pytest.approx(row["local_loss"], rel=1e-12)
    assert row["ranks_done"] == 1.0 and row["starts"] == 2  # start() every round, rows only when asked
    keys = list(row)
    assert keys[: keys.index("seen_weight")] == list(plain_rows[-1])[: keys.index("seen_weight")]
    assert keys[keys.index("starts") + 1 :] == ["imbalance", "state_io_s", "peak_rss_mb"] + [
        "bytes_up",
        "bytes_down",
        "allreduce_bytes",
    ] + ["seconds", "compute_s", "allreduce_s", "eval_s"]
    # the buffer grew by exactly the declared channels: 1 + 3 clients + 3 participants + 1 rank
    assert row["allreduce_bytes"] - plain_rows[-1]["allreduce_bytes"] == 8 * (1 + 3 + 3 + 1)


def test_every_column_of_a_real_run_is_declared_by_its_observer_in_row_order(tmp_path: Path) -> None:
    """A run with partial participation, CKA and drift diversity: its rows are round, stage, the
    evaluation, then exactly the declared columns of each observer, in observer order (FedAvg's
    server step reports nothing), then the run's wall clock ``wall_s``; with the chosen observers off, the final model is bit-identical."""
    from hpcfl.config import load_config
    from hpcfl.runner import run_experiment
    from hpcfl.runner.federation import build_federation, model_plan
    from tests.helpers import synthetic_config

    keys = dict(
        algorithm="fedavg",
        num_clients=6,
        clients_per_round=3,
        rounds=2,
        local_steps=2,
        dataset_options={"n_train": 300, "n_test": 60, "seed": 3},
    )
    cfg = load_config(synthetic_config(tmp_path, cka_metrics=True, drift_diversity=True, **keys))
    watched = run_experiment(cfg, tmp_path / "watched")
    plain = run_experiment(load_config(synthetic_config(tmp_path, **keys)), tmp_path / "plain")
    assert torch.equal(watched.server.x, plain.server.x)
    observers = round_observers(model_plan(build_federation(cfg, LocalComm())))
    declared = [c for obs in observers for c in obs.columns]
    assert "cka" in declared and "drift_diversity" in declared
    for row in watched.metrics:
        assert list(row) == ["round", "stage", "test_accuracy", "test_loss", *declared, "wall_s"]
    assert [o.group for o in observers] == [
        "train",
        "server",
        "train",
        "representation",
        "representation",
        "system",
        "comm",
        "time",
    ]


def test_a_per_participant_value_outside_client_is_refused() -> None:
    class Misplaced(Observer):
        def channels(self) -> tuple[Channel, ...]:
            return (Channel("misplaced", 1, "participant"),)

        def local_done(self, work: LocalWork) -> dict[str, Value]:
            return {"misplaced": 1.0}

    observers = with_standard_observers((Misplaced(),))
    layout = BufferLayout.of([("misplaced", 2)])
    start = RoundStart(0, (0, 1), Population((3, 4)), None, 0.0, True)  # type: ignore[arg-type]
    watch = RoundWatch(observers[3:4], start, layout, layout.allocate(torch.float64), 0)
    with pytest.raises(ValueError, match="slot per participant: fill it in client"):
        watch.local_done(LocalWork(start, 0.0, 0.0))
