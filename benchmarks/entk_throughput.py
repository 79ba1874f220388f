"""Reproduce the eNTK throughput figure of issue #3 with one command.

    python benchmarks/entk_throughput.py --model simplecnn --p 100000 --batch 256 --out bench-out/entk

A thin wrapper over :mod:`hpcfl.bench.entk` (the same code as ``hpcfl bench entk``); see
``--help`` for the options. Writes entk_bench.{csv,json,png} and prints the table.
"""

from __future__ import annotations

import sys

from hpcfl.bench.entk import main

if __name__ == "__main__":
    sys.exit(main())
