"""Official dataset files: MD5 verification (cached) and download with an atomic rename.

Verifying costs a full read (30 MB for Fashion-MNIST, 170 MB for CIFAR), so the digest is cached
in a small JSON sidecar keyed by the file's identity — inode, size, mtime and ctime (ns) — beside
the file (``.NAME.md5.json``) when its directory is writable, else under the user cache
(``$XDG_CACHE_HOME/hpcfl/checksums``) so read-only shared dataset stores are never written to.
Touching, replacing or writing the file invalidates the entry: a write in place that keeps the size
and sets the mtime back (``os.utime``) still moves the ctime, which no user can set (issue 61). A download goes to a hidden temp name in the target directory, is checked
against the published MD5 while streaming, and only then renamed into place, so a file under its
official name is never half-written.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from hpcfl.errors import DataError
from hpcfl.files import atomic_write, atomic_write_text, user_cache_dir

_CHUNK = 1 << 20


class _TransferError(DataError):
    """The download itself failed (offline, HTTP error, disk full), as opposed to a bad file."""


@dataclass(frozen=True)
class RemoteFile:
    """One official file: its name on disk, where to fetch it, and its published MD5."""

    name: str
    url: str
    md5: str


def md5sum(path: str | os.PathLike[str]) -> str:
    """The hex MD5 of a file, read in 1 MiB chunks (no caching)."""
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _writable_dir(directory: Path) -> bool:
    """True when we may write into ``directory``; a directory with no write bit at all counts as
    read-only even for root (shared dataset stores are often mounted or chmod-ed that way)."""
    try:
        mode = directory.stat().st_mode
    except OSError:
        return False
    return bool(mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)) and os.access(directory, os.W_OK)


def _sidecars(path: Path) -> list[Path]:
    """Candidate sidecar locations, beside the file first."""
    resolved = path.resolve()
    key = hashlib.sha1(str(resolved).encode(), usedforsecurity=False).hexdigest()
    beside = resolved.with_name(f".{resolved.name}.md5.json")
    return [beside, user_cache_dir("checksums") / f"{key}.json"]


def _identity(path: Path, st: os.stat_result) -> dict[str, object]:
    """What a sidecar's digest is trusted on: the file's path, inode, size, mtime and ctime (ns)."""
    return {
        "path": str(path.resolve()),
        "inode": st.st_ino,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
    }


def _read_cached_md5(path: Path, st: os.stat_result) -> str | None:
    """The sidecar's digest while the file's identity is unchanged (an older sidecar without the
    inode and ctime is not trusted: the file is hashed once more)."""
    identity = _identity(path, st)
    for side in _sidecars(path):
        try:
            rec = json.loads(side.read_text())
        except (OSError, ValueError):
            continue
        if (
            isinstance(rec, dict)
            and all(rec.get(k) == v for k, v in identity.items())
            and isinstance(rec.get("md5"), str)
        ):
            return rec["md5"]
    return None


def _write_cached_md5(path: Path, st: os.stat_result, digest: str) -> None:
    """Best effort: a cache that cannot be written only costs a re-hash next time."""
    record = {**_identity(path, st), "md5": digest}
    for side in _sidecars(path):
        try:
            if side.parent == path.resolve().parent:
                if not _writable_dir(side.parent):
                    continue
            else:
                side.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(side, json.dumps(record) + "\n")
            return
        except OSError:
            continue


def file_md5(path: str | os.PathLike[str]) -> str:
    """The MD5 of a file, taken from its sidecar while the file's identity (inode, size, mtime,
    ctime) is unchanged."""
    path = Path(path)
    st = path.stat()
    cached = _read_cached_md5(path, st)
    if cached is not None:
        return cached
    digest = md5sum(path)
    _write_cached_md5(path, st, digest)
    return digest


def verify_md5(path: str | os.PathLike[str], expected: str) -> None:
    """Raise :class:`DataError` naming the file and both digests when ``path`` is not the official file."""
    actual = file_md5(path)
    if actual != expected.lower():
        raise DataError(
            f"{path} is corrupt or not the official file: md5 {actual}, expected {expected}; "
            "delete it and re-download"
        )


def download_file(
    url: str, dest: str | os.PathLike[str], *, md5: str | None = None, timeout: float = 60.0
) -> Path:
    """Fetch ``url`` into ``dest`` through a temp name and an atomic rename.

    The MD5 is computed while streaming; on a mismatch or any transfer error the temp file is
    removed and :class:`DataError` is raised, so ``dest`` either is complete and verified or does
    not exist.
    """
    dest = Path(dest)
    digest = hashlib.md5(usedforsecurity=False)
    print(f"hpcfl: downloading {url} -> {dest}", file=sys.stderr)

    def fetch(out: BinaryIO) -> None:
        request = urllib.request.Request(url, headers={"User-Agent": "hpcfl"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            while chunk := response.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
        if md5 is not None and digest.hexdigest() != md5.lower():
            raise DataError(
                f"downloaded {url} but its md5 is {digest.hexdigest()}, expected {md5}; "
                "the mirror may be broken: try again later or fetch the file by hand"
            )

    try:
        atomic_write(dest, fetch)  # the temp file is removed on any failure
    except (OSError, ValueError) as err:  # URLError, HTTPError, timeouts and disk errors are OSError
        reason = " ".join(str(err).split())
        raise _TransferError(f"downloading {url} failed ({reason})") from err
    _write_cached_md5(dest, dest.stat(), digest.hexdigest())
    return dest


def ensure_file(
    directory: Path,
    remote: RemoteFile,
    *,
    dataset: str,
    download: bool,
    verify: bool = True,
    accepted: str | None = None,
) -> Path:
    """The verified local path of ``remote`` in ``directory``, downloading it when allowed.

    Missing with ``download=False`` or with the download failing raises :class:`DataError` saying
    which file, where it looked, and how to fix it; ``accepted`` describes what may stand in for
    the file in that message (default ``<dir>/<name>``). A download with the wrong MD5 is a
    DataError of its own and leaves nothing behind.
    """
    path = directory / remote.name
    if path.is_file():
        if verify:
            verify_md5(path, remote.md5)
        return path
    fix = f"point --data-root or HPCFL_DATA at the directory that holds {accepted or f'{directory.name}/{remote.name}'}"
    if not download:
        raise DataError(
            f"{dataset}: {remote.name} not found in {directory} (download disabled); {fix}, or allow downloading"
        )
    try:
        return download_file(remote.url, path, md5=remote.md5)
    except _TransferError as err:
        raise DataError(
            f"{dataset}: {remote.name} not found in {directory} and {err}; {fix}, or go online"
        ) from err
