"""Sweeps: a grid of runs (methods × partitions × seeds × hyper-parameters) as one command.

- :mod:`hpcfl.sweep.grid`: axes from ``--grid``/``--grid-file`` and ``--seeds``, expanded to named points;
- :mod:`hpcfl.sweep.plan`: every point validated before anything runs; the ``sweep.json`` manifest;
- :mod:`hpcfl.sweep.local`: running points here (skip finished, resume unfinished, record failures);
- :mod:`hpcfl.sweep.array`: the unfinished points as one SLURM job array;
- :mod:`hpcfl.sweep.status`, :mod:`hpcfl.sweep.report`: ``hpcfl status``/``report`` of a sweep directory;
- :mod:`hpcfl.sweep.select`: a hyper-parameter chosen on a validation split, never on the test set.
"""

from hpcfl._lazy import lazy_exports

# on first use: `hpcfl status`/`report` of a sweep read its manifest without importing the runner
lazy_exports(
    __name__,
    {
        "hpcfl.sweep.grid": ["Axis", "Point", "expand"],
        "hpcfl.sweep.local": ["PointOutcome", "run_point", "run_points"],
        "hpcfl.sweep.plan": ["Sweep", "SweepPoint", "plan_sweep", "read_sweep"],
    },
)

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
