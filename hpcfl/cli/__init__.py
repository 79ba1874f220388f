"""The ``hpcfl`` command line: one module per sub-command, each with ``register`` and ``run``."""
