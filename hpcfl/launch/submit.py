"""``hpcfl submit``: validate a run on the login node, then hand it to SLURM through submitit.

Everything a user can get wrong is checked before anything is queued (config, ranks vs clients,
a run directory holding another config) and a rejected submission comes back as sbatch's own
reason in one line, so a job is never queued only to fail on its first second. Each submission is
recorded in ``RUN_DIR/slurm/jobs.jsonl`` (submitit's logs and pickles sit beside it) so that
``hpcfl status RUN_DIR`` needs nothing but the run directory.

The job itself is :class:`hpcfl.launch.job.HpcflJob`: one MPI rank per task, launched by submitit's
``srun`` with ``--mpi=<mpi>`` (pmi2 for the MPICH wheel, pmix for Open MPI), ``--requeue`` and the
preemption signal ``signal_delay_s`` before the time limit.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import io
import math
import os
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpcfl.config import Config, config_differences, read_yaml
from hpcfl.errors import CommError, ConfigError, RunDirError
from hpcfl.files import append_jsonl
from hpcfl.launch.records import JOBS_FILE, SLURM_DIR, JobRecord, missing_slurm_extra

try:
    import submitit

    from hpcfl.launch.submitit_internals import FailedJobError, RenderOnlySlurmExecutor, sbatch_text
except ImportError as err:
    raise missing_slurm_extra("hpcfl submit") from err

from hpcfl.launch.job import HpcflJob

EXECUTORS = ("slurm", "local")
PMI_CHOICES = ("pmi2", "pmix", "pmi1", "none", "default")


@dataclass(frozen=True)
class SubmitOptions:
    """What to ask SLURM for. Field names follow sbatch's options; ``None`` leaves the cluster's
    default. ``mpi`` is srun's ``--mpi`` (``default``: the site's MpiDefault); ``sbatch`` holds any
    other sbatch option (``{"reservation": "x"}``); ``executor="local"`` runs the job in a local
    process through submitit's LocalExecutor (one rank; for trying a config and for tests).
    ``max_requeues`` bounds the reruns after reaching the time limit (submitit's
    ``max_num_timeout``; preemptions do not count), so a run may span that many ``time_min``."""

    partition: str | None = None
    nodes: int = 1
    ntasks_per_node: int = 1
    cpus_per_task: int | None = None
    gpus_per_task: int | None = None
    time_min: int = 60
    mem_gb: float | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    mpi: str = "pmi2"
    signal_delay_s: int = 120
    job_name: str | None = None
    sbatch: dict[str, str] = field(default_factory=dict)
    executor: str = "slurm"
    max_requeues: int = 20

    @property
    def ranks(self) -> int:
        """Total MPI ranks (tasks) of the job."""
        return self.nodes * self.ntasks_per_node


def check_options(options: SubmitOptions, cfg: Config) -> None:
    """Refuse, before queueing, what could only fail later (one line each, naming the fix)."""
    if options.executor not in EXECUTORS:
        raise ConfigError(f"unknown executor {options.executor!r}; choose one of: {', '.join(EXECUTORS)}")
    if options.mpi not in PMI_CHOICES:
        raise ConfigError(f"unknown --mpi {options.mpi!r}; choose one of: {', '.join(PMI_CHOICES)}")
    if options.max_requeues < 0:
        raise ConfigError(f"--max-requeues must be 0 or more, got {options.max_requeues}")
    for name in ("nodes", "ntasks_per_node", "time_min", "signal_delay_s"):
        if getattr(options, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(options, name)}")
    if options.time_min * 60 <= options.signal_delay_s:
        raise ConfigError(
            f"--time {options.time_min} min leaves no time before the stop signal "
            f"({options.signal_delay_s} s before the limit); raise --time or lower --signal-delay"
        )
    if options.ranks > cfg.num_clients:
        raise CommError(
            f"{options.ranks} ranks for {cfg.num_clients} clients: every rank needs at least one client; "
            f"use at most {cfg.num_clients} tasks (--nodes x --ntasks-per-node)"
        )
    if options.executor == "local" and options.ranks != 1:
        raise CommError(
            "the local executor runs one rank; drop --nodes/--ntasks-per-node or use --executor slurm"
        )
    if options.gpus_per_task and cfg.device != "cuda":
        raise ConfigError(
            "--gpus-per-task asks for GPUs but the config has device: cpu; add --set device=cuda"
        )


def check_run_dir(run_dir: Path, cfg: Config) -> None:
    """A run directory holding a run of another config cannot be continued (the job always resumes),
    and one that a queued or running job (or a live ``hpcfl run``) owns cannot take another."""
    from hpcfl.launch.status import active_job
    from hpcfl.runner.lock import lock_holder

    holder = lock_holder(run_dir)
    if holder is not None:
        raise RunDirError(
            f"run directory {run_dir} is in use by another hpcfl run (host {holder[0]}, PID {holder[1]}); "
            "wait for it to end, stop it, or choose another --run-dir"
        )
    owner = active_job(run_dir)
    if owner is not None:
        raise RunDirError(
            f"run directory {run_dir} belongs to job {owner[0]}, which is {owner[1]}; wait for it "
            f"(hpcfl status {run_dir}), cancel it, or choose another --run-dir"
        )
    saved = run_dir / "config.yaml"
    if saved.exists():
        diffs = config_differences(read_yaml(saved), cfg.to_dict())
        if diffs:
            raise RunDirError(
                f"{run_dir} holds a run of another config (differs in: {', '.join(diffs)}); "
                "choose another --run-dir"
            )


def _slurm_parameters(options: SubmitOptions, name: str) -> dict[str, Any]:
    """``SlurmExecutor.update_parameters`` keywords (sbatch's names, ``_`` for ``-``) for ``options``."""
    params: dict[str, Any] = {
        "job_name": name,
        "time": options.time_min,
        "nodes": options.nodes,
        "ntasks_per_node": options.ntasks_per_node,
        "signal_delay_s": options.signal_delay_s,
        # scontrol requeue must work even on a cluster whose JobRequeue=0
        "additional_parameters": {"requeue": True, **options.sbatch},
    }
    if options.mpi != "default":
        params["srun_args"] = [f"--mpi={options.mpi}"]
    if options.cpus_per_task is not None:
        params["cpus_per_task"] = options.cpus_per_task
        params["setup"] = [f"export OMP_NUM_THREADS={options.cpus_per_task}"]
    if options.mem_gb is not None:
        params["mem"] = f"{math.ceil(options.mem_gb * 1024)}M"
    for key in ("partition", "gpus_per_task", "account", "qos", "constraint"):
        value = getattr(options, key)
        if value is not None:
            params[key] = value
    return params


_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.,:+@%=/-")
_CONSTRAINT = frozenset("&|[]*!()")  # SLURM's constraint syntax; inert on an #SBATCH line


def _check_script_value(what: str, value: str, extra: frozenset[str] = frozenset()) -> None:
    """Refuse a value that could break out of its line or word of the sbatch script.

    submitit writes option values into ``#SBATCH`` lines and the run directory unquoted into the
    ``srun`` command line, so a newline would start a shell command and a space or ``$(...)`` would
    be read by the shell: only a plain character set passes.
    """
    bad = sorted({c for c in str(value) if c not in _SAFE and c not in extra})
    if bad or not str(value):
        shown = ", ".join(repr(c) for c in bad) or "nothing"
        raise ConfigError(
            f"{what} {str(value)!r} has characters an sbatch script cannot carry safely ({shown}); "
            "use letters, digits and _.,:+@%=/-"
        )


def check_script_values(options: SubmitOptions, folder: Path, name: str) -> None:
    """Every value that reaches the generated sbatch script, checked (see :func:`_check_script_value`)."""
    _check_script_value("the run directory", str(folder))
    _check_script_value("the job name", name)
    for key in ("partition", "account", "qos"):
        value = getattr(options, key)
        if value is not None:
            _check_script_value(f"--{key}", value)
    if options.constraint is not None:
        _check_script_value("--constraint", options.constraint, _CONSTRAINT)
    for key, value in options.sbatch.items():
        _check_script_value("an --sbatch option name", key)
        _check_script_value(f"--sbatch {key}", value, _CONSTRAINT)


def make_executor(options: SubmitOptions, folder: Path, name: str, *, render_only: bool = False) -> Any:
    """The submitit executor for ``options``, writing its files under ``folder``."""
    if options.executor != "local":
        check_script_values(options, folder, name)
    if options.executor == "local":
        local = submitit.LocalExecutor(folder=folder, max_num_timeout=options.max_requeues)
        local.update_parameters(timeout_min=options.time_min, tasks_per_node=1)
        return local
    if render_only:
        executor: submitit.SlurmExecutor = RenderOnlySlurmExecutor(
            folder, max_num_timeout=options.max_requeues
        )
    else:
        try:
            executor = submitit.SlurmExecutor(folder, max_num_timeout=options.max_requeues)
        except RuntimeError as err:  # submitit: 'Could not detect "srun"'
            raise ConfigError(
                "no SLURM here (srun not found); submit from a cluster's login node, "
                "or try the run locally with --executor local"
            ) from err
    executor.update_parameters(**_slurm_parameters(options, name))
    return executor


def render_sbatch(options: SubmitOptions, folder: Path, name: str) -> str:
    """The sbatch script ``hpcfl submit`` would queue (``--dry-run``; golden-file tested)."""
    executor = make_executor(options, folder, name, render_only=True)
    return sbatch_text(executor)


def _sbatch_reason(stderr: str) -> str:
    """sbatch's error lines as one line, with a pointer for the common partition mistake."""
    lines: list[str] = []
    for line in stderr.splitlines():
        line = line.strip().removeprefix("sbatch: error: ").strip()
        if line and line not in lines:
            lines.append(line)
    reason = "; ".join(lines) or "sbatch gave no reason"
    if "partition" in reason.lower():
        reason += " (sinfo -s lists the partitions)"
    return reason


def submit_run(
    cfg: Config,
    run_dir: Path,
    options: SubmitOptions,
) -> tuple[Any, JobRecord]:
    """Queue the run; returns the submitit job and the record written to ``jobs.jsonl``.

    ``run_dir`` is made absolute (the job may start in another directory). A submission that
    sbatch rejects raises :class:`ConfigError` carrying sbatch's reason.
    """
    check_options(options, cfg)
    run_dir = run_dir.resolve()
    check_run_dir(run_dir, cfg)
    folder = run_dir / SLURM_DIR
    folder.mkdir(parents=True, exist_ok=True)
    name = options.job_name or f"hpcfl-{cfg.name}"
    executor = make_executor(options, folder, name)
    config = cfg.to_dict()
    if config.get("data_root"):
        config["data_root"] = str(Path(config["data_root"]).expanduser().resolve())
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit echoes sbatch's stderr; we say it once
            job = executor.submit(HpcflJob(config=config, run_dir=str(run_dir)))
    except FailedJobError as err:
        raise ConfigError(f"sbatch rejected the job: {_sbatch_reason(str(err))}") from err
    record = JobRecord(
        job_id=str(job.job_id),
        executor=options.executor,
        folder=str(folder),
        submitted=_dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        ranks=options.ranks,
        nodes=options.nodes,
        partition=options.partition,
        command=shlex.join([os.path.basename(sys.argv[0]) or "hpcfl", *sys.argv[1:]]),
    )
    append_jsonl(folder / JOBS_FILE, asdict(record))
    return job, record
