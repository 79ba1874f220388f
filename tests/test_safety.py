"""Run-directory safety (issue 18, items 1-3): a run directory never escapes its parent,
``--overwrite`` deletes only what hpcfl wrote, ``hpcfl status`` never runs code from a run
directory, and nothing hostile reaches an sbatch script."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest

from hpcfl.cli.main import main
from hpcfl.config import load_config
from hpcfl.errors import ConfigError
from hpcfl.launch import SubmitOptions, render_sbatch
from tests.helpers import run_cli, synthetic_config, write_config


def _one_line_error(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("hpcfl: error:") and "Traceback" not in err, err
    return err.strip()


# 1. names and --overwrite


@pytest.mark.parametrize("name", ["..", ".", "a/b", "x\ntouch pwned", ""])
def test_run_name_that_is_not_a_plain_file_name_is_refused(tmp_path, capsys, monkeypatch, name):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    cfg = synthetic_config(tmp_path, name=name)
    for extra in ([], ["--overwrite"]):
        err = _one_line_error(capsys, ["run", str(cfg), *extra])
        assert "config key 'name' must be a plain file name" in err
    assert sorted(os.listdir(work)) == ["notes.txt"] and (work / "notes.txt").read_text() == "mine"


def test_overwrite_refuses_a_directory_hpcfl_did_not_make(tmp_path, capsys):
    proj = tmp_path / "proj"
    (proj / "src").mkdir(parents=True)
    (proj / "src" / "model.py").write_text("code")
    (proj / "notes.txt").write_text("notes")
    cfg = synthetic_config(proj, name="proj")
    (proj / "config.yaml").write_text(cfg.read_text())
    err = _one_line_error(capsys, ["run", str(proj / "config.yaml"), "--run-dir", str(proj), "--overwrite"])
    assert err == (
        f"hpcfl: error: {proj} was not made by hpcfl (no .hpcfl-run marker), so --overwrite will not "
        "delete anything in it; choose another --run-dir or remove it yourself"
    )
    assert (proj / "notes.txt").read_text() == "notes" and (proj / "src" / "model.py").read_text() == "code"


def test_overwrite_deletes_only_what_hpcfl_wrote(tmp_path, capsys):
    cfg = synthetic_config(tmp_path, rounds=1)
    run = tmp_path / "run"
    assert main(["run", str(cfg), "--run-dir", str(run)]) == 0
    (run / "notes.txt").write_text("mine")
    (run / "analysis").mkdir()
    (run / "analysis" / "plot.py").write_text("code")
    assert main(["run", str(cfg), "--run-dir", str(run), "--overwrite", "--set", "rounds=2"]) == 0
    capsys.readouterr()
    assert (run / "notes.txt").read_text() == "mine" and (run / "analysis" / "plot.py").read_text() == "code"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and (run / "DONE").exists()


def test_overwrite_keeps_the_users_own_logger_folders(tmp_path, capsys):
    """Issue 44: --overwrite deleted RUN/wandb, mlflow and tensorboard although the run never used
    a logger; only folders hpcfl's records say it made (its marker, loggers.json) are deleted."""
    cfg = synthetic_config(tmp_path, rounds=1)
    run = tmp_path / "run"
    assert main(["run", str(cfg), "--run-dir", str(run)]) == 0
    for name in ("wandb", "mlflow", "tensorboard"):
        (run / name).mkdir()
        (run / name / "mine.txt").write_text(name)
    assert main(["run", str(cfg), "--run-dir", str(run), "--overwrite"]) == 0
    capsys.readouterr()
    for name in ("wandb", "mlflow", "tensorboard"):
        assert (run / name / "mine.txt").read_text() == name
    assert (run / "DONE").exists()


def test_a_fresh_tensorboard_log_never_deletes_a_users_folder(tmp_path, capsys):
    """Issue 44: a fresh run with loggers: [tensorboard] deleted an existing RUN/tensorboard; now one
    line and the folder kept. A folder hpcfl made itself is still replaced by --overwrite."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    cfg = synthetic_config(tmp_path, rounds=1, loggers=["tensorboard"])
    run = tmp_path / "run"
    (run / "tensorboard").mkdir(parents=True)
    (run / "tensorboard" / "mine.txt").write_text("mine")
    err = _one_line_error(capsys, ["run", str(cfg), "--run-dir", str(run)])
    assert "tensorboard exists and hpcfl did not make it" in err
    assert (run / "tensorboard" / "mine.txt").read_text() == "mine"
    assert sorted(p.name for p in run.iterdir()) == [".lock", "tensorboard"]  # refused before any run file
    other = tmp_path / "other"
    assert main(["run", str(cfg), "--run-dir", str(other)]) == 0
    first = sorted(p.name for p in (other / "tensorboard").glob("events.out.tfevents.*"))
    assert main(["run", str(cfg), "--run-dir", str(other), "--overwrite"]) == 0
    capsys.readouterr()
    second = sorted(p.name for p in (other / "tensorboard").glob("events.out.tfevents.*"))
    assert len(first) == len(second) == 1 and first != second  # the old events went with the run


def test_a_planted_checkpoint_tmp_link_never_takes_a_write_outside_the_run(tmp_path, capsys):
    """Issue 44: a symlink planted as ``checkpoints/.round_N.tmp`` made a resume write the checkpoint
    outside the run directory (and leave ``round_N`` a link to it)."""
    cfg = synthetic_config(tmp_path, rounds=2, algorithm="fedavg")
    run = tmp_path / "run"
    assert main(["run", str(cfg), "--run-dir", str(run), "--set", "rounds=1"]) == 0
    outside = tmp_path / "outside"
    outside.mkdir()
    (run / "checkpoints" / ".round_000002.tmp").symlink_to(outside, target_is_directory=True)
    assert main(["run", str(cfg), "--run-dir", str(run), "--resume"]) == 0
    capsys.readouterr()
    final = run / "checkpoints" / "round_000002"
    assert list(outside.iterdir()) == []
    assert final.is_dir() and not final.is_symlink() and (final / "server.pt").is_file()


# 2. hpcfl status never unpickles


class _Exploit:
    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def test_tct_stage2_never_imports_what_a_run_directory_names_unless_asked(tmp_path, capsys, monkeypatch):
    """Issue 44: ``hpcfl tct-stage2 RUN`` imported the modules of RUN/config.yaml's ``imports:`` with
    the current directory on the path, so code planted in a run directory ran when the command was
    started inside it. Now nothing is imported without --imports, and with it never from the
    current directory (``python -m`` puts it first on the path: simulated here)."""
    import yaml

    from tests.helpers import tiny_tct_config

    run = tmp_path / "run"
    assert main(["run", str(tiny_tct_config(tmp_path)), "--run-dir", str(run)]) == 0
    saved = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**saved, "imports": ["planted_issue44"]}))
    pwned = tmp_path / "pwned"
    (run / "planted_issue44.py").write_text(f"open({str(pwned)!r}, 'w').close()\n")
    monkeypatch.chdir(run)
    monkeypatch.syspath_prepend(str(run))
    capsys.readouterr()
    assert main(["tct-stage2", "."]) == 0
    assert not pwned.exists()
    err = _one_line_error(capsys, ["tct-stage2", ".", "--imports"])
    assert "module 'planted_issue44' failed to import" in err and not pwned.exists()


def test_status_never_unpickles_a_crafted_result(tmp_path):
    run = tmp_path / "run"
    slurm = run / "slurm"
    slurm.mkdir(parents=True)
    write_config(run / "config.yaml", name="x", rounds=3)
    job_id = "2147480000"  # no such process: the local job has ended
    record = dict(
        job_id=job_id,
        executor="local",
        folder=str(slurm),
        submitted="2026-01-01T00:00:00+00:00",
        ranks=1,
        nodes=1,
        partition=None,
        command="hpcfl submit",
    )
    (slurm / "jobs.jsonl").write_text(json.dumps(record) + "\n")
    pwned = tmp_path / "pwned"
    (slurm / f"{job_id}_0_result.pkl").write_bytes(pickle.dumps(("error", _Exploit(pwned))))
    proc = run_cli("status", str(run))
    assert not pwned.exists(), "hpcfl status ran code from the run directory"
    assert "error" not in proc.stdout.split("state")[1]
    # the job's own JSON record of its error is what status shows
    (slurm / f"{job_id}_0_error.json").write_text(json.dumps({"error": "DataError: no MNIST on the node"}))
    proc = run_cli("status", str(run))
    assert "error    DataError: no MNIST on the node" in proc.stdout.splitlines()
    assert not pwned.exists()


# 3. nothing hostile in an sbatch script


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["-p", "gpu\ntouch PWNED"], "--partition 'gpu\\ntouch PWNED' has characters"),
        (["-A", "proj;touch PWNED"], "--account 'proj;touch PWNED' has characters"),
        (["-J", "a b"], "the job name 'a b' has characters"),
        (["--sbatch", "reservation=x\ntouch PWNED"], "--sbatch reservation"),
        (["--set", 'name="x\\ntouch PWNED"'], "config key 'name' must be a plain file name"),
        (["--run-dir", "runs/$(touch PWNED)"], "the run directory"),
    ],
)
def test_hostile_values_never_reach_the_sbatch_script(tmp_path, capsys, monkeypatch, extra, fragment):
    monkeypatch.chdir(tmp_path)
    cfg = synthetic_config(tmp_path)
    argv = ["submit", str(cfg), *extra, "--dry-run"]
    if "--run-dir" not in extra:
        argv += ["--run-dir", str(tmp_path / "run")]
    err = _one_line_error(capsys, argv)
    assert fragment in err, err
    assert not list(tmp_path.rglob("PWNED"))


def test_render_sbatch_refuses_a_newline_in_any_value(tmp_path):
    folder = Path("/shared/runs/demo/slurm")
    for options in (
        SubmitOptions(partition="cpu\nrm -rf ~"),
        SubmitOptions(qos="normal\nrm -rf ~"),
        SubmitOptions(constraint="a100&ib\nrm -rf ~"),
    ):
        with pytest.raises(ConfigError, match="cannot carry safely"):
            render_sbatch(options, folder, "hpcfl-demo")
    with pytest.raises(ConfigError, match="cannot carry safely"):
        render_sbatch(SubmitOptions(), folder, "hpcfl-x\nrm -rf ~")
    with pytest.raises(ConfigError, match="cannot carry safely"):
        render_sbatch(SubmitOptions(), Path("/shared/my runs/slurm"), "hpcfl-demo")
    text = render_sbatch(SubmitOptions(constraint="a100&ib", partition="gpu"), folder, "hpcfl-demo")
    assert "#SBATCH --constraint='a100&ib'\n" in text and "#SBATCH --partition=gpu\n" in text
    assert load_config(synthetic_config(tmp_path)).name == "synth"
