"""What the runner hands a stage's ``enter`` function, and what it gets back.

An algorithm with several stages (TCT) declares them; a later stage's ``enter`` builds the round
plan of that stage from the previous stage's final server state (or, on a resume inside the stage,
from what the run directory holds). The runner knows no algorithm by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hpcfl.algorithms import ClientState, ServerState
from hpcfl.runner.federation import Federation
from hpcfl.runner.rounds import RoundPlan


@dataclass(frozen=True)
class StageInput:
    """The run as a stage sees it on entry."""

    fed: Federation
    run_dir: Path
    previous: ServerState | None  # the previous stage's final state; None when resuming inside the stage
    stage_index: int
    stop: Callable[[], bool] | None = None  # polled inside long set-up work (True: a stop was asked for)
    sweep: bool = False  # entered by `hpcfl tct-stage2` on a run's stored inputs: read them, never rewrite


@dataclass
class StagePlan:
    """A stage's rounds: the plan, its initial server state and its clients' initial states."""

    plan: RoundPlan
    server: ServerState
    init_client: Callable[[int], ClientState]
