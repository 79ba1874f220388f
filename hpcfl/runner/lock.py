"""An exclusive lock on a run directory, held for the life of one run.

Two ``hpcfl run`` processes on one run directory would both train to the end and append every
metrics row twice. The lock is ``RUN_DIR/.lock``: an ``flock`` on that file (the kernel releases it
when the holder exits, however it exits, so a killed run leaves no live lock behind) plus the
holder's record inside it, ``host pid boot_id lease_until``, so that the refused process can name
who holds it.

Where the file system does not support ``flock`` (some parallel file systems mount without it), or
where ``HPCFL_RUN_LOCK=lease`` says its ``flock`` cannot be trusted across hosts (Lustre's
``localflock``, NFS's ``local_lock=all``: each host sees only its own locks), the record alone
decides, as a **lease**: the holder rewrites ``lease_until`` every third of the lease
(``HPCFL_RUN_LOCK_LEASE`` seconds, default :data:`LEASE_S`) from a daemon thread, and a record is
stale, and taken over with one line saying why, when its host is this host and its boot id differs
(the host rebooted) or its process is gone, or when its lease expired (its host died, froze or lost
the file system: nothing renews it). A holder that took the lock with ``flock`` records the lease
``inf``: a lease-mode process never takes it over on a lease. Under MPI only rank 0 takes the lock. A sweep directory is locked the same way by the ``hpcfl sweep``
that runs or queues its points (``RunLock(sweep_dir, what="sweep directory", ...)``), so two sweeps
never race over one grid.
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import socket
import sys
import threading
import time
from pathlib import Path

from hpcfl.errors import ConfigError, RunDirError

LOCK_FILE = ".lock"
LEASE_S = 120.0  # a lease-mode holder renews every 40 s; a dead host's lock is free within 2 min
MODE_ENV, LEASE_ENV = "HPCFL_RUN_LOCK", "HPCFL_RUN_LOCK_LEASE"
_NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP)


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


def boot_id() -> str:
    """This host's boot id (changes at every boot, so a PID recorded before a reboot is not
    mistaken for a live one); ``-`` where the kernel does not say."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or "-"
    except OSError:
        return "-"


def lease_mode() -> bool:
    """Whether ``HPCFL_RUN_LOCK`` asks for the lease protocol instead of ``flock`` (one
    :class:`ConfigError` line for a value that is neither)."""
    value = os.environ.get(MODE_ENV, "flock").strip().lower() or "flock"
    if value not in ("flock", "lease"):
        raise ConfigError(f"{MODE_ENV}={value!r}: must be flock (the default) or lease")
    return value == "lease"


def lease_seconds() -> float:
    """The lease of a lease-mode holder (``HPCFL_RUN_LOCK_LEASE``, default :data:`LEASE_S`)."""
    raw = os.environ.get(LEASE_ENV)
    if raw is None or not raw.strip():
        return LEASE_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{LEASE_ENV}={raw!r}: must be a positive number of seconds")
    return value


def _read_record(run_dir: Path) -> tuple[str, int, str | None, float | None] | None:
    """``(host, pid, boot id, lease until)`` of the lock file (None for the last two in a record
    written before they were kept), or None when it holds no record."""
    try:
        fields = (Path(run_dir) / LOCK_FILE).read_text().split()
        if len(fields) == 2:
            return fields[0], int(fields[1]), None, None
        host, pid, boot, until = fields
        return host, int(pid), boot, float(until)
    except (OSError, ValueError):
        return None


def read_holder(run_dir: Path) -> tuple[str, int] | None:
    """The ``(host, pid)`` written in the lock file of ``run_dir``, or None."""
    record = _read_record(run_dir)
    return None if record is None else (record[0], record[1])


def stale_reason(run_dir: Path, *, now: float | None = None) -> str | None:
    """Why the lock record of ``run_dir`` no longer stands for a live holder when ``flock`` cannot
    tell (module docstring), or None while it may (or when there is no record). A record of the
    old ``host pid`` form from another host takes its lease from the file's mtime."""
    record = _read_record(run_dir)
    if record is None:
        return None
    host, pid, boot, until = record
    if host == socket.gethostname():
        if boot is not None and boot != boot_id():
            return f"host {host} rebooted since (its boot id changed)"
        if not _pid_alive(pid):
            return f"PID {pid} on this host is gone"
        return None
    now = time.time() if now is None else now
    if until is None:
        try:
            until = (Path(run_dir) / LOCK_FILE).stat().st_mtime + lease_seconds()
        except OSError:
            return None
    if now > until:
        ago = now - until
        return f"its lease expired {ago:.0f} s ago: host {host} stopped renewing it (down, frozen or cut off)"
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
        return _leased_holder(run_dir)
    finally:
        os.close(fd)
    return _leased_holder(run_dir) if lease_mode() else None


def _leased_holder(run_dir: Path) -> tuple[str, int] | None:
    """The recorded holder while its record stands (:func:`stale_reason`), else None."""
    holder = read_holder(run_dir)
    if holder is None or holder == (socket.gethostname(), os.getpid()) or stale_reason(run_dir):
        return None
    return holder


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
        self._renew: tuple[threading.Event, threading.Thread] | None = None  # lease mode's renewal

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
            leased, lease = lease_mode(), lease_seconds()
        except ConfigError:
            os.close(fd)
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._refuse(read_holder(self.run_dir)) from None
        except OSError as err:
            if err.errno not in _NO_FLOCK:
                os.close(fd)
                raise
            leased = True  # no flock on this file system: the record decides, as a lease
        if leased:
            self._take_over_if_stale(fd)
        self._write_record(fd, time.time() + lease if leased else math.inf)
        self._fd = fd
        if leased:
            stop = threading.Event()
            thread = threading.Thread(target=self._renew_lease, args=(fd, lease, stop), daemon=True)
            thread.start()
            self._renew = (stop, thread)

    def _take_over_if_stale(self, fd: int) -> None:
        """Refuse while another holder's record stands; say in one line why a stale one is taken
        over (lease mode)."""
        holder = read_holder(self.run_dir)
        if holder is None or holder == (socket.gethostname(), os.getpid()):
            return
        reason = stale_reason(self.run_dir)
        if reason is None:
            os.close(fd)
            raise self._refuse(holder)
        print(
            f"hpcfl: note: {self.what} {self.run_dir}: took over the lock of host {holder[0]}, PID {holder[1]}: "
            f"{reason}",
            file=sys.stderr,
        )

    @staticmethod
    def _write_record(fd: int, until: float) -> None:
        """Write this process's record ``host pid boot_id lease_until`` in place (over the old one,
        then cut to length: a reader never finds the file empty while it is held)."""
        data = f"{socket.gethostname()} {os.getpid()} {boot_id()} {until!r}\n".encode()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))

    def _renew_lease(self, fd: int, lease: float, stop: threading.Event) -> None:
        """Push ``lease_until`` forward every third of the lease until released (a daemon thread:
        it dies with the process, so a dead holder's lease runs out)."""
        while not stop.wait(lease / 3):
            try:
                self._write_record(fd, time.time() + lease)
            except OSError:  # released meanwhile, or the file system went away: nothing to renew
                return

    def release(self) -> None:
        """Empty the holder record and drop the lock (the file stays, so no one locks a ghost)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        if self._renew is not None:  # stopped before the descriptor closes (its number may be reused)
            self._renew[0].set()
            self._renew[1].join()
            self._renew = None
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
