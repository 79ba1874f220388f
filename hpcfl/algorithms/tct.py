"""TCT (Yu et al., NeurIPS 2022): Train, Convexify, Train — Algorithm 2 of the paper.

The algorithm declares its two stages: stage 1 is FedAvg for ``stage1.rounds`` rounds (this
class's own steps); stage 2 convexifies the bootstrapped model and solves the linear problem on its
eNTK features (:func:`hpcfl.tct.pipeline.enter_stage2`: features, federated standardisation,
SCAFFOLD on the regression). Defaults follow the paper (p = 100,000, η2 = 5e-5, M = 500, T2 = 100).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hpcfl.algorithms.base import (
    Algorithm,
    ClientContext,
    ClientData,
    ClientState,
    HyperParams,
    LocalTask,
    ServerState,
    Stage,
)
from hpcfl.algorithms.fedavg import local_training
from hpcfl.algorithms.tct_params import Stage1Section, Stage2Section
from hpcfl.errors import ConfigError


@dataclass(frozen=True)
class TCTParams(HyperParams):
    """stage1: the FedAvg bootstrap (rounds T1); stage2: the convexified problem (TCT Algorithm 2)."""

    stage1: Stage1Section = field(default_factory=Stage1Section)
    stage2: Stage2Section = field(default_factory=Stage2Section)

    def check_data(self, dataset: str, num_classes: int) -> None:
        s2 = self.stage2
        if s2.head == "keep" and not 0 <= s2.logit < num_classes:
            raise ConfigError(
                f"config key 'stage2.logit' must be a class index in [0, {num_classes}) for {dataset}, "
                f"got {s2.logit}"
            )

    def entk_method(self) -> str | None:
        """Stage 2's ``stage2.method`` when its features are eNTK features."""
        return self.stage2.method if self.stage2.features == "entk" else None


class TCT(Algorithm[TCTParams, ServerState, ClientState]):
    """Stage 1 of TCT is plain FedAvg (Algorithm 2's stage 1 with no correction)."""

    name = "tct"
    dp_refusal = "it uploads eNTK features, not a clippable update"
    Params = TCTParams
    legacy_sections = ("stage1", "stage2")
    logs_validation = False  # stage 2 evaluates the linear model on the test set only
    example_params = TCTParams(
        Stage1Section(rounds=1), Stage2Section(p=200, rounds=2, local_steps=3, lr=1e-3)
    )

    def local_task(
        self, server: ServerState, client: ClientState, data: ClientData, ctx: ClientContext
    ) -> LocalTask[ClientState]:
        return local_training(server, client, data)

    def stages(self) -> Sequence[Stage]:
        p = self.params
        return (
            Stage("stage1", p.stage1.rounds, finish="tct.keep_stage1_model"),
            Stage(
                "stage2",
                p.stage2.rounds,
                enter="tct.enter_stage2",
                check="tct.check_features_fit",
            ),
        )
