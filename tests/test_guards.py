"""Guards before and during work (issue 18, items 5 and 6): feature stores larger than the free
disk are refused before a row is written, OS errors while writing end in one line, and SIGTERM
during the eNTK extraction is honoured within seconds."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from collections import namedtuple

from hpcfl.cli.main import main
from hpcfl.features.store import verify_client
from tests.helpers import REPO, hpcfl_cmd, synthetic_config, tiny_tct_config

_tct = tiny_tct_config


def test_oversized_feature_store_is_refused_before_any_row_is_written(tmp_path, capsys, monkeypatch):
    import shutil

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - 10**6, 10**6))  # 1 MB free
    run = tmp_path / "run"
    code = main(["run", str(_tct(tmp_path, p=10**9)), "--run-dir", str(run)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[0].startswith("hpcfl: note: stage2.p=1000000000 exceeds the ") and "using p=" in lines[0]
    assert lines[-1].startswith("hpcfl: error: the eNTK features need ")
    # issue 44: sizes under 0.05 GB read "0.0 GB"
    assert f"but {run} has 1 MB free; lower stage2.p, store stage2.dtype=float16 or bfloat16" in lines[-1]
    assert sorted(p.name for p in run.iterdir()) == [".hpcfl-run", ".lock"]  # nothing of the run yet


def test_os_error_while_writing_gives_one_line(tmp_path, capsys, monkeypatch):
    # tests run as root, so a read-only directory cannot be made with chmod: the rename that every
    # atomic write ends with fails as it does on a read-only file system
    real_replace = os.replace

    def read_only(src, dst, *args, **kwargs):
        if str(dst).startswith(str(tmp_path / "run")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dst))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", read_only)
    code = main(["run", str(synthetic_config(tmp_path, rounds=1)), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"hpcfl: error: cannot write {tmp_path / 'run' / 'config.yaml'}: Read-only file system"
    )


def test_sigterm_during_extraction_exits_75_at_the_next_client_and_resume_keeps_clients(tmp_path):
    cfg = _tct(tmp_path, p=2000)
    cfg.write_text(cfg.read_text().replace("n_train: 2000", "n_train: 12000"))
    run = tmp_path / "run"
    store = run / "features.zarr"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        hpcfl_cmd("run", str(cfg), "--run-dir", str(run)), env=env, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 240
    while not verify_client(store, 0) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1]
    proc.send_signal(signal.SIGTERM)
    at_signal = sum(verify_client(store, k) for k in range(5))  # counted after the signal: no race
    _, err = proc.communicate(timeout=600)  # a hang guard only: the condition below is the test
    assert proc.returncode == 75, err
    assert "during the feature extraction" in err and f"--run-dir {run} --resume" in err
    finished = [k for k in range(5) if verify_client(store, k)]
    # it stopped at the next poll inside the extraction: at most the client in progress was finished,
    # never the extraction run to its end (what "within seconds" meant, without a clock)
    assert 0 in finished and len(finished) <= at_signal + 1 and len(finished) < 5, (finished, at_signal)
    stamps = {k: (store / f"client_{k}" / "zarr.json").stat().st_mtime_ns for k in finished}
    resumed = subprocess.run(
        hpcfl_cmd("run", str(cfg), "--run-dir", str(run), "--resume"), env=env, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr
    assert {k: (store / f"client_{k}" / "zarr.json").stat().st_mtime_ns for k in finished} == stamps
    assert (run / "DONE").exists()
