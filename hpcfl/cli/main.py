"""Entry point of the ``hpcfl`` command.

Each sub-command lives in its own module of this package exposing ``register(subparsers)`` (adds
its parser and sets ``func``). User errors (:class:`hpcfl.errors.HpcflError`) print one line on
stderr and exit with their code, and so do the OS errors of writing files (disk full, quota,
permissions, read-only file system); nothing else is caught, so a bug still shows its traceback.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import sys

from hpcfl.comm import launcher_rank
from hpcfl.errors import HpcflError

# OS errors a user or the machine causes while hpcfl writes files: one line naming the path and
# the cause instead of a traceback (disk full, quota, permissions, read-only file system).
_USER_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EFBIG})

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
    except OSError as err:
        if err.errno not in _USER_ERRNOS:
            raise
        if launcher_rank() == 0:
            where = f" {err.filename}" if err.filename else ""
            print(f"hpcfl: error: cannot write{where}: {err.strerror or err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hpcfl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
