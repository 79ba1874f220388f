"""``hpcfl bench KIND ...``: a tiny dispatcher over the benchmark kinds of :mod:`hpcfl.bench`.

Each kind is a module ``hpcfl.bench.<kind>`` exposing ``HELP`` (one line), ``add_arguments(parser)``
and ``run_cli(args) -> int``; adding a kind means adding its name to ``KINDS``.
"""

from __future__ import annotations

import argparse
import importlib

KINDS: tuple[str, ...] = ("entk", "scaling")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bench`` and one sub-command per kind."""
    parser = subparsers.add_parser("bench", help="measure throughput and scaling; writes CSV/JSON/PNG")
    kinds = parser.add_subparsers(dest="bench_kind", metavar="KIND")
    for kind in KINDS:
        module = importlib.import_module(f"hpcfl.bench.{kind}")
        sub = kinds.add_parser(kind, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.set_defaults(func=module.run_cli)
    parser.set_defaults(func=lambda args: parser.print_help() or 1)
