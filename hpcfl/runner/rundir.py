"""The run directory: what is in it, and whether this invocation may use it.

``runs/<name>/.hpcfl-run config.yaml metrics.jsonl partition.json partition.png determinism.json checkpoints/ DONE``
(TCT adds ``stage1_model.pt``, ``features*.zarr`` and ``stage2/``). A finished run (DONE) or an
unfinished one is never silently reused: ``--resume`` continues it, ``--overwrite`` starts over.

``--overwrite`` deletes only a directory that hpcfl recognisably made (its ``.hpcfl-run`` marker;
a ``config.yaml`` alone is no proof, users keep configs beside their code) and only the entries hpcfl
writes there (:data:`RUN_ENTRIES`): a user's other files in it survive. The loggers' folders
(:data:`LOGGER_DIRS`) are deleted only where hpcfl's own records say it made them: the
:data:`LOGGER_MARKER` it leaves in a folder it creates, or ``loggers.json`` naming that logger (runs
made before the marker); a user's own ``wandb/``, ``mlflow/`` or ``tensorboard/`` folder stays.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from hpcfl.errors import RunDirError
from hpcfl.files import atomic_write, read_yaml

if TYPE_CHECKING:  # the config imports every algorithm (torch); the markers here are read by `status`
    from hpcfl.config import Config

DONE = "DONE"  # "rounds=N seconds=S" (+ " stopped=BUDGET_STOP" when the privacy budget ended the run)
BUDGET_STOP = "privacy_budget"
SWEEP_MANIFEST = "sweep.json"  # a sweep directory's manifest (hpcfl.sweep.plan)
SWEEP_RUNS = "runs"  # the points' run directories: SWEEP_DIR/runs/<point name>
FAILED = "FAILED"  # a sweep point's one-line error (hpcfl.sweep.local); never beside DONE
# the line of a run that ended because a peer was lost (hpcfl.comm's deadline); a batch script
# requeues on it whatever exit status the launcher reports (srun's is the signal it killed with),
# and the next start of the run removes it
PEER_LOST = "PEER_LOST"
MARKER = ".hpcfl-run"  # written when hpcfl starts a run in a directory
#: Everything hpcfl writes at the top of a run directory (``slurm/`` holds job history and stays),
#: besides the client-state stores ``client_states_<stage>.zarr``.
RUN_ENTRIES = (
    MARKER,
    "config.yaml",
    "metrics.jsonl",
    "partition.json",
    "partition.png",
    "checkpoints",
    DONE,
    "stage1_model.pt",
    "features.zarr",
    "features_test.zarr",
    "features_heldout.zarr",  # TCT stage 2 with client_eval: the held-out shares' features
    "stage2",
    FAILED,
    PEER_LOST,
    "WALL_SECONDS",
    "determinism.json",  # the threads per rank etc. the run used (hpcfl.runner.determinism)
    "client_metrics.jsonl",  # per-client evaluation (client_eval), one line per evaluated round
    "loggers.json",  # the loggers' runs and last rounds written (hpcfl.runner.loggers)
    "dropout_trace.csv",  # the system.dropout.trace the run started with (keep_trace)
    "clock_trace.csv",  # the system.clock.trace the run started with (keep_trace)
)
TRACE_COPY = "dropout_trace.csv"
CLOCK_TRACE_COPY = "clock_trace.csv"
LOGGER_DIRS = ("tensorboard", "mlflow", "wandb")  # hpcfl.runner.loggers' folders, where it made them
LOGGER_MARKER = ".hpcfl-logger"  # left by hpcfl in a logger folder it creates
_RUN_SIGNS = ("config.yaml", "checkpoints", DONE)


def failure(run_dir: Path) -> str | None:
    """The recorded error of a failed point, or None."""
    path = Path(run_dir) / FAILED
    try:
        return path.read_text().strip() or "failed without a message"
    except OSError:
        return None


def holds_run(run_dir: Path) -> bool:
    """True when ``run_dir`` holds (part of) a run: a config, checkpoints or DONE.

    The marker alone does not count: a run killed before writing its config left nothing to resume.
    """
    return run_dir.is_dir() and any((run_dir / n).exists() for n in _RUN_SIGNS)


def logger_dir_is_ours(folder: Path, run_dir: Path, logger: str) -> bool:
    """Whether hpcfl's records say it made ``folder`` for ``logger``: its marker is in it, or the
    run's ``loggers.json`` (written only by hpcfl) names that logger."""
    if (folder / LOGGER_MARKER).is_file():
        return True
    try:
        record = json.loads((run_dir / "loggers.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and logger in record


def claim_logger_dir(folder: Path) -> None:
    """Create ``folder`` for a logger and mark it as hpcfl's; a folder that exists is left unmarked."""
    if not folder.exists():
        folder.mkdir(parents=True)
        (folder / LOGGER_MARKER).write_text("made by hpcfl's logger: --overwrite deletes this folder\n")


def remove_run(run_dir: Path) -> None:
    """Delete what hpcfl wrote in ``run_dir`` (``--overwrite``), refusing a directory it did not make."""
    if not (run_dir / MARKER).is_file():
        raise RunDirError(
            f"{run_dir} was not made by hpcfl (no {MARKER} marker), so --overwrite will not delete "
            "anything in it; choose another --run-dir or remove it yourself"
        )
    ours = [name for name in LOGGER_DIRS if logger_dir_is_ours(run_dir / name, run_dir, name)]
    for name in (*ours, *RUN_ENTRIES, *(p.name for p in run_dir.glob("client_states_*.zarr"))):
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        for tmp in run_dir.glob(f".{name}.*.tmp"):  # an atomic write cut short
            tmp.unlink(missing_ok=True)


def prepare_run_dir(run_dir: Path, cfg: Config, *, resume: bool, overwrite: bool) -> bool:
    """Check and prepare ``run_dir`` (rank 0 only); returns True when a resume should load state."""
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite contradict each other; pass only one")
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run directory {run_dir} is a file; choose another --run-dir")
    has_run = holds_run(run_dir)
    if overwrite and has_run:
        remove_run(run_dir)
        has_run = False
    if has_run and not resume:
        state = "a finished run" if (run_dir / DONE).exists() else "an unfinished run"
        raise RunDirError(
            f"run directory {run_dir} already holds {state}; pass --resume to continue it, "
            "--overwrite to start over, or choose another --run-dir"
        )
    if has_run:
        check_resumable(run_dir, cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not has_run and not (run_dir / MARKER).exists():
        (run_dir / MARKER).write_text("hpcfl run directory: --overwrite deletes only what hpcfl wrote here\n")
    if cfg.system.dropout.trace is not None:
        keep_trace(run_dir, Path(cfg.system.dropout.trace), resumed=has_run)
    if cfg.system.clock.trace is not None:
        keep_trace(run_dir, Path(cfg.system.clock.trace), resumed=has_run, key="system.clock.trace")
    return has_run


def keep_trace(run_dir: Path, trace: Path, *, resumed: bool, key: str = "system.dropout.trace") -> None:
    """Keep a copy of the trace ``key`` the run started with (:data:`TRACE_COPY` for the dropout
    trace, :data:`CLOCK_TRACE_COPY` for the clock's), and refuse a resume whose trace differs from
    it: the trace is read again on every start, and an edit between a kill and ``--resume`` would
    silently change the resumed rounds (or their simulated time). A run directory made before the
    copy was kept takes one now."""
    copy = run_dir / (CLOCK_TRACE_COPY if key == "system.clock.trace" else TRACE_COPY)
    try:
        data = trace.read_bytes()
    except OSError as err:
        raise RunDirError(f"{key} {str(trace)!r} cannot be read ({err.strerror}); fix the path") from None
    if resumed and copy.is_file():
        if copy.read_bytes() != data:
            raise RunDirError(
                f"cannot resume {run_dir}: {key} {str(trace)!r} changed since the run started "
                f"(the run's copy is {copy}); restore it (cp {copy} {trace}) or start over with --overwrite"
            )
        return
    atomic_write(copy, lambda f: f.write(data))


def check_resumable(run_dir: Path, cfg: Config) -> None:
    """Refuse a resume that cannot be checked: no saved config, or a config that differs."""
    saved = run_dir / "config.yaml"
    if not saved.exists():
        raise RunDirError(
            f"cannot resume {run_dir}: its config.yaml is missing, so the config cannot be checked "
            "against the checkpoints; restore it or start over with --overwrite"
        )
    from hpcfl.config import config_differences

    saved_cfg = read_yaml(saved)
    diffs = config_differences(saved_cfg, cfg.to_dict())
    if diffs:
        raise RunDirError(
            f"cannot resume {run_dir}: its checkpoint was made with a different config "
            f"(differs in: {', '.join(diffs)}); use the same config or --overwrite"
        )
    # another threads, reduction, client_batch or device: noted by hpcfl.runner.determinism
