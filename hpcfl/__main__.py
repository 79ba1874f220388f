"""``python -m hpcfl`` is the ``hpcfl`` command."""

import sys

from hpcfl.cli.main import main

sys.exit(main())
