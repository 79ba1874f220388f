"""The round plan of NTK-FL / CP-NTK-FL: the run's model (or, with CP-NTK-FL's input projection, a
model on d₁′ inputs fed projected data), the network t* is chosen with, and the memory guard —
checked when the stage is entered, before any round runs (and again on a resume)."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from hpcfl.algorithms import ClientData, FederationView, ServerState, StageInput, StagePlan, Trainer
from hpcfl.comm.base import Communicator
from hpcfl.errors import ConfigError
from hpcfl.node import memory_share
from hpcfl.ntk.memory import RoundShape, check_round_memory, largest_round
from hpcfl.ntk.projection import projection_matrix
from hpcfl.training.evaluate import JointCounts, accuracy_loss, shard_counts
from hpcfl.training.flat import FlatModel
from hpcfl.training.layout import StateLayout

if TYPE_CHECKING:  # annotations only: the stage code reads the algorithm through the contract
    from hpcfl.algorithms.ntkfl import NTKFL, NTKFLParams

BUDGET_FRACTION = 0.8
"""Share of this node's available memory a round may use under ``memory_budget: auto``."""
#: products of the kernel per round past which a run says its evolution is long (10x the
#: reference grid's t = 2,000, one product a step)
LONG_EVOLUTION = 20_000


def long_evolution_note(p: NTKFLParams) -> str | None:
    """The note for a cross-entropy evolution of more than :data:`LONG_EVOLUTION` products of the
    N × N kernel a round (a grid up to t = 10⁶ ran silently for minutes a round), else None. The
    MSE evolution is closed form: any t costs the same."""
    if p.loss != "ce":
        return None
    t = max(p.grid)
    products = t if p.evolution == "discrete" else 4 * math.ceil(t / p.ce_dt)  # RK4: at least
    if products <= LONG_EVOLUTION:
        return None
    return (
        f"hpcfl: note: params.grid reaches t={t}: the cross-entropy evolution takes {products:,} products "
        "of the N x N kernel every round (the reference grid stops at t=2000), minutes a round on a CPU; "
        "lower params.grid unless that is intended"
    )


def memory_budget(value: str) -> int:
    """Bytes per rank: ``auto`` = 80 % of available memory over this node's ranks, else the bytes."""
    from hpcfl.units import parse_memory_budget

    parsed = parse_memory_budget(str(value), key="params.memory_budget")
    if parsed == "auto":
        return memory_share(BUDGET_FRACTION)
    if not isinstance(parsed, int):
        raise ConfigError(
            f"config key 'params.memory_budget' must be 'auto' or a number of bytes, got {value!r}"
        )
    return parsed


def check_memory(fed: FederationView, algo: NTKFL, flat: FlatModel, input_dim: int) -> None:
    """Refuse (one-line :class:`ConfigError`) a run whose largest possible round cannot fit."""
    params = algo.params
    sizes = list(fed.population.sizes)
    per_round = algo.participation.count or len(sizes)
    beta = float(getattr(params, "beta", 1.0))
    C = fed.dataset.num_classes
    first = None
    if fed.flat_inputs:
        hidden = flat.model.fc1.out_features  # type: ignore[union-attr]
        first = (hidden, algo.num_params - hidden * input_dim)
    per_sample = None
    if algo.factored(flat.model):
        linears = [m for m in flat.model.modules() if isinstance(m, torch.nn.Linear)]
        per_sample = sum(m.in_features + C * m.out_features for m in linears)
    shape = RoundShape(
        samples=largest_round(sizes, per_round, beta),
        outputs=C,
        params=algo.num_params,
        grid=len(params.grid),
        itemsize=flat.vector.element_size(),
        per_sample=per_sample,
    )
    check_round_memory(
        algo.name,
        shape,
        memory_budget(params.memory_budget),
        sizes=sizes,
        per_round=per_round,
        beta=beta,
        input_dim=input_dim,
        first_layer=first,
    )


def _projected(
    fed: FederationView, d_out: int, seed: int
) -> tuple[FlatModel, Callable[[int], ClientData], torch.Tensor]:
    """The model on d₁′ inputs (built from the run's seed), the projected client data, and the
    projected test inputs."""
    if not fed.flat_inputs:
        raise ConfigError(
            f"params.projection_dim needs a model on flat inputs (model: mlp), got model: {fed.model_name}; "
            "set params.projection_dim: 0"
        )
    d_in = math.prod(fed.dataset.input_shape)
    flat = FlatModel(fed.build_model((1, 1, d_out)))
    P = projection_matrix(d_in, d_out, seed, flat.vector.dtype).to(fed.device)  # (d₁, d₁′)

    def data(k: int) -> ClientData:
        raw = fed.client_data(k)
        return ClientData(k=k, x=raw.x.flatten(1).to(P.dtype) @ P, y=raw.y)  # Z = XP (n, d₁′)

    test = fed.dataset.test.x.flatten(1).to(P.dtype) @ P.cpu()
    return flat, data, test


def enter_ntk(entry: StageInput) -> StagePlan:
    """The plan of NTK-FL's single stage; raises the memory guard's ConfigError before any round."""
    fed = entry.fed
    algo = cast("NTKFL", fed.algorithm)  # the stage NTK-FL (and CP-NTK-FL) declare
    if fed.chosen_metrics:
        raise ConfigError(
            f"{algo.name} uploads Jacobians, not models: set cka_metrics: false and drift_diversity: false"
        )
    plan = fed.model_plan()
    flat = fed.flat
    d_out = int(getattr(algo.params, "projection_dim", 0))
    input_dim = math.prod(fed.dataset.input_shape)
    # ClientEval and the held-out clients' evaluation score the configured network on raw inputs
    for key, on in (
        ("client_eval", fed.client_eval is not None),
        ("heldout_clients", fed.heldout is not None),
    ):
        if d_out and on:
            raise ConfigError(
                f"{key} needs the configured model on raw inputs; {algo.name} with params.projection_dim "
                f"{d_out} trains a model on projected inputs: set {key}: 0 or params.projection_dim: 0"
            )
    if d_out:
        flat, data, test_x = _projected(fed, d_out, int(getattr(algo.params, "projection_seed", 0)))
        algo = type(algo)(
            algo.params, layout=StateLayout.of_model(flat.model), participation=algo.participation
        )
        test_y = fed.dataset.test.y
        projected_flat = flat

        comm: Communicator = entry.comm

        def evaluate_server(server: ServerState, joint: JointCounts) -> dict[str, float]:
            projected_flat.load(server.x)
            (counts,) = joint.reduce(comm, [shard_counts(projected_flat.model, test_x, test_y, comm)])
            acc, loss = accuracy_loss(counts)
            return {"test_accuracy": acc, "test_loss": loss}

        plan = dataclasses.replace(
            plan,
            algorithm=algo,
            data=data,
            trainer=Trainer(flat, fed.trainer.schedule),
            evaluate=evaluate_server,
        )
        input_dim = d_out
    held = algo.held_out(fed.population)
    validation = None
    if held:
        parts = [plan.data(k) for k in held]
        validation = (torch.cat([d.x for d in parts]), torch.cat([d.y for d in parts]))
    algo.attach(flat.model, validation)
    check_memory(fed, algo, flat, input_dim)
    if entry.comm.rank == 0 and (note := long_evolution_note(algo.params)) is not None:
        print(note, file=sys.stderr)
    plan.stage_index = entry.stage_index
    plan.client_metrics = ("loss", "jacobian_s")
    server = algo.init_server(flat.vector)
    return StagePlan(plan=plan, server=server, init_client=lambda k: algo.init_client(k, server))
