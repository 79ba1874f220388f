"""Representation metrics: linear CKA (Kornblith et al. 2019) and the FedCKA regulariser.

The names load on first use (:mod:`hpcfl._lazy`): ``hpcfl report`` reads constants of
:mod:`hpcfl.metrics.conformal_spec` and must not import torch.
"""

from hpcfl._lazy import lazy_exports

lazy_exports(__name__, {"hpcfl.metrics.cka": ["cka_per_layer", "fedcka_loss", "linear_cka"]})

__all__ = ["cka_per_layer", "fedcka_loss", "linear_cka"]
