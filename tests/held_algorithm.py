"""A test-only plugin (``imports: [tests.held_algorithm]``, ``algorithm: held_fedavg``): FedAvg whose
one participant holds at a known point of a known round, so a fault test can strike mid-round by
construction rather than race the job.

``params``: ``hold_round`` (0-based; -1: never), ``hold_client``, ``compute_s`` (that participant
first computes this long: matrix products, its main thread busy, as a slow rank's would be) and
``gate`` (a directory: the participant writes ``reached`` there and waits until ``open`` exists).
Holding changes only the time: the model equals plain FedAvg's bit for bit.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import hpcfl
from hpcfl.algorithms import ClientContext, ClientData, ClientState, LocalTask, ServerState
from hpcfl.algorithms.fedavg import FedAvg, FedAvgParams

REACHED, OPEN = "reached", "open"


@dataclass(frozen=True)
class HeldParams(FedAvgParams):
    """Where and how long one participant holds (see the module)."""

    hold_round: int = -1
    hold_client: int = 0
    compute_s: float = 0.0
    gate: str = ""


def hold(params: HeldParams) -> None:
    """Compute for ``compute_s``, then say ``reached`` and wait for ``open`` in ``gate``."""
    until = time.monotonic() + params.compute_s
    a = torch.randn(128, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    while time.monotonic() < until:
        a = torch.tanh(a @ a)
    if params.gate:
        gate = Path(params.gate)
        (gate / f"{REACHED}.tmp{os.getpid()}").write_text(f"{os.getpid()}\n")
        os.replace(gate / f"{REACHED}.tmp{os.getpid()}", gate / REACHED)
        while not (gate / OPEN).exists():
            time.sleep(0.05)


@hpcfl.register_algorithm
class HeldFedAvg(FedAvg):
    name = "held_fedavg"
    Params = HeldParams
    params: HeldParams

    def local_task(
        self, server: ServerState, client: ClientState, data: ClientData, ctx: ClientContext
    ) -> LocalTask[ClientState]:
        if ctx.round == self.params.hold_round and data.k == self.params.hold_client:
            hold(self.params)  # before the participant's training, whichever path trains it
        return super().local_task(server, client, data, ctx)
