"""``python -m hpcfl.bench.entk``: the standalone benchmark, and its ``--worker`` processes."""

import sys

from hpcfl.bench.entk.cli import main

sys.exit(main())
