"""Representation metrics: linear CKA (Kornblith et al. 2019) and the FedCKA regulariser."""

from hpcfl.metrics.cka import cka_per_layer as cka_per_layer
from hpcfl.metrics.cka import fedcka_loss as fedcka_loss
from hpcfl.metrics.cka import linear_cka as linear_cka

__all__ = ["cka_per_layer", "fedcka_loss", "linear_cka"]
