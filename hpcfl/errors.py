"""User-facing errors.

Anything a user can cause (a bad config, missing data, a diverging learning rate, a rank that died)
is raised as an :class:`HpcflError`; the command line prints it as one line and exits non-zero,
never with a traceback. Internal bugs stay ordinary exceptions so they keep their traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

EXIT_RESUMABLE = 75
"""Exit code of a run stopped cleanly by SIGUSR1/SIGTERM after checkpointing (EX_TEMPFAIL): run the
same command again (or ``--resume``) to continue. ``hpcfl run``, ``hpcfl compare`` and the scaling
sweep use it; SLURM scripts requeue on it."""

EXIT_PEER_LOST = 76
"""Exit code of a job ended because a peer rank did not answer within the collective deadline
(``comm_timeout``: its node was lost or its link cut). The work up to the last checkpoint is kept:
resume with ``--resume``; SLURM scripts requeue on it, as on 75, unless the only lines in the run's
``PEER_LOST`` come from a side without a majority (they say "without requeueing")."""


class HpcflError(Exception):
    """A problem the user can fix; ``str(err)`` names the cause and the fix in one line."""

    exit_code = 2


class ConfigError(HpcflError):
    """The configuration or the command-line options are invalid."""


class DataError(HpcflError):
    """A dataset is missing, corrupt, or cannot be downloaded."""


class RunDirError(HpcflError):
    """The run directory is in a state that forbids the requested action."""


class DivergenceError(HpcflError):
    """Training produced NaN/inf or a learning rate is provably unstable."""


class CommError(HpcflError):
    """The process layout (ranks, clients, launcher) is invalid."""


class PeerLostError(CommError):
    """A collective's peers did not answer within the deadline (or MPI reported their failure). The
    communicator raises it on the one rank chosen to speak for its side; the command prints it
    without a rank prefix and ends every rank with :data:`EXIT_PEER_LOST`. ``requeue`` is False on a
    side that is not a majority (a tie without rank 0): it ends without asking for a requeue."""

    exit_code = EXIT_PEER_LOST

    def __init__(self, message: str, *, requeue: bool = True) -> None:
        super().__init__(message)
        self.requeue = requeue


class StoreError(HpcflError):
    """A feature store is missing, incomplete, or does not match the request."""


class StoppedError(HpcflError):
    """A stop signal (SIGTERM/SIGUSR1, SLURM's preemption) ended the run where no round
    checkpoint applies (e.g. during the eNTK extraction); the work done is kept and a resume
    continues. Exit code 75 (EX_TEMPFAIL), as for a stop after a round."""

    exit_code = 75


def suggest(name: str, choices: Iterable[str]) -> str:
    """Return ' (did you mean X?)' for the closest valid choice, or '' when nothing is close."""
    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown(kind: str, name: str, choices: Iterable[str]) -> ConfigError:
    """Build the standard 'unknown X' error listing the valid choices."""
    choices = sorted(choices)
    return ConfigError(
        f"unknown {kind} {name!r}{suggest(name, choices)}; choose one of: {', '.join(choices)}"
    )
