"""FedBN (Li, Jiang, Zhang, Kamp & Dou, "FedBN: Federated Learning on Non-IID Features via Local
Batch Normalization", ICLR 2021).

FedAvg in which every client keeps its BatchNorm layers (their affine weight and bias and their
running statistics) local: Algorithm 1 aggregates only the non-BN layers,
w^(l) ← Σ_k p_k w_k^(l) for every layer l that is not a BN layer, and each client trains from the
averaged layers with its own BN layers. Only the shared layers are exchanged, both ways: the upload
and the download are the state vector without the BN slices (``bytes_up`` and ``bytes_down`` count
that; the initial BN values a client first starts from are the model's seeded initialisation), and
a client's BN slices live in its client state (memory or the on-disk store).

Judged per client (:attr:`personalised`): a client's model is the server's shared layers with its
own BN layers (a client never trained has the initial ones). The server's ``x`` keeps the initial BN
values in its BN slices, so its ``test_accuracy`` is the shared layers under the initial
normalisation, not a model any client uses; read ``personal_acc_*`` (``client_eval``).

``weighting``: the server's mean of the shared layers, ``samples`` (default, FedAvg's n_k/n, so that
FedBN on a model without BN layers is FedAvg bit for bit) or ``uniform``, the authors' code:
med-air/FedBN ``federated/fed_digits.py`` averages every state-dict key without ``bn`` in its name
with ``client_weights = [1/client_num ...]`` (``communication()``), its clients holding equal shares
(``--percent`` of each dataset). Set ``weighting: uniform`` to reproduce it; the paper's
Algorithm 1 text was not at hand to say which it writes. The authors' local step is plain SGD
(``optim.SGD(lr=1e-2)``, no momentum), one epoch per round (``--wk_iters 1``): the run's schedule.

Which layers: modules of type ``BatchNorm1d/2d/3d`` (the code's ``bn`` layers: weight, bias and
running statistics). ``num_batches_tracked`` (an integer buffer outside the flat state) is not
kept; it matters only to a BN with ``momentum=None``, which no hpcfl model builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hpcfl.algorithms.base import (
    ClientContext,
    ClientData,
    ClientState,
    HyperParams,
    LocalTask,
    ServerState,
    check_weighting,
)
from hpcfl.algorithms.split import SplitAlgorithm
from hpcfl.training.layout import Entry

#: the module types whose parameters and statistics stay local
NORM_TYPES = ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm")


@dataclass(frozen=True)
class FedBNParams(HyperParams):
    """``weighting``: the server's mean of the shared layers, ``samples`` (default) or ``uniform``
    (the authors' code); see the module docstring."""

    weighting: str = "samples"

    def __post_init__(self) -> None:
        check_weighting(self.weighting)


@dataclass
class FedBNClientState(ClientState):
    """bn: the client's BN slices (parameters and running statistics, in vector order); None until
    it trains (then it starts from the server's, the initial ones)."""

    bn: torch.Tensor | None = None


class FedBN(SplitAlgorithm[FedBNParams, FedBNClientState]):
    name = "fedbn"
    dp_refusal = "it keeps BatchNorm layers (refused under DP) as client state outside the clipped update"
    Params = FedBNParams
    personalised = True

    def kept_entries(self) -> list[Entry]:
        """The BN layers' entries (parameters and running statistics); the rest is shared."""
        return [e for e in self.layout.entries if e.module_type in NORM_TYPES]

    def init_client(self, k: int, server: ServerState) -> FedBNClientState:
        return FedBNClientState()

    def personal_model(
        self, server: ServerState, client: FedBNClientState, data: ClientData, ctx: ClientContext
    ) -> torch.Tensor:
        return self.split.with_kept(server.x, client.bn)

    def local_task(
        self, server: ServerState, client: FedBNClientState, data: ClientData, ctx: ClientContext
    ) -> LocalTask[FedBNClientState]:
        split = self.split

        def finish(y: torch.Tensor, result: Any) -> tuple[Any, FedBNClientState]:
            bn = split.kept_of(y) if split.kept else None
            return self.shared_upload(y, data, result), FedBNClientState(bn=bn)

        return LocalTask(split.with_kept(server.x, client.bn), finish)
