"""TCT (Yu et al., NeurIPS 2022): Train, Convexify, Train — Algorithm 2 of the paper.

Stage 1 is FedAvg for ``stage1.rounds`` rounds (this class); the runner then convexifies the
bootstrapped model and solves stage 2 with :mod:`hpcfl.tct` (eNTK features, federated
standardisation, SCAFFOLD on the linear regression). Stage-2 hyper-parameters live in the config's
``stage2`` section; defaults follow the paper (p = 100,000, η2 = 5e-5, M = 500, T2 = 100).
"""

from __future__ import annotations

from hpcfl.algorithms.fedavg import FedAvg


class TCT(FedAvg):
    """Stage 1 of TCT: plain FedAvg (Algorithm 2's stage 1 with no correction)."""

    name = "tct"
