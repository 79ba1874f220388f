"""NTK-FL's server maths (Yue et al., ICML 2022): the kernel over the round's per-sample Jacobians,
its closed-form evolution over the t-grid, the weight update, the memory guard, and the stage plan
that wires NTK-FL / CP-NTK-FL into the runner (:mod:`hpcfl.ntk.stage`)."""

from hpcfl.ntk.evolution import Rows as Rows
from hpcfl.ntk.evolution import balance as balance
from hpcfl.ntk.evolution import evolve as evolve
from hpcfl.ntk.evolution import kernel as kernel
from hpcfl.ntk.evolution import weight_updates as weight_updates
from hpcfl.ntk.memory import round_memory_bytes as round_memory_bytes

__all__ = ["Rows", "balance", "evolve", "kernel", "round_memory_bytes", "weight_updates"]
