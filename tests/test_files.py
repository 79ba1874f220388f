"""The atomic file helpers every part of hpcfl writes through (hpcfl.files)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from hpcfl.files import atomic_write, save_figure, write_csv  # noqa: E402


def test_save_figure_writes_png_and_svg_and_closes_the_figure(tmp_path: Path) -> None:
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    png = save_figure(fig, tmp_path / "sub" / "curve.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert not plt.fignum_exists(fig.number)
    fig2, _ = plt.subplots()
    assert save_figure(fig2, tmp_path / "curve.svg").read_text().lstrip().startswith("<?xml")
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["curve.png", "curve.svg"]


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "data.bin"
    target.write_bytes(b"old")

    def broken(fh) -> None:
        fh.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, broken)
    assert target.read_bytes() == b"old" and list(tmp_path.iterdir()) == [target]


def test_write_csv_writes_the_header_the_rows_and_the_given_order(tmp_path: Path) -> None:
    """The benchmarks' one CSV writer: first row's keys by default, or the given fields and
    DictWriter options; what csv.DictWriter would write, under the final name only when whole."""
    import csv

    rows = [{"b": 1, "a": 2.5, "note": "x,y"}, {"b": 3, "a": 4.0, "note": ""}]
    write_csv(tmp_path / "t.csv", rows)
    assert list(csv.DictReader((tmp_path / "t.csv").open())) == [
        {"b": "1", "a": "2.5", "note": "x,y"},
        {"b": "3", "a": "4.0", "note": ""},
    ]
    write_csv(tmp_path / "u.csv", rows, ["a", "extra"], extrasaction="ignore", restval="-")
    assert (tmp_path / "u.csv").read_bytes() == b"a,extra\r\n2.5,-\r\n4.0,-\r\n"  # csv line ends
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.csv", "u.csv"]
