"""Ditto (Li, Hu, Beirami & Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021).

Two models per client. The global model w is trained by FedAvg exactly as without personalisation
(each participant's local SGD on F_k from w^t, the server's n_k-weighted mean). Beside it each
client keeps a personal model v_k that solves its own objective with a proximal pull toward the
current global model, min_v F_k(v) + (λ/2)‖v − w^t‖² (its personal objective h_k); Algorithm 1 updates it
with s local iterations v_k ← v_k − η(∇F_k(v_k) + λ(v_k − w^t)) after the global update, with
v_k^0 = w^0. Only w is exchanged; v_k lives in the client state (memory or the on-disk store).

So Ditto's global model is FedAvg's for any λ (bit for bit: the global update draws its
mini-batches first from the client's generator, and the personal one draws after it). λ = 0 gives
purely local personal models; λ → ∞ pins v_k to the global model.

Defaults: λ = 1, the authors' runs (litian96/ditto ``run_fashion_clean_ditto_lam1.sh`` and the other
``*_lam1.sh`` scripts: ``--lam=1``) and the paper's fixed "relatively large λ (λ=1)" beside its
per-device choice from {0.1, 1, 2} on validation (Sec. 5, quoted by
https://ri.k117.org/papers/ditto_fair_and_robust_federated_learning_through_personalization__0131419f);
``personal_epochs`` = 1, the personal update taking the run's local schedule once, the same local
work as the global update: the authors' code (``flearn/trainers_MTL/ditto.py``) takes one personal
step beside each of the ``local_iters`` global steps. That code takes the personal step first and
on the same mini-batch as the global step; here the personal steps draw their own mini-batches after
the global update (Algorithm 1's order), which keeps the global model FedAvg's bit for bit. The
proximal term enters each step's direction after weight decay and before momentum, as FedProx's
does here (the authors' step is plain SGD: v ← v − η(∇F_k(v) + λ(v − w^t))).

Judged per client (:attr:`personalised`): client k's model is v_k (w^0 for a client never trained).
Two local trainings per participant: trained one by one under ``client_batch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcfl.algorithms.base import (
    Algorithm,
    ClientContext,
    ClientData,
    ClientState,
    HyperParams,
    ServerState,
    Upload,
    check_weighting,
    model_upload,
    read_phases,
)
from hpcfl.algorithms.fedrep import passes
from hpcfl.errors import ConfigError
from hpcfl.training.batched import LinearCorrection


@dataclass(frozen=True)
class DittoParams(HyperParams):
    """``lam``: λ of the proximal term toward the global model (default 1, >= 0);
    ``personal_epochs``: passes of the run's local schedule the personal model takes per round
    (default 1); ``weighting``: the global model's server mean (``samples``, FedAvg's, default)."""

    lam: float = 1.0
    personal_epochs: int = 1
    weighting: str = "samples"

    def __post_init__(self) -> None:
        check_weighting(self.weighting)
        if not self.lam >= 0:
            raise ConfigError(f"config key 'params.lam' (Ditto's λ) must be >= 0, got {self.lam}")
        epochs = self.personal_epochs
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ConfigError(f"config key 'params.personal_epochs' must be an integer >= 1, got {epochs!r}")


@dataclass
class DittoClientState(ClientState):
    """v: the client's personal model (a state vector); w^0 until it trains."""

    v: torch.Tensor | None = None


class Ditto(Algorithm[DittoParams, ServerState, DittoClientState]):
    name = "ditto"
    dp_refusal = "its personal models train outside the clipped update (not analysed for DP)"
    Params = DittoParams
    divergence_params = ("lam",)  # a huge λ diverges the personal step as a huge lr does
    personalised = True
    unbatched_reason = "each participant trains the global model, then its personal model"

    def init_client(self, k: int, server: ServerState) -> DittoClientState:
        return DittoClientState(v=server.x.clone())  # v_k^0 = w^0 (the runner passes the initial state)

    def personal_model(
        self, server: ServerState, client: DittoClientState, data: ClientData, ctx: ClientContext
    ) -> torch.Tensor:
        return client.v if client.v is not None else server.x

    def client_update(
        self, server: ServerState, client: DittoClientState, data: ClientData, ctx: ClientContext
    ) -> tuple[Upload, DittoClientState]:
        trainer = ctx.trainer
        assert trainer is not None
        w, global_run = trainer.train_tallies(server.x, data, ctx.generator)  # the global update: FedAvg's
        v0 = client.v if client.v is not None else server.x
        pull = LinearCorrection(pull=self.params.lam, anchor=server.x[: self.num_params])
        schedule = passes(trainer.schedule, self.params.personal_epochs)
        v, personal_run = trainer.train_tallies(v0, data, ctx.generator, correction=pull, schedule=schedule)
        result = read_phases(data, global_run, personal_run)  # one read for both; the global loss
        return model_upload(w, data, result, weighting=self.params.weighting), DittoClientState(v=v)
