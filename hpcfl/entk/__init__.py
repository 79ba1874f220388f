"""eNTK features for TCT stage 2: z = S(∂f_logit(x; θ)/∂θ), p of the P coordinates.

Public API:

- :func:`entk_features` — the one entry point (loop / vmap / fused implementations behind
  :class:`EntkMethod`).
  ``cuda_graph=True`` (or, in a run, ``entk.cuda_graph``; ``HPCFL_ENTK_CUDA_GRAPH=1``) replays the
  fused path's full batches as CUDA graphs (:mod:`hpcfl.entk.cuda_graph`; a no-op on the CPU); the
  ``entk:`` settings and their environment overrides are :mod:`hpcfl.entk.settings`.
- :func:`coordinate_set` — the sorted kept coordinates (the paper's ``randperm(P)[:p]`` set).
- :func:`num_params` / :func:`scope_parameters` — the index space (``params="all"|"features"``).
- :func:`reinit_last_layer` — re-exported from :mod:`hpcfl.models` (the legacy ``stage2.head: keep``
  form; stage 2 now takes features through ``hpcfl.models.with_fresh_head``, a fresh seeded
  1-output classifier, as TCT's code does).
"""

from hpcfl.entk.api import entk_features as entk_features
from hpcfl.entk.coords import PARAM_SCOPES as PARAM_SCOPES
from hpcfl.entk.coords import coordinate_set as coordinate_set
from hpcfl.entk.coords import coords_hash as coords_hash
from hpcfl.entk.coords import num_params as num_params
from hpcfl.entk.coords import scope_parameters as scope_parameters
from hpcfl.entk.methods import EntkMethod as EntkMethod
from hpcfl.models import reinit_last_layer as reinit_last_layer

__all__ = [
    "PARAM_SCOPES",
    "EntkMethod",
    "coordinate_set",
    "coords_hash",
    "entk_features",
    "num_params",
    "reinit_last_layer",
    "scope_parameters",
]
