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
    the config is the recorded one, written in its legacy form, with ``reduction: float32``."""
    entry = GOLDEN[algorithm]
    cfg = config_from_dict({**entry["config"], "reduction": "float32"})
    result = run_experiment(cfg, tmp_path / "run")
    assert _sha(result.server.x) == entry["sha256"], algorithm
