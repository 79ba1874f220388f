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
so a client's numbers are computed the same way on any number of ranks (1 vs R ranks bit-identical).
Every client's (accuracy, loss, n) and fine-tuned (accuracy, loss) fill one row of a table that
rides the evaluation's ONE allreduce with the test (and validation, train) counts
(:meth:`ClientEval.eval_counts`, :class:`hpcfl.training.evaluate.JointCounts`): each row is filled
by one rank and zero elsewhere, so the sum is exact. The per-client values travel in the row under
:data:`CLIENT_ROWS`; the run's bookkeeping moves them into ``client_metrics.jsonl`` (one line per
round) before the row reaches ``metrics.jsonl``.

The model evaluated is the server's reported model (:meth:`ServerState.evaluated` ``[""]``, the one
``test_accuracy`` is of). Never changes results: evaluation loads it into the working model, which
every local update reloads before training, and the fine-tuning draws its batches from its own
generator (seed, round, client), never from a training generator.

TCT: stage 1 is the configured network, evaluated as above; stage 2's rounds evaluate its linear
model W on every client's held-out share, through the eNTK features of that share computed and
standardised as the training and test features are, by the rank that owns the client
(:func:`hpcfl.tct.pipeline.prepare_stage2`); its fine-tuning takes S local steps of the client's
stage-2 solver at stage 2's own η2 (the reason is given there).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hpcfl.algorithms import ClientData
from hpcfl.algorithms.base import NonFiniteLoss
from hpcfl.algorithms.stage_types import EVAL_SLOT
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


def sampled_clients(num_clients: int, m: int | None, seed: int, rnd: int) -> list[int]:
    """The clients a round evaluates: all of them, or a seeded sample of ``m`` (sorted), a pure
    function of (seed, round) so every rank and every resume draws the same ones."""
    if m is None or m >= num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng(np.random.SeedSequence([seed, _SAMPLE_SALT, rnd]))
    return sorted(int(k) for k in rng.choice(num_clients, size=m, replace=False))


#: (accuracy, loss) of a server vector on client k's held-out share, computed on this rank alone.
Score = Callable[[torch.Tensor, int], tuple[float, float]]
#: (accuracy, loss) on client k's held-out share after fine-tuning the server vector in round r
#: (NaN, NaN when the fine-tuning diverged).
Tune = Callable[[torch.Tensor, int, int], tuple[float, float]]


class ClientEval(Observer):
    """Per-client accuracy of the global model (and after local fine-tuning) on held-out shares.

    What is evaluated is given as functions, so the same observer serves the configured network
    (:meth:`for_federation`) and TCT's stage-2 linear model on eNTK features
    (:func:`hpcfl.tct.pipeline.prepare_stage2`): ``score(x, k)``, ``tune(x, k, round)`` (None: no
    fine-tuning) and ``place(ids)``, the evaluated clients this rank holds.
    """

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
        score: Score,
        held_sizes: Sequence[int],
        place: Callable[[list[int]], list[int]],
        tune: Tune | None,
        last_only: bool,
        sample: int | None,
        seed: int,
    ) -> None:
        self.score, self.held_sizes, self.place, self.tune = score, list(held_sizes), place, tune
        self.last_only, self.sample, self.seed = last_only, sample, seed
        self._ids: list[int] = []
        self._tuned = False

    @classmethod
    def for_federation(cls, fed: Federation) -> ClientEval:
        """The observer of a federation with ``client_eval``: the configured network (held-out
        shares sliced once, lazily), placed on ranks balanced by held-out size."""
        assert fed.client_eval is not None
        shares, cache = fed.client_eval, {}
        train, model, load = fed.dataset.train, fed.flat.model, fed.flat.load
        alone = LocalComm()  # each rank evaluates its clients whole: no collective per client

        def held_out(k: int) -> ClientData:
            if k not in cache:
                idx = shares[k]
                cache[k] = ClientData(k=k, x=train.x[idx].to(fed.device), y=train.y[idx].to(fed.device))
            return cache[k]

        def score(x: torch.Tensor, k: int) -> tuple[float, float]:
            load(x)
            data = held_out(k)
            return evaluate(model, data.x, data.y, alone)

        ft = fed.cfg.finetune_eval
        tune = None
        if ft.steps > 0:
            schedule = LocalSchedule(
                lr=ft.lr, batch_size=fed.cfg.batch_size, steps=ft.steps, weight_decay=fed.cfg.weight_decay
            )

            def tune(x: torch.Tensor, k: int, rnd: int) -> tuple[float, float]:
                try:
                    tuned, _ = fed.trainer.train(
                        x, fed.client_data(k), finetune_generator(fed.cfg.seed, rnd, k), schedule=schedule
                    )
                except NonFiniteLoss:
                    return math.nan, math.nan
                return score(tuned, k)

        sizes = [int(s.numel()) for s in shares]
        return cls(
            score=score,
            held_sizes=sizes,
            place=lambda ids: place_round(ids, [sizes[k] for k in ids], fed.comm.size)[fed.comm.rank],
            tune=tune,
            last_only=ft.rounds == "last",
            sample=fed.cfg.client_eval_clients,
            seed=fed.cfg.seed,
        )

    def eval_counts(self, end: RoundEnd) -> torch.Tensor:
        """This rank's clients' rows of the (M, 3 or 5) table: accuracy, loss, n (, fine-tuned
        accuracy, loss); the other rows are zero, so the evaluation's allreduce sums them exactly."""
        start = end.work.start
        self._ids = ids = sampled_clients(len(self.held_sizes), self.sample, self.seed, start.round)
        self._tuned = tune = self.tune is not None and (not self.last_only or start.final)
        table = torch.zeros(len(ids), 5 if tune else 3, dtype=torch.float64)  # host: per-client floats
        at = {k: i for i, k in enumerate(ids)}
        x = end.server.evaluated()[""]  # the reported model, as test_accuracy is
        for k in self.place(ids):
            if self.held_sizes[k] == 0:  # a one-sample client keeps its sample for training
                table[at[k]] = math.nan
                table[at[k], 2] = 0
                continue
            table[at[k], 0], table[at[k], 1] = self.score(x, k)
            table[at[k], 2] = self.held_sizes[k]
            if tune:
                assert self.tune is not None
                table[at[k], 3], table[at[k], 4] = self.tune(x, k, start.round)
        return table.view(-1)

    def row(self, end: RoundEnd, slots: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        ids, tune = self._ids, self._tuned
        table = slots[EVAL_SLOT].view(len(ids), 5 if tune else 3)
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


def finetune_generator(seed: int, rnd: int, k: int) -> torch.Generator:
    """The fine-tuning's batch generator of client ``k`` in round ``rnd``: its own stream (seed,
    salt, round, client), never a training generator's."""
    words = np.random.SeedSequence([seed, _FINETUNE_SALT, rnd, k]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(words[0]) << 32 | int(words[1]))
