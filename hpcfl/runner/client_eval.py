"""Per-client and personalised evaluation (issue 28): the global model on each client's held-out share.

``client_eval: F`` holds out a seeded share F of every client's own data (like ``validation:``, never
trained on; :func:`hpcfl.runner.federation.split_clients`). In every round that writes a metrics row,
:class:`ClientEval` evaluates the global model on the held-out share of every client (or of a seeded
sample of ``client_eval_clients: M`` of them, a pure function of (seed, round)) and reports the
spread of their accuracies; with ``finetune_eval: {steps: S, lr: η}`` each evaluated client first
fine-tunes a copy of the global model for S plain SGD steps on its own training data ("FedAvg + local
fine-tuning", the number personalisation papers compare against).

How the spread is summarised: every client counts once, whatever its size, as q-FFL (Li et al.,
ICLR 2020, Table 1) and Ditto (Li et al., ICML 2021) report it: ``client_acc_mean`` the unweighted
mean of the clients' accuracies, ``client_acc_std`` their population standard deviation (ddof 0),
``client_acc_p10`` the mean accuracy of the worst 10 % of the evaluated clients (⌈0.1·M⌉, at least
one), ``client_acc_p90`` that of the best 10 %, ``client_acc_min`` the worst client's.

Sharding: the evaluated clients are placed on ranks balanced by held-out size
(:func:`hpcfl.comm.placement.place_round`); each rank evaluates (and fine-tunes) its clients whole,
so a client's numbers are computed the same way on any number of ranks (1 vs R ranks bit-identical),
and ONE allreduce per evaluated round carries every client's (accuracy, loss, n) and fine-tuned
(accuracy, loss). The per-client values travel in the row under :data:`CLIENT_ROWS`; the run's
bookkeeping moves them into ``client_metrics.jsonl`` (one line per round) before the row reaches
``metrics.jsonl``.

Never changes results: evaluation loads the server's ``x`` into the working model, which every local
update reloads before training, and the fine-tuning draws its batches from its own generator
(seed, round, client), never from a training generator. The rounds are those of the stage that
trains the configured model (TCT: stage 1; its stage 2 trains a linear model on features and is not
evaluated per client).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hpcfl.algorithms import ClientData, Trainer
from hpcfl.algorithms.base import NonFiniteLoss
from hpcfl.comm.base import Communicator
from hpcfl.comm.local import LocalComm
from hpcfl.comm.placement import place_round
from hpcfl.runner.observers import Observer, RoundEnd
from hpcfl.training.evaluate import evaluate
from hpcfl.training.sgd import LocalSchedule

if TYPE_CHECKING:
    from hpcfl.runner.federation import Federation

#: The row key holding per-client values ({client id: {accuracy, loss, n, ...}}); the run's
#: bookkeeping writes it to ``client_metrics.jsonl`` and keeps it out of ``metrics.jsonl``.
CLIENT_ROWS = "client_metrics"
_SAMPLE_SALT = 0x636573  # "ces": which clients a round evaluates
_FINETUNE_SALT = 0x636674  # "cft": the fine-tuning's batches


def spread(values: Sequence[float], prefix: str) -> dict[str, float]:
    """``{prefix}_mean/_std/_p10/_p90/_min`` of per-client values, every client counted once (see
    the module docstring); NaN values (a fine-tuning that diverged) are left out."""
    acc = np.sort(np.asarray([v for v in values if not math.isnan(v)], dtype=np.float64))
    if acc.size == 0:
        return {f"{prefix}_{s}": math.nan for s in ("mean", "std", "p10", "p90", "min")}
    tail = max(1, math.ceil(0.1 * acc.size))
    return {
        f"{prefix}_mean": float(acc.mean()),
        f"{prefix}_std": float(acc.std()),
        f"{prefix}_p10": float(acc[:tail].mean()),
        f"{prefix}_p90": float(acc[-tail:].mean()),
        f"{prefix}_min": float(acc[0]),
    }


@dataclass(frozen=True)
class Finetune:
    """``finetune_eval``: S plain SGD steps at ``lr`` on the client's training data (``steps`` 0: off)."""

    schedule: LocalSchedule | None
    last_only: bool


def sampled_clients(num_clients: int, m: int | None, seed: int, rnd: int) -> list[int]:
    """The clients a round evaluates: all of them, or a seeded sample of ``m`` (sorted), a pure
    function of (seed, round) so every rank and every resume draws the same ones."""
    if m is None or m >= num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng(np.random.SeedSequence([seed, _SAMPLE_SALT, rnd]))
    return sorted(int(k) for k in rng.choice(num_clients, size=m, replace=False))


class ClientEval(Observer):
    """Per-client accuracy of the global model (and after local fine-tuning) on held-out shares."""

    group = "clients"
    columns = (
        "client_acc_mean",
        "client_acc_std",
        "client_acc_p10",
        "client_acc_p90",
        "client_acc_min",
        "client_eval_clients",
        "finetune_acc_mean",
        "finetune_acc_std",
        "finetune_acc_p10",
        "finetune_acc_p90",
        "finetune_acc_min",
    )

    def __init__(
        self,
        *,
        comm: Communicator,
        model: torch.nn.Module,
        load: Callable[[torch.Tensor], None],
        held_out: Callable[[int], ClientData],
        held_sizes: Sequence[int],
        train_data: Callable[[int], ClientData],
        trainer: Trainer,
        finetune: Finetune,
        sample: int | None,
        seed: int,
    ) -> None:
        self.comm, self.model, self.load = comm, model, load
        self.held_out, self.held_sizes, self.train_data = held_out, list(held_sizes), train_data
        self.trainer, self.finetune, self.sample, self.seed = trainer, finetune, sample, seed

    @classmethod
    def for_federation(cls, fed: Federation) -> ClientEval:
        """The observer of a federation with ``client_eval`` (held-out shares sliced once, lazily)."""
        assert fed.client_eval is not None
        shares, cache = fed.client_eval, {}
        train = fed.dataset.train

        def held_out(k: int) -> ClientData:
            if k not in cache:
                idx = shares[k]
                cache[k] = ClientData(k=k, x=train.x[idx].to(fed.device), y=train.y[idx].to(fed.device))
            return cache[k]

        ft = fed.cfg.finetune_eval
        schedule = (
            LocalSchedule(
                lr=ft.lr, batch_size=fed.cfg.batch_size, steps=ft.steps, weight_decay=fed.cfg.weight_decay
            )
            if ft.steps > 0
            else None
        )
        return cls(
            comm=fed.comm,
            model=fed.flat.model,
            load=fed.flat.load,
            held_out=held_out,
            held_sizes=[int(s.numel()) for s in shares],
            train_data=fed.client_data,
            trainer=fed.trainer,
            finetune=Finetune(schedule, last_only=ft.rounds == "last"),
            sample=fed.cfg.client_eval_clients,
            seed=fed.cfg.seed,
        )

    def row(self, end: RoundEnd, slots: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        start = end.work.start
        ids = sampled_clients(len(self.held_sizes), self.sample, self.seed, start.round)
        tune = self.finetune.schedule is not None and (not self.finetune.last_only or start.final)
        width = 5 if tune else 3  # accuracy, loss, n (, fine-tuned accuracy, loss)
        table = torch.zeros(len(ids), width, dtype=torch.float64)
        mine = place_round(ids, [self.held_sizes[k] for k in ids], self.comm.size)[self.comm.rank]
        at = {k: i for i, k in enumerate(ids)}
        x = end.server.x
        alone = LocalComm()  # each rank evaluates its clients whole: no collective per client
        for k in mine:
            data = self.held_out(k)
            if data.y.numel() == 0:  # a one-sample client keeps its sample for training
                table[at[k]] = math.nan
                table[at[k], 2] = 0
                continue
            self.load(x)
            table[at[k], 0], table[at[k], 1] = evaluate(self.model, data.x, data.y, alone)
            table[at[k], 2] = data.y.numel()
            if tune:
                table[at[k], 3:5] = torch.tensor(
                    self._finetuned(x, k, start.round, data, alone), dtype=torch.float64
                )
        self.load(x)
        self.comm.allreduce(table)  # one slot per client, filled by one rank: the sum is exact
        out: dict[str, Any] = {**spread(table[:, 0].tolist(), "client_acc"), "client_eval_clients": len(ids)}
        per_client: dict[str, dict[str, float]] = {}
        for k, values in zip(ids, table.tolist(), strict=True):
            entry = {"accuracy": values[0], "loss": values[1], "n": int(values[2])}
            if tune:
                entry.update(finetune_accuracy=values[3], finetune_loss=values[4])
            per_client[str(k)] = entry
        if tune:
            out.update(spread(table[:, 3].tolist(), "finetune_acc"))
        out[CLIENT_ROWS] = per_client
        return out

    def _finetuned(
        self, x: torch.Tensor, k: int, rnd: int, data: ClientData, alone: Communicator
    ) -> tuple[float, float]:
        """Accuracy and loss on ``data`` of the global model fine-tuned on client ``k``'s training
        data (NaN, NaN when the fine-tuning diverged)."""
        state = np.random.SeedSequence([self.seed, _FINETUNE_SALT, rnd, k])
        words = state.generate_state(2, dtype=np.uint32)
        generator = torch.Generator().manual_seed(int(words[0]) << 32 | int(words[1]))
        try:
            tuned, _ = self.trainer.train(x, self.train_data(k), generator, schedule=self.finetune.schedule)
        except NonFiniteLoss:
            return math.nan, math.nan
        self.load(tuned)
        return evaluate(self.model, data.x, data.y, alone)
