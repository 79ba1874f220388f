"""Scaling sweep of FedAvg rounds over ranks × clients × models, with a labelled projection.

A thin wrapper around ``hpcfl bench scaling`` (logic and the full description of what is measured
in :mod:`hpcfl.bench.scaling`); the options are the same::

    python benchmarks/scaling.py --rounds 2                  # default sweep -> benchmarks/out/scaling
    python benchmarks/scaling.py --summarize results/scaling/my   # rebuild table + plots
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcfl.bench.scaling import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
