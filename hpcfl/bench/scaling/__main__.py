"""``python -m hpcfl.bench.scaling``: the same as ``hpcfl bench scaling``."""

import sys

from hpcfl.bench.scaling.cli import main

sys.exit(main())
