"""Entry point of the ``hpcfl`` command.

Each sub-command lives in its own module of this package exposing ``register(subparsers)`` (adds
its parser and sets ``func``). User errors (:class:`hpcfl.errors.HpcflError`) print one line on
stderr and exit with their code, and so do the OS errors of writing files (disk full, quota,
permissions, read-only file system); in one process nothing else is caught, so a bug still shows
its traceback.

Under a launcher with several ranks a failure must end the whole job, or the other ranks wait
forever in their next collective: once MPI runs, the failing rank prints one line
``rank R: <cause>`` (after the traceback, for a bug) and aborts every rank through MPI. Ranks other
than 0 first wait a short grace period, so an error that every rank hits is reported once, by
rank 0, whose abort ends the others before they speak. Before MPI starts (options, config) every
rank fails alike and rank 0 alone reports, as in one process. A rank killed by a signal is reported
by its guard (:mod:`hpcfl.comm.guard`). A peer lost without its process exiting (a node gone, a link
cut) is noticed by the collective deadline; the communicator picks the one rank that says so
(:class:`~hpcfl.errors.PeerLostError`, reported without grace or rank prefix, exit 76).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from hpcfl.comm import abort_world, launched_world_size, launcher_rank, mpi_initialized, supervise_rank
from hpcfl.data.root import absolutize_env
from hpcfl.errors import HpcflError, PeerLostError
from hpcfl.node import choose_wait_policy

# OS errors a user or the machine causes while hpcfl writes files: one line naming the path and
# the cause instead of a traceback (disk full, quota, permissions, read-only file system).
_USER_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EFBIG})

# Sub-command modules, in the order --help lists them.
_COMMANDS = (
    "run",
    "compare",
    "sweep",
    "partition",
    "tct_stage2",
    "report",
    "submit",
    "status",
    "listing",
    "bench",
)

# Commands that train (torch's OpenMP threads matter): they choose the OpenMP wait policy first.
_TRAINING_COMMANDS = frozenset({"run", "compare", "sweep", "tct-stage2", "bench"})

# Seconds a failing rank other than 0 waits before reporting (see the module docstring).
ABORT_FLUSH_S = 0.5  # < REPORT_GRACE_S, so rank 0 still speaks first and alone
REPORT_GRACE_S = 2.0


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, with every sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="hpcfl",
        description="Federated learning on heterogeneous data, from one process to a SLURM cluster.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        importlib.import_module(f"hpcfl.cli.{name}").register(sub)
    return parser


def _fail(cause: str, code: int, *, chosen: bool = False) -> int:
    """Report a failure in one line and return ``code``; with several ranks, end them all.

    ``chosen``: the communicator chose this rank to speak for the job (a lost peer): no grace period
    and no rank prefix, the line names the ranks itself.
    """
    rank = launcher_rank()
    if chosen and mpi_initialized():
        print(f"hpcfl: error: {cause}", file=sys.stderr, flush=True)
        time.sleep(ABORT_FLUSH_S)
        abort_world(code)
        return code
    if launched_world_size() <= 1 or not mpi_initialized():
        # One process, or MPI not started yet: every rank parses the same options and config, so
        # they all fail alike and rank 0 says it once; the launcher ends the job as they exit.
        if rank == 0:
            print(f"hpcfl: error: {cause}", file=sys.stderr, flush=True)
        return code
    if rank != 0:
        time.sleep(REPORT_GRACE_S)
    print(f"hpcfl: error: rank {rank}: {cause}", file=sys.stderr, flush=True)
    # the launcher forwards our stderr through its proxy: give it the line before the abort tears
    # the job down (without this a loaded node lost rank 0's message now and then; measured in CI)
    time.sleep(ABORT_FLUSH_S)
    abort_world(code)  # returns only when MPI is not running (the launcher ends the others)
    return code


def _outside_hpcfl(err: BaseException) -> str | None:
    """``file:line`` of the frame that raised ``err`` when it is not hpcfl's own code (a plugin's),
    else None."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return None
    origin = frames[-1]
    package = str(Path(__file__).resolve().parents[1])
    if str(Path(origin.filename).resolve()).startswith(package + os.sep):
        return None
    return f"{origin.filename}:{origin.lineno}"


def run_command(func: Callable[[], int | None]) -> int:
    """Call ``func`` and turn what escapes it into an exit code, as the ``hpcfl`` command does."""
    try:
        return int(func() or 0)
    except PeerLostError as err:
        return _fail(str(err), err.exit_code, chosen=True)
    except HpcflError as err:
        return _fail(str(err), err.exit_code)
    except OSError as err:
        if err.errno not in _USER_ERRNOS:
            raise
        where = f" {err.filename}" if err.filename else ""
        return _fail(f"cannot write{where}: {err.strerror or err}", 1)
    except KeyboardInterrupt:
        print("hpcfl: interrupted", file=sys.stderr)
        return 130
    except SystemExit as err:
        where = _outside_hpcfl(err)
        if where is None:  # hpcfl's own exits (a requeue, an abort) keep their code
            raise
        code = err.code if isinstance(err.code, int) and err.code not in (0, 75) else 1
        return _fail(
            f"sys.exit({err.code!r}) in {where} ended the command (plugin code must raise an exception, not "
            "exit); the run did not finish",
            code,
        )
    except Exception as err:
        if launched_world_size() <= 1:
            raise
        traceback.print_exc()
        return _fail(f"internal error: {type(err).__name__}: {err}", 1)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    args_list = sys.argv[1:] if argv is None else list(argv)
    # Under a launcher with several ranks this process becomes the rank's guard (no return); the
    # rank is started again exactly as this process was (interpreter options included).
    # Only the command itself is supervised: main(argv) called from Python never replaces its caller.
    if argv is None:
        supervise_rank(sys.orig_argv[1:], rank=launcher_rank(), world_size=launched_world_size())
    absolutize_env()  # a relative $HPCFL_DATA must survive later changes of directory
    parser = build_parser()
    args = parser.parse_args(args_list)
    if not getattr(args, "func", None):
        parser.print_help()
        return 1
    if args.command in _TRAINING_COMMANDS:
        choose_wait_policy()  # before torch loads its OpenMP runtime: passive on a busy node
    return run_command(lambda: args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
