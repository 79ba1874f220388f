"""An exclusive lock on a run directory, held for the life of one run.

Two ``hpcfl run`` processes on one run directory would both train to the end and append every
metrics row twice. The lock is ``RUN_DIR/.lock``: an ``flock`` on that file (the kernel releases it
when the holder exits, however it exits, so a killed run leaves no live lock behind) plus the
holder's ``host pid`` inside it, so that the refused process can name who holds it. Where the file
system does not support ``flock`` (some parallel file systems mount without it), the ``host pid``
content alone decides: a holder on this host whose process is gone is stale and taken over.
Under MPI only rank 0 takes the lock. A sweep directory is locked the same way by the ``hpcfl sweep``
that runs or queues its points (``RunLock(sweep_dir, what="sweep directory", ...)``), so two sweeps
never race over one grid.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

from hpcfl.errors import RunDirError

LOCK_FILE = ".lock"


class LockedError(RunDirError):
    """The directory is locked by another live process (``holder``: its host and PID, if known)."""

    def __init__(self, message: str, holder: tuple[str, int] | None = None) -> None:
        super().__init__(message)
        self.holder = holder


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_holder(run_dir: Path) -> tuple[str, int] | None:
    """The ``(host, pid)`` written in the lock file of ``run_dir``, or None."""
    try:
        host, pid = (Path(run_dir) / LOCK_FILE).read_text().split()
        return host, int(pid)
    except (OSError, ValueError):
        return None


def lock_holder(run_dir: Path) -> tuple[str, int] | None:
    """``(host, pid)`` of a live process holding the lock of ``run_dir``, or None when it is free."""
    path = Path(run_dir) / LOCK_FILE
    if not path.exists():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return read_holder(run_dir) or ("unknown-host", 0)
    except OSError:  # no flock here: judge by the recorded holder
        holder = read_holder(run_dir)
        if holder and (holder[0] != socket.gethostname() or _pid_alive(holder[1])):
            return holder
        return None
    finally:
        os.close(fd)
    return None


class RunLock:
    """``acquire()`` or refuse with one line naming the holder; ``release()`` on every exit path.

    ``what``, ``by`` and ``option`` word the refusal: "<what> D is in use by <by> (host H, PID P);
    wait for it to end, stop it, or choose another <option>".
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        what: str = "run directory",
        by: str = "another hpcfl run",
        option: str = "--run-dir",
    ) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.what, self.by, self.option = what, by, option
        self._fd: int | None = None

    def _refuse(self, holder: tuple[str, int] | None) -> LockedError:
        who = f"host {holder[0]}, PID {holder[1]}" if holder else "another process"
        return LockedError(
            f"{self.what} {self.run_dir} is in use by {self.by} ({who}); wait for it to "
            f"end, stop it, or choose another {self.option}",
            holder,
        )

    def acquire(self) -> None:
        """Create the run directory if needed and take its lock."""
        if self._fd is not None:
            return
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise RunDirError(f"{self.what} {self.run_dir} is a file; choose another {self.option}") from None
        except OSError as err:
            raise RunDirError(f"cannot create {self.what} {self.run_dir}: {err.strerror}") from None
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as err:
            raise RunDirError(f"cannot write the lock file {self.path}: {err.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._refuse(read_holder(self.run_dir)) from None
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                os.close(fd)
                raise
            holder = read_holder(self.run_dir)  # no flock on this file system: trust the content
            if holder and holder != (socket.gethostname(), os.getpid()):
                if holder[0] != socket.gethostname() or _pid_alive(holder[1]):
                    os.close(fd)
                    raise self._refuse(holder) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Empty the holder record and drop the lock (the file stays, so no one locks a ghost)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        finally:
            os.close(fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
