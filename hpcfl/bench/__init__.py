"""Benchmarks behind ``hpcfl bench KIND``: one module per kind with ``HELP``, ``add_arguments``
and ``run_cli`` (see :mod:`hpcfl.cli.bench`)."""
