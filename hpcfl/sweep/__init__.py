"""Sweeps: a grid of runs (methods × partitions × seeds × hyper-parameters) as one command.

- :mod:`hpcfl.sweep.grid`: axes from ``--grid``/``--grid-file`` and ``--seeds``, expanded to named points;
- :mod:`hpcfl.sweep.plan`: every point validated before anything runs; the ``sweep.json`` manifest;
- :mod:`hpcfl.sweep.local`: running points here (skip finished, resume unfinished, record failures);
- :mod:`hpcfl.sweep.array`: the unfinished points as one SLURM job array;
- :mod:`hpcfl.sweep.status`, :mod:`hpcfl.sweep.report`: ``hpcfl status``/``report`` of a sweep directory;
- :mod:`hpcfl.sweep.select`: a hyper-parameter chosen on a validation split, never on the test set.
"""

from hpcfl.sweep.grid import Axis as Axis
from hpcfl.sweep.grid import Point as Point
from hpcfl.sweep.grid import expand as expand
from hpcfl.sweep.local import PointOutcome as PointOutcome
from hpcfl.sweep.local import run_point as run_point
from hpcfl.sweep.local import run_points as run_points
from hpcfl.sweep.plan import Sweep as Sweep
from hpcfl.sweep.plan import SweepPoint as SweepPoint
from hpcfl.sweep.plan import plan_sweep as plan_sweep
from hpcfl.sweep.plan import read_sweep as read_sweep

__all__ = [
    "Axis",
    "Point",
    "PointOutcome",
    "Sweep",
    "SweepPoint",
    "expand",
    "plan_sweep",
    "read_sweep",
    "run_point",
    "run_points",
]
