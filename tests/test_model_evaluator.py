"""The server model's evaluation reads only what it is given (issue 55): a working model, a
communicator and the splits, no federation. Any split it is handed gets its columns, each equal to
evaluating that split on its own."""

from __future__ import annotations

import torch

from hpcfl.algorithms import ServerState
from hpcfl.comm import LocalComm
from hpcfl.models import build_model
from hpcfl.runner.federation import model_evaluator
from hpcfl.training.evaluate import JointCounts, evaluate
from hpcfl.training.flat import FlatModel


def test_model_evaluator_scores_every_split_it_is_given_as_evaluate_does() -> None:
    torch.manual_seed(0)
    flat = FlatModel(build_model("mlp", (1, 8, 8), 10))
    x = torch.randn(50, 1, 8, 8)
    y = torch.randint(0, 10, (50,))
    sets = {"test": (x[:30], y[:30]), "heldout": (x[30:], y[30:])}
    server = ServerState(flat.vector.clone() + 0.01)
    row = model_evaluator(flat, LocalComm(), sets)(server, JointCounts())
    assert list(row) == ["test_accuracy", "test_loss", "heldout_accuracy", "heldout_loss"]
    flat.load(server.x)
    for split, (xs, ys) in sets.items():
        assert (row[f"{split}_accuracy"], row[f"{split}_loss"]) == evaluate(flat.model, xs, ys, LocalComm())
