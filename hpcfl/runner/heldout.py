"""Clients never trained on (``heldout_clients: N``): how the global model, and a personalised
method's own adaptation, do on clients that joined after training (PFLlib's ``--num_new_clients``;
FedRep's and Ditto's "new clients" experiments).

Which: a seeded draw of N of the partition's ``num_clients`` clients (a pure function of the seed;
the run's record lists their partition ids under ``heldout_clients``). They are taken out before
anything else: the other ``num_clients − N`` clients are the run's population, renumbered
0..K−N−1 in partition order, and only they train, take part in rounds (``participants`` are their
ids), give ``validation`` and ``client_eval`` shares and set ``participation``'s fraction.

Evaluated on: with ``client_eval: F``, each held-out client's own seeded share F (its
``client_eval`` share, drawn as the training clients' are, with a salt of its own); the rest is its
training share, what its adaptation trains on. Without ``client_eval``, all of its data.

Every row that evaluates reports, pooled over the held-out clients' evaluation samples (correct /
samples, as PFLlib's new-client accuracy):

- ``heldout_accuracy``, ``heldout_loss``: the server's reported model (the one ``test_accuracy``
  is of);
- for a personalised algorithm (:attr:`hpcfl.algorithms.Algorithm.personalised`) with
  ``client_eval``: ``heldout_personal_accuracy``, ``heldout_personal_loss``: each held-out client
  adapts as its method does when a client first joins, then is judged by its own model: one local
  update (:meth:`~hpcfl.algorithms.Algorithm.client_update`) from a fresh client state
  (:meth:`~hpcfl.algorithms.Algorithm.init_client` of the current server state) on its training
  share, whose upload is dropped, then :meth:`~hpcfl.algorithms.Algorithm.personal_model` of the
  state it ends with (FedRep: its head trained on the server's body; Ditto: its personal model
  pulled towards the server's; FedBABU: the global model fine-tuned). ``finetune_eval.rounds:
  last`` restricts this adaptation to the last round's row.

Held-out client j (0-based, in the order of the record's list) is client K−N+j to its method and
draws its adaptation's batches from its own streams (seed, salt, round, client), never a training
generator's; the adaptation works on copies (the run's working model is reloaded by every local
update), so nothing here changes the trajectory. The held-out clients are placed on ranks balanced
by their evaluation samples; each rank evaluates its clients whole and fills their rows of a table
that rides the evaluation's ONE allreduce (zero elsewhere), so the figures are bit-identical on any
number of ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hpcfl.algorithms import ClientData
from hpcfl.algorithms.base import ClientContext, NonFiniteLoss
from hpcfl.algorithms.stage_types import EVAL_SLOT, FederationView, Observer, RoundEnd
from hpcfl.comm.local import LocalComm
from hpcfl.comm.placement import place_round
from hpcfl.runner.client_eval import EvalSettings
from hpcfl.runner.shares import split_clients
from hpcfl.training.evaluate import shard_counts
from hpcfl.training.seeds import seeded_generator, seeded_rng

if TYPE_CHECKING:
    from hpcfl.config import Config

_CHOICE_SALT = 0x686C64  # "hld": which clients are held out
_SHARE_SALT = 0x686365  # "hce": the held-out clients' evaluation shares
_ADAPT_SALT = 0x686164  # "had": the adaptation's local update
_PERSONAL_SALT = 0x68706D  # "hpm": work the personal model's construction draws


@dataclass(frozen=True)
class HeldOut:
    """The held-out clients: their partition ids (the record's list), and per client its training
    share (what a personalised method adapts on) and evaluation share (train indices)."""

    ids: tuple[int, ...]
    train: tuple[torch.Tensor, ...]
    evaluation: tuple[torch.Tensor, ...]


def hold_out(parts: list[torch.Tensor], cfg: Config) -> tuple[list[torch.Tensor], HeldOut | None]:
    """``(the training clients' parts, the held-out clients)``: ``cfg.heldout_clients`` of the
    partition's clients drawn from the seed, taken out (None and ``parts`` unchanged when 0)."""
    n = cfg.heldout_clients
    if n == 0:
        return parts, None
    rng = seeded_rng(cfg.seed, _CHOICE_SALT)
    ids = sorted(int(k) for k in rng.choice(len(parts), size=n, replace=False))
    held = [parts[k] for k in ids]
    train, evaluation = held, held
    if cfg.client_eval > 0:
        train, evaluation = split_clients(held, cfg.client_eval, cfg.seed, salt=_SHARE_SALT)
    kept = [p for k, p in enumerate(parts) if k not in set(ids)]
    return kept, HeldOut(tuple(ids), tuple(train), tuple(evaluation))


class HeldOutEval(Observer):
    """The held-out clients' figures (module docstring) in every row that evaluates."""

    group = "heldout"
    columns = ("heldout_accuracy", "heldout_loss", "heldout_personal_accuracy", "heldout_personal_loss")

    def __init__(self, fed: FederationView, held: HeldOut, settings: EvalSettings) -> None:
        self.fed, self.held, self.settings = fed, held, settings
        self.personal = fed.algorithm.personalised and settings.shares
        self.last_only = settings.finetune.rounds == "last"
        self._adapted = False

    def _data(self, idx: torch.Tensor, k: int) -> ClientData:
        train, device = self.fed.dataset.train, self.fed.device
        return ClientData(k=k, x=train.x[idx].to(device), y=train.y[idx].to(device))

    def adapted(self, end: RoundEnd, j: int) -> torch.Tensor | None:
        """Held-out client ``j``'s own model after its method's adaptation (None: it diverged)."""
        fed, algo = self.fed, self.fed.algorithm
        rnd, k = end.work.start.round, fed.population.size + j
        data = self._data(self.held.train[j], k)

        def ctx(salt: int) -> ClientContext:
            return ClientContext(
                rnd, (), fed.population, fed.trainer, seeded_generator(self.settings.seed, salt, rnd, k)
            )

        try:
            _, state = algo.client_update(end.server, algo.init_client(k, end.server), data, ctx(_ADAPT_SALT))
            x = algo.personal_model(end.server, state, data, ctx(_PERSONAL_SALT))
        except NonFiniteLoss:
            return None
        return x if bool(torch.isfinite(x).all()) else None  # host: one check per held-out client

    def eval_counts(self, end: RoundEnd) -> torch.Tensor:
        """This rank's held-out clients' rows of the (N, 6) table: (correct, loss sum, samples) of
        the server's model, then of the adapted model (zero when not adapted this round)."""
        start = end.work.start
        self._adapted = self.personal and (not self.last_only or start.final)
        fed, held = self.fed, self.held
        sizes = [int(e.numel()) for e in held.evaluation]
        table = torch.zeros(len(sizes), 6, dtype=torch.float64)  # host: per-client counts
        alone = LocalComm()  # each rank evaluates its clients whole
        x = end.server.evaluated()[""]
        for j in place_round(list(range(len(sizes))), sizes, self.settings.ranks)[self.settings.rank]:
            data = self._data(held.evaluation[j], fed.population.size + j)
            models = {0: x}
            if self._adapted:
                models[3] = self.adapted(end, j)
            for col, vec in models.items():
                if vec is None:
                    table[j, col : col + 3] = table.new_tensor([math.nan, math.nan, sizes[j]])
                    continue
                fed.flat.load(vec)
                table[j, col : col + 3] = shard_counts(fed.flat.model, data.x, data.y, alone).cpu()[:3]
        return table.view(-1)

    def row(self, end: RoundEnd, slots: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        table = slots[EVAL_SLOT].view(-1, 6)
        out: dict[str, Any] = {}
        for col, name in ((0, "heldout"), (3, "heldout_personal")):
            if col == 3 and not self._adapted:
                continue
            correct, loss, n = (float(v) for v in table[:, col : col + 3].sum(0, dtype=torch.float64))
            out[f"{name}_accuracy"], out[f"{name}_loss"] = correct / n, loss / n
        return out
