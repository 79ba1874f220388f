"""What a run's conformal columns hold (``{method}_coverage_{level}``, ``{method}_set_size_{level}``).

Torch-free, so that ``hpcfl report`` can read them without importing the computation
(:mod:`hpcfl.metrics.conformal`).
"""

METHODS: tuple[str, ...] = ("lac", "aps")
ALPHAS: tuple[float, ...] = (0.1, 0.05, 0.01)  # target coverage 90%, 95%, 99% (FedPVR Figure 3)
