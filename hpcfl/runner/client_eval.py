"""Per-client and personalised evaluation (issue 28): the global model on each client's held-out share.

``client_eval: F`` holds out a seeded share F of every client's own data (like ``validation:``, never
trained on; :func:`hpcfl.runner.shares.split_clients`). In every round that writes a metrics row,
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

Personalised algorithms (:attr:`hpcfl.algorithms.Algorithm.personalised`: FedBN, FedPer, FedRep,
FedBABU, Ditto, APFL) are judged by each client's own model: every evaluated client's
:meth:`~hpcfl.algorithms.Algorithm.personal_model` (from the server state and the client's state
after the round) is scored on the same held-out share, as ``personal_acc_*`` beside the global
model's ``client_acc_*`` (and per client ``personal_accuracy``/``personal_loss``). Those clients are
scored by the rank that holds their state: the rank that trains them (the round's placement of the
whole population, which is where states kept in memory live; any rank reads the on-disk store), so
the numbers do not depend on the rank count either.

TCT: stage 1 is the configured network, evaluated as above; stage 2's rounds evaluate its linear
model W on every client's held-out share, through the eNTK features of that share computed and
standardised as the training and test features are, by the rank that owns the client
(:func:`hpcfl.tct.pipeline.prepare_stage2`); its fine-tuning takes S local steps of the client's
stage-2 solver at stage 2's own η2 (the reason is given there).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hpcfl.algorithms import ClientData, ClientState, ServerState
from hpcfl.algorithms.base import ClientContext, NonFiniteLoss
from hpcfl.algorithms.stage_types import EVAL_SLOT, FederationView
from hpcfl.comm.local import LocalComm
from hpcfl.comm.placement import place_round
from hpcfl.runner.observers import Observer, RoundEnd
from hpcfl.training.evaluate import evaluate
from hpcfl.training.seeds import seeded_generator, seeded_rng
from hpcfl.training.sgd import LocalSchedule

if TYPE_CHECKING:
    from hpcfl.config import Config, FinetuneEval

#: The row key holding per-client values ({client id: {accuracy, loss, n, ...}}); the run's
#: bookkeeping writes it to ``client_metrics.jsonl`` and keeps it out of ``metrics.jsonl``.
CLIENT_ROWS = "client_metrics"
_SAMPLE_SALT = 0x636573  # "ces": which clients a round evaluates
_FINETUNE_SALT = 0x636674  # "cft": the fine-tuning's batches
_PERSONAL_SALT = 0x63706D  # "cpm": work a personal model's construction draws (FedBABU's fine-tuning)


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
    rng = seeded_rng(seed, _SAMPLE_SALT, rnd)
    return sorted(int(k) for k in rng.choice(num_clients, size=m, replace=False))


@dataclass(frozen=True)
class EvalSettings:
    """What the evaluation observers (:class:`ClientEval`, :class:`hpcfl.runner.heldout.HeldOutEval`)
    read of a run besides its federation view: a few settings and this rank's place, never the
    config or the communicator (each rank evaluates its clients whole, so only placement is needed)."""

    seed: int
    batch_size: int  # the fine-tuning's mini-batches
    weight_decay: float  # the fine-tuning's
    finetune: FinetuneEval
    sample: int | None  # ``client_eval_clients``: a round evaluates this many clients (None: all)
    shares: bool  # ``client_eval`` > 0: each client has an evaluation share of its own
    private: bool  # a run under DP (personal models are built outside the accountant)
    rank: int
    ranks: int

    @classmethod
    def of(cls, cfg: Config, rank: int, ranks: int) -> EvalSettings:
        """The settings of ``cfg`` for rank ``rank`` of ``ranks``."""
        return cls(
            seed=cfg.seed,
            batch_size=cfg.batch_size,
            weight_decay=cfg.weight_decay,
            finetune=cfg.finetune_eval,
            sample=cfg.client_eval_clients,
            shares=cfg.client_eval > 0,
            private=cfg.privacy.enabled,
            rank=rank,
            ranks=ranks,
        )


#: (accuracy, loss) of a server vector on client k's held-out share, computed on this rank alone.
Score = Callable[[torch.Tensor, int], tuple[float, float]]
#: The vector client k fine-tunes from a server vector in round r (None when the fine-tuning diverged).
Tune = Callable[[torch.Tensor, int, int], "torch.Tensor | None"]
#: Client k's personal model in round r, from the server state and the client's state (None when
#: building it diverged).
Personal = Callable[[ServerState, ClientState, int, int], "torch.Tensor | None"]

#: The models a client is judged by, in table order: (spread prefix, per-client key).
_MODELS = (("client", ""), ("finetune", "finetune_"), ("personal", "personal_"))


class ClientEval(Observer):
    """Per-client accuracy of the global model (and after local fine-tuning) on held-out shares.

    What is evaluated is given as functions, so the same observer serves the configured network
    (:meth:`for_federation`) and TCT's stage-2 linear model on eNTK features
    (:func:`hpcfl.tct.pipeline.prepare_stage2`): ``score(x, k)``, ``tune(x, k, round)`` (None: no
    fine-tuning) and ``place(ids)``, the evaluated clients this rank holds.
    """

    group = "clients"
    columns = tuple(
        f"{model}_{share}acc_{stat}"
        for share in ("", "val_")
        for model, _ in _MODELS
        for stat in ("mean", "std", "p10", "p90", "min")
    ) + ("client_eval_clients", "personal_private")

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
        personal: Personal | None = None,
        val_score: Score | None = None,
        private: bool = False,
    ) -> None:
        self.score, self.held_sizes, self.place, self.tune = score, list(held_sizes), place, tune
        self.last_only, self.sample, self.seed = last_only, sample, seed
        self.personal, self.val_score = personal, val_score
        #: a run under DP: its personal models are built outside the accountant (their figures are
        #: labelled ``personal_private: false``; docs/privacy.md, what sample-level DP checks)
        self.private = private
        self._ids: list[int] = []
        self._tuned = False

    @classmethod
    def for_federation(
        cls, fed: FederationView, settings: EvalSettings, validation_parts: list[torch.Tensor] | None
    ) -> ClientEval:
        """The observer of a federation with ``client_eval``: the configured network (held-out
        shares sliced once, lazily), placed on ranks balanced by held-out size. With
        ``validation_parts`` (each client's own validation share), every model is also scored on it
        (its ``*_val_acc_*`` columns: what a method's settings are chosen by, never the held-out share)."""
        assert fed.client_eval is not None
        train, model, load = fed.dataset.train, fed.flat.model, fed.flat.load
        alone = LocalComm()  # each rank evaluates its clients whole: no collective per client

        def scorer(shares: list[torch.Tensor]) -> Score:
            cache: dict[int, ClientData] = {}

            def score(x: torch.Tensor, k: int) -> tuple[float, float]:
                if k not in cache:
                    idx = shares[k]
                    cache[k] = ClientData(k=k, x=train.x[idx].to(fed.device), y=train.y[idx].to(fed.device))
                load(x)
                return evaluate(model, cache[k].x, cache[k].y, alone)

            return score

        ft = settings.finetune
        tune = None
        if ft.steps > 0:
            schedule = LocalSchedule(
                lr=ft.lr, batch_size=settings.batch_size, steps=ft.steps, weight_decay=settings.weight_decay
            )

            def tune(x: torch.Tensor, k: int, rnd: int) -> torch.Tensor | None:
                try:
                    tuned, _ = fed.trainer.train(
                        x, fed.client_data(k), finetune_generator(settings.seed, rnd, k), schedule=schedule
                    )
                except NonFiniteLoss:
                    return None
                return tuned

        algo = fed.algorithm
        personal = None
        if algo.personalised:

            def personal(server: ServerState, state: ClientState, k: int, rnd: int) -> torch.Tensor | None:
                gen = finetune_generator(settings.seed, rnd, k, salt=_PERSONAL_SALT)
                ctx = ClientContext(rnd, (), fed.population, fed.trainer, gen)
                try:
                    x = algo.personal_model(server, state, fed.client_data(k), ctx)
                except NonFiniteLoss:
                    return None
                if not bool(torch.isfinite(x).all()):  # host: evaluation reads per evaluated client
                    return None  # a model that diverged while built (fine-tuning)
                return x

        sizes = [int(s.numel()) for s in fed.client_eval]
        train_sizes = fed.population.sizes

        def place(ids: list[int]) -> list[int]:
            if personal is None:  # balanced by held-out size
                return place_round(ids, [sizes[k] for k in ids], settings.ranks)[settings.rank]
            # where the states are: the training placement of the whole population (memory states
            # live on the rank that trains the client under full participation)
            everyone = list(range(len(train_sizes)))
            mine = set(place_round(everyone, list(train_sizes), settings.ranks)[settings.rank])
            return [k for k in ids if k in mine]

        return cls(
            score=scorer(fed.client_eval),
            held_sizes=sizes,
            place=place,
            tune=tune,
            last_only=ft.rounds == "last",
            sample=settings.sample,
            seed=settings.seed,
            personal=personal,
            val_score=None if validation_parts is None else scorer(validation_parts),
            private=settings.private,
        )

    def _layout(self) -> dict[str, int]:
        """Column of each figure in a client's row of this round's table: ``{key}accuracy``,
        ``{key}loss`` on the held-out share and ``{key}val_accuracy`` on the validation share for
        every model judged (``key`` of :data:`_MODELS`), then ``n``."""
        judged = [key for _, key in _MODELS if self._judges(key)]
        names = [f"{key}{stat}" for key in judged for stat in ("accuracy", "loss")]
        if self.val_score is not None:
            names += [f"{key}val_accuracy" for key in judged]
        return {name: i for i, name in enumerate([*names, "n"])}

    def _judges(self, key: str) -> bool:
        return (
            key == ""
            or (key == "finetune_" and self._tuned)
            or (key == "personal_" and self.personal is not None)
        )

    def eval_counts(self, end: RoundEnd) -> torch.Tensor:
        """This rank's clients' rows of the (M, columns) table (:meth:`_layout`); the other rows
        are zero, so the evaluation's allreduce sums them exactly. Each judged model is built once
        (fine-tuned, personal) and scored on both shares."""
        start = end.work.start
        self._ids = ids = sampled_clients(len(self.held_sizes), self.sample, self.seed, start.round)
        self._tuned = self.tune is not None and (not self.last_only or start.final)
        col = self._layout()
        table = torch.zeros(len(ids), len(col), dtype=torch.float64)  # host: per-client floats
        at = {k: i for i, k in enumerate(ids)}
        x = end.server.evaluated()[""]  # the reported model, as test_accuracy is
        for k in self.place(ids):
            row = table[at[k]]
            if self.held_sizes[k] == 0:  # a one-sample client keeps its sample for training
                row.fill_(math.nan)
                row[col["n"]] = 0
                continue
            models: dict[str, torch.Tensor | None] = {"": x}
            if self._tuned:
                assert self.tune is not None
                models["finetune_"] = self.tune(x, k, start.round)
            if self.personal is not None:
                assert end.client_state is not None, "personal evaluation needs the round's client states"
                models["personal_"] = self.personal(end.server, end.client_state(k), k, start.round)
            for key, vec in models.items():
                acc, loss = (math.nan, math.nan) if vec is None else self.score(vec, k)
                row[col[f"{key}accuracy"]], row[col[f"{key}loss"]] = acc, loss
                if self.val_score is not None:
                    row[col[f"{key}val_accuracy"]] = math.nan if vec is None else self.val_score(vec, k)[0]
            row[col["n"]] = self.held_sizes[k]
        return table.view(-1)

    def row(self, end: RoundEnd, slots: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        ids, col = self._ids, self._layout()
        table = slots[EVAL_SLOT].view(len(ids), len(col))
        out: dict[str, Any] = {"client_eval_clients": len(ids)}
        if self.personal is not None and self.private:
            out["personal_private"] = False  # built outside the accountant: not covered by ε
        for prefix, key in _MODELS:
            if not self._judges(key):
                continue
            out.update(spread(table[:, col[f"{key}accuracy"]].tolist(), f"{prefix}_acc"))
            if self.val_score is not None:
                out.update(spread(table[:, col[f"{key}val_accuracy"]].tolist(), f"{prefix}_val_acc"))
        per_client: dict[str, dict[str, float]] = {}
        for k, values in zip(ids, table.tolist(), strict=True):
            entry = {name: values[i] for name, i in col.items()}
            entry["n"] = int(values[col["n"]])
            per_client[str(k)] = entry
        out[CLIENT_ROWS] = per_client
        return out


def finetune_generator(seed: int, rnd: int, k: int, *, salt: int = _FINETUNE_SALT) -> torch.Generator:
    """The fine-tuning's batch generator of client ``k`` in round ``rnd``: its own stream (seed,
    salt, round, client), never a training generator's (``salt``: another evaluation's stream)."""
    return seeded_generator(seed, salt, rnd, k)
