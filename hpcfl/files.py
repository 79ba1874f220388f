"""Files a run produces, written atomically: a reader never sees a half-written file under its final name.

The one place for temp-file-then-rename writes (text, ``torch.save``, figures, streamed downloads)
and for JSON-lines files; everything else in hpcfl writes through these helpers.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import pickle
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO


def _umask() -> int:
    """The process umask (read without changing it where /proc allows)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _atomic(path: Path, write: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; group members read each other's runs
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def user_cache_dir(name: str) -> Path:
    """``$XDG_CACHE_HOME/hpcfl/<name>`` (else ``~/.cache/hpcfl/<name>``): what hpcfl can rebuild
    (parsed datasets, checksums, compiled kernels). Not created here."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hpcfl" / name


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Call ``write(fh)`` on a temp file beside ``path``, then rename it to ``path``.

    If ``write`` raises, the temp file is removed and ``path`` is left as it was.
    """
    _atomic(path, write)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file and a rename."""
    _atomic(path, lambda fh: fh.write(text.encode()))


def host_copy(obj: Any) -> Any:
    """``obj`` with every tensor in it (through dicts, lists and tuples) as a host tensor.

    What a saved file holds must not name a device: ``torch.save`` records each storage's device
    (``cuda:0``) and a plain ``torch.load`` puts it back there, so a GPU rank's file would load onto
    another rank's GPU, or fail on a CPU node. Host tensors are returned as they are (a CPU run's
    files are unchanged, byte for byte); each device storage is copied once, and tensors that were
    views of one storage stay views of its copy, as ``torch.save`` would have kept them.
    """
    import torch

    copies: dict[tuple[str, int], Any] = {}  # (device, data_ptr) -> host storage

    def host(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key not in copies:
            copies[key] = storage.cpu()
        view = torch.empty((0,), dtype=t.dtype)  # host: deliberately, the file's copy
        return view.set_(copies[key], t.storage_offset(), t.size(), t.stride())

    def walk(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return host(o)
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items()}
        if isinstance(o, list):
            return [walk(v) for v in o]
        if isinstance(o, tuple):
            return tuple(walk(v) for v in o)
        return o

    return walk(obj)


def write_csv(
    path: Path, rows: Sequence[Mapping[str, Any]], fieldnames: Sequence[str] | None = None, **options: Any
) -> None:
    """``rows`` as a CSV table with a header, written atomically: ``fieldnames`` (default: the first
    row's keys) in that order; ``options`` go to :class:`csv.DictWriter` (``extrasaction``, ``restval``)."""
    text = io.StringIO()
    writer = csv.DictWriter(
        text, fieldnames=list(fieldnames if fieldnames is not None else rows[0]), **options
    )
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, text.getvalue())


def atomic_torch_save(path: Path, obj: Any) -> None:
    """``torch.save`` of :func:`host_copy` ``(obj)`` through a temp file and a rename: the file names
    no device, and :func:`read_torch` puts it on the device of the rank that reads it."""
    import torch  # here, not at the top: the commands that only read files never import torch

    data = host_copy(obj)
    _atomic(path, lambda fh: torch.save(data, fh))


def read_torch(path: Path, *, device: Any) -> Any:
    """``torch.load(path, weights_only=True)`` with every tensor onto ``device`` (the reading rank's).

    ``map_location`` makes any file device-free on reading, including one written from GPU tensors
    before :func:`atomic_torch_save` copied to the host: rank r > 0 gets its own GPU, not ``cuda:0``,
    and a CPU node (``hpcfl tct-stage2`` on a login node, a resume with ``device: cpu``) opens it.
    """
    import torch

    return torch.load(path, map_location=device, weights_only=True)


def load_torch_file(path: Path, fix: str, *, device: Any) -> Any:
    """:func:`read_torch` onto ``device``, a damaged or missing file as one line naming ``fix``."""
    from hpcfl.errors import RunDirError

    try:
        return read_torch(path, device=device)
    except FileNotFoundError:
        raise RunDirError(f"{path} is missing; {fix}") from None
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as err:
        reason = str(err).splitlines()[0] if str(err) else err.__class__.__name__
        raise RunDirError(f"{path} is damaged ({reason}); {fix}") from None


def save_figure(fig: Any, path: Path, *, dpi: int = 120, fmt: str | None = None) -> Path:
    """Save a matplotlib figure atomically and return ``path``.

    ``fmt`` defaults to the file's suffix, and to PNG for a name without one.

    A pyplot figure is closed afterwards so a loop of plots does not keep every figure alive; a
    bare ``Figure`` (no pyplot state) is left to the garbage collector.
    """
    path = Path(path)
    fmt = fmt or path.suffix.lstrip(".").lower() or "png"
    try:
        _atomic(path, lambda fh: fig.savefig(fh, format=fmt, dpi=dpi))
    finally:
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is not None:
            pyplot.close(fig)
    return path


def read_jsonl(
    path: Path, *, check: Callable[[dict[str, Any]], str | None] | None = None
) -> list[dict[str, Any]]:
    """All intact rows of a JSON-lines file.

    A damaged line (torn by a kill mid-append, edited, or not UTF-8 text) is skipped and named on
    stderr; it is never a reason to drop the rows after it. ``check`` says why a parsed row cannot
    be used (None: it can); such a row is skipped and named with the reason.
    """
    if not Path(path).exists():
        return []
    rows = []
    for number, raw in enumerate(Path(path).read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            row = None
        if not isinstance(row, dict):
            print(f"hpcfl: note: {path} line {number} is damaged and was skipped", file=sys.stderr)
            continue
        if check is not None and (problem := check(row)) is not None:
            print(f"hpcfl: note: {path} line {number} was skipped: {problem}", file=sys.stderr)
            continue
        rows.append(row)
    return rows


def _no_nan(value: Any) -> Any:
    """``value`` with every float that is not finite (NaN, ±inf) replaced by None, in nested lists and
    dicts too."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_no_nan(v) for v in value]
    return value


def json_line(row: dict[str, Any]) -> str:
    """One JSON line of ``row`` that is valid JSON (RFC 8259): a value that is not a finite number
    (a client without test data, a fine-tuning that diverged) is written ``null``, never the
    ``NaN``/``Infinity`` literals Python's json writes by default and strict readers refuse
    (issue 61)."""
    try:
        return json.dumps(row, allow_nan=False) + "\n"
    except ValueError:  # a NaN or an infinity somewhere: the rare path
        return json.dumps(_no_nan(row), allow_nan=False) + "\n"


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace a JSON-lines file atomically (valid JSON on every line: :func:`json_line`)."""
    atomic_write_text(path, "".join(json_line(r) for r in rows))


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """Append one row (valid JSON: :func:`json_line`) and flush it to disk."""
    with open(path, "a") as fh:
        fh.write(json_line(row))
        fh.flush()
        os.fsync(fh.fileno())


def append_line(path: Path, line: str) -> None:
    """Append one line with a single ``O_APPEND`` write and flush it to disk: writers on several
    hosts (each side of a lost link) add their lines without overwriting each other's."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line.rstrip("\n") + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, turning every failure into one clear line."""
    import yaml

    from hpcfl.errors import ConfigError

    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} not found") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {str(path)!r}: {err.__class__.__name__}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise ConfigError(f"malformed YAML in {str(path)!r}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys, not {type(data).__name__}")
    return data
