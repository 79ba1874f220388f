"""submitit beyond its public API is read in one module (hpcfl/launch/submitit_internals.py), under a
pinned range (pyproject.toml); these tests fail when an installed submitit no longer has a name,
signature or attribute that module relies on (issue 43 item 4). The behaviour is covered end to end
by tests/test_submit.py (the sbatch golden file, the local preemption and requeue)."""

from __future__ import annotations

import inspect
import signal
import tomllib
from pathlib import Path

import pytest

submitit = pytest.importorskip("submitit")

from packaging.requirements import Requirement  # noqa: E402

from hpcfl.launch import submitit_internals as internals  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _pins() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    listed = [*project["optional-dependencies"]["slurm"], *project["optional-dependencies"]["dev"]]
    return [r for r in map(Requirement, listed) if r.name == "submitit"]


def test_submitit_is_pinned_to_a_bounded_range_that_the_installed_one_satisfies() -> None:
    pins = _pins()
    assert pins and all({s.operator for s in r.specifier} >= {">=", "<"} for r in pins), pins
    assert all(r.specifier.contains(submitit.__version__) for r in pins), (submitit.__version__, pins)


def _params(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def test_every_submitit_internal_used_has_the_signature_relied_on() -> None:
    uses = internals._uses()
    assert _params(uses["SignalHandler.__init__"]) == ["self", "env", "job_paths", "delayed"]
    assert _params(uses["SignalHandler.checkpoint_and_try_requeue"])[:2] == ["self", "signum"]
    assert _params(uses["SlurmExecutor._make_submission_file_text"]) == ["self", "command", "uid"]
    assert isinstance(uses["SlurmExecutor._submitit_command_str"], property)
    assert _params(uses["JobPaths.__init__"])[:4] == ["self", "folder", "job_id", "task_id"]
    assert _params(uses["JobEnvironment._usr_sig"]) == []  # a classmethod, called bare
    assert isinstance(inspect.getattr_static(submitit.SlurmExecutor, "affinity"), classmethod)
    assert issubclass(internals.FailedJobError, Exception)


def test_the_signal_handler_still_times_the_job_from_start_time() -> None:
    """checkpoint_and_requeue sets ``_start_time`` so submitit tells a time limit from a preemption;
    the handler must still set it on construction and read it in ``has_timed_out``."""
    handler = internals.SignalHandler(None, None, None)  # type: ignore[arg-type]
    assert isinstance(handler._start_time, float)
    assert "self._start_time" in inspect.getsource(internals.SignalHandler.has_timed_out)


def test_the_wrappers_answer_as_submitit_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SUBMITIT_PREEMPT_SIGNAL", raising=False)
    assert internals.preemption_signal() == signal.SIGUSR2  # submitit's default
    assert internals.job_stderr(tmp_path, "123") == tmp_path / "123_0_log.err"
    executor = internals.RenderOnlySlurmExecutor(tmp_path)  # where srun is missing
    executor.update_parameters(time=5, ntasks_per_node=2)
    text = internals.sbatch_text(executor)
    assert text.startswith("#!/bin/bash") and "#SBATCH --ntasks-per-node=2" in text
    assert "-m submitit.core._submit" in text
