"""Cross-device scale (issue 63): what a long run of many clients keeps in memory.

The soak itself (10,000 clients, 1,000 rounds, RSS per round) is ``benchmarks/soak.py``; here: the
cause it found, checked without timing or memory figures."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hpcfl.comm import LocalComm
from hpcfl.config import config_from_dict
from hpcfl.runner.federation import build_federation
from tests.test_contract import BASE


def _fed(**extra: Any):
    return build_federation(config_from_dict({**BASE, "name": "scale", **extra}), LocalComm())


@pytest.mark.parametrize(
    ("extra", "kept"),
    [
        ({"clients_per_round": None}, True),  # full participation: the same clients every round
        ({"clients_per_round": 2}, False),
        ({"algorithm": "fedbuff", "clients_per_round": None, "params": {"buffer_size": 2}}, False),
    ],
    ids=["full", "partial", "asynchronous"],
)
def test_client_data_is_kept_only_for_clients_that_train_every_round(extra: dict, kept: bool) -> None:
    """Keeping every client's slice after its first use grew the process by a copy of the training
    set as clients were first drawn (the soak: RSS still rising after round 100 of 10,000 clients,
    100 a round); only under full synchronous participation are the slices kept, and a slice made
    anew holds the same samples."""
    fed = _fed(**extra)
    for k in range(len(fed.parts)):
        first, again = fed.client_data(k), fed.client_data(k)
        assert (first is again) == kept
        assert torch.equal(first.x, again.x) and torch.equal(first.y, again.y)
        assert torch.equal(first.x, fed.dataset.train.x[fed.parts[k]])
