"""Entry point of the ``hpcfl`` command.

Each sub-command lives in its own module of this package exposing ``register(subparsers)`` (adds
its parser and sets ``func``). User errors (:class:`hpcfl.errors.HpcflError`) print one line on
stderr and exit with their code; nothing else is caught, so a bug still shows its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from hpcfl.comm import launcher_rank
from hpcfl.data.root import absolutize_env
from hpcfl.errors import HpcflError

# Sub-command modules, in the order --help lists them.
_COMMANDS = (
    "run",
    "compare",
    "partition",
    "tct_stage2",
    "report",
    "submit",
    "status",
    "bench",
)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, with every available sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="hpcfl",
        description="Federated learning on heterogeneous data, from one process to a SLURM cluster.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        try:
            module = importlib.import_module(f"hpcfl.cli.{name}")
        except ModuleNotFoundError as err:
            if err.name == f"hpcfl.cli.{name}":
                continue  # sub-command not part of this build
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    absolutize_env()  # a relative $HPCFL_DATA must survive later changes of directory
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 1
    try:
        return int(args.func(args) or 0)
    except HpcflError as err:
        if launcher_rank() == 0:  # every rank hits the same error; say it once
            print(f"hpcfl: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("hpcfl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
