"""Files checked by content, caches keyed by what was read (issue 61 item 6).

A checksum sidecar is trusted only while the file's identity (inode, size, mtime and ctime) is
unchanged: a write in place that keeps the size and sets the mtime back (``os.utime``) still moves
the ctime. The Shakespeare parse cache is keyed by the digest computed from the archive. Every test
works on a copy in ``tmp_path``; the shared datasets are never written."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from hpcfl.data import download as dl
from hpcfl.data import shakespeare as shk
from hpcfl.errors import DataError


@pytest.fixture(autouse=True)
def _private_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checksum sidecars of read-only folders and the parse cache go to tmp, not ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def _rewrite_in_place(path: Path, data: bytes) -> None:
    """Write ``data`` over ``path`` in place (same inode) and set its mtime back to what it was."""
    st = path.stat()
    assert len(data) == st.st_size
    with open(path, "r+b") as fh:
        fh.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)


def test_a_file_changed_in_place_with_its_size_and_mtime_kept_is_hashed_again(tmp_path: Path) -> None:
    path = tmp_path / "file.bin"
    path.write_bytes(b"hello world")
    assert dl.file_md5(path) == hashlib.md5(b"hello world").hexdigest()
    record = json.loads(path.with_name(".file.bin.md5.json").read_text())
    assert {"inode", "size", "mtime_ns", "ctime_ns"} <= set(record)
    _rewrite_in_place(path, b"HELLO world")
    assert dl.file_md5(path) == hashlib.md5(b"HELLO world").hexdigest()  # was the sidecar's stale digest


def test_a_sidecar_from_before_the_identity_check_is_not_trusted(tmp_path: Path) -> None:
    """A sidecar keyed by size and mtime only (as written before issue 61) costs one re-hash."""
    path = tmp_path / "file.bin"
    path.write_bytes(b"abc")
    st = path.stat()
    old = {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "md5": "0" * 32}
    path.with_name(".file.bin.md5.json").write_text(json.dumps(old))
    assert dl.file_md5(path) == hashlib.md5(b"abc").hexdigest()


@pytest.fixture
def shakespeare_copy(tmp_path: Path) -> Path:
    """A data root in tmp holding a copy of the shared Shakespeare archive."""
    source = Path(os.environ.get("HPCFL_DATA", "/work/shared/datasets")) / "shakespeare" / shk.ARCHIVE
    if not source.is_file():
        pytest.skip("the Shakespeare archive is not found: set HPCFL_DATA to the shared datasets directory")
    root = tmp_path / "data"
    (root / "shakespeare").mkdir(parents=True)
    shutil.copyfile(source, root / "shakespeare" / shk.ARCHIVE)
    return root


def test_a_shakespeare_archive_corrupted_in_place_is_refused_and_accepted_once_restored(
    shakespeare_copy: Path, tmp_path: Path
) -> None:
    """The archive corrupted in place, size and mtime kept, passed the md5 check (the sidecar was
    trusted) and parsed into other text; now it is refused in one line, and once restored it is
    accepted and parses to exactly the roles it parsed to before, from a cache keyed by the digest
    computed from it."""
    archive = shakespeare_copy / "shakespeare" / shk.ARCHIVE
    good = archive.read_bytes()
    first = shk.load_roles(shakespeare_copy)
    (cache,) = (tmp_path / "xdg" / "hpcfl" / "shakespeare").glob("*.npz")
    assert cache.name == f"{hashlib.md5(good).hexdigest()}-v{shk.PARSER_VERSION}.npz"
    bad = bytearray(good)
    bad[len(bad) // 2 : len(bad) // 2 + 64] = bytes(64)  # same size
    _rewrite_in_place(archive, bytes(bad))
    with pytest.raises(DataError) as err:
        shk.load_roles(shakespeare_copy)
    line = str(err.value)
    assert (
        "\n" not in line and f"md5 {hashlib.md5(bytes(bad)).hexdigest()}, expected {shk.ARCHIVE_MD5}" in line
    )
    _rewrite_in_place(archive, good)
    again = shk.load_roles(shakespeare_copy)
    assert again.names == first.names and np.array_equal(again.codes, first.codes)
    assert np.array_equal(again.line_lengths, first.line_lengths)
    assert np.array_equal(again.lines_per_role, first.lines_per_role)
