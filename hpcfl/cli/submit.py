"""``hpcfl submit CONFIG.yaml``: queue a run on SLURM (through submitit), one MPI rank per task.

The config and the request are checked here, on the login node, so mistakes cost no queue time;
sbatch's own refusal (an unknown partition, more CPUs than a node has) comes back as one line.
The job resumes from its last round checkpoint after a preemption or its time limit (it requeues
itself), so a long run can be given a short ``--time``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any

from hpcfl.errors import ConfigError

_EPILOG = """\
examples:
  hpcfl submit configs/fmnist_fedavg.yaml --partition cpu --ntasks-per-node 8 --time 2:00:00
  hpcfl submit my.yaml --set rounds=500 device=cuda --nodes 2 --ntasks-per-node 4 --gpus-per-task 1
  hpcfl submit my.yaml --dry-run            # print the sbatch script, queue nothing
  hpcfl submit my.yaml --executor local --wait   # the same job in a local process
then: hpcfl status RUN_DIR

MPI: --mpi pmi2 (default) suits the mpich wheel; use --mpi pmix with Open MPI, --mpi default for
the cluster's MpiDefault (see slurm/README.md).
"""


def _parse_time(text: str) -> int:
    """SLURM's time formats (MIN, MIN:SEC, H:M:S, D-H, D-H:M, D-H:M:S) in whole minutes."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is no SLURM time (MINUTES, H:MM:SS or D-HH:MM:SS)")
    days, a, b, c = match.groups()
    if days is not None:  # D-H[:M[:S]]
        seconds = int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    elif c is not None:  # H:M:S
        seconds = int(a) * 3600 + int(b) * 60 + int(c)
    elif b is not None:  # M:S
        seconds = int(a) * 60 + int(b)
    else:  # M
        seconds = int(a) * 60
    return max(1, -(-seconds // 60))


def _key_value(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` for --sbatch."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (e.g. --sbatch reservation=mine)")
    return key.lstrip("-"), value


def add_resource_options(p: argparse.ArgumentParser) -> None:
    """The SLURM request options (``hpcfl submit`` and ``hpcfl sweep --executor slurm``)."""
    g = p.add_argument_group("resources (sbatch's meaning; unset: the cluster's default)")
    g.add_argument("-p", "--partition")
    g.add_argument("-N", "--nodes", type=int, default=1)
    g.add_argument("--ntasks-per-node", "--ranks-per-node", type=int, default=1, help="MPI ranks per node")
    g.add_argument("-c", "--cpus-per-task", type=int, help="CPUs per rank (also OMP_NUM_THREADS)")
    g.add_argument("--gpus-per-task", type=int, help="GPUs per rank (1: one rank per GPU)")
    g.add_argument(
        "-t", "--time", type=_parse_time, default=60, help="time limit per (re)run (default 60 min)"
    )
    g.add_argument("--mem-gb", type=float, help="memory per node in GB")
    g.add_argument("-A", "--account")
    g.add_argument("-q", "--qos")
    g.add_argument("-C", "--constraint")
    g.add_argument("-J", "--job-name", help="default: hpcfl-<config name>")
    g.add_argument(
        "--sbatch", type=_key_value, action="append", default=[], metavar="KEY=VALUE", help="any other option"
    )
    g.add_argument(
        "--mpi", default="pmi2", help="srun --mpi plugin: pmi2 (default), pmix, pmi1, none, default"
    )
    g.add_argument(
        "--signal-delay", type=int, default=120, help="seconds before the limit the ranks are told to stop"
    )
    p.add_argument(
        "--max-requeues",
        type=int,
        default=20,
        help="reruns after hitting --time (default 20; preemptions are free)",
    )


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``submit`` sub-command."""
    p = sub.add_parser(
        "submit",
        help="queue a run on SLURM (one MPI rank per task; requeues itself on preemption)",
        description=(
            "Queue a run on SLURM through submitit, one MPI rank per task. The config and the request "
            "are checked first; the job requeues itself on preemption or at its time limit and "
            "resumes from its last round checkpoint."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", help="YAML config (omit to use the built-in defaults)")
    p.add_argument(
        "--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE", help="override config keys"
    )
    p.add_argument("--data-root", help="dataset directory, as the compute nodes see it")
    p.add_argument(
        "--run-dir", type=Path, help="output directory on a shared file system (default: runs/<name>)"
    )
    add_resource_options(p)
    p.add_argument(
        "--executor", default="slurm", choices=("slurm", "local"), help="local: run in a local process"
    )
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script and queue nothing")
    p.add_argument("--wait", action="store_true", help="follow the job until it ends (exit 1 if it failed)")
    p.set_defaults(func=run)


def options_from_args(args: argparse.Namespace, executor: str | None = None) -> Any:
    """The :class:`~hpcfl.launch.SubmitOptions` of the parsed resource options."""
    from hpcfl.launch import SubmitOptions

    return SubmitOptions(
        partition=args.partition,
        nodes=args.nodes,
        ntasks_per_node=args.ntasks_per_node,
        cpus_per_task=args.cpus_per_task,
        gpus_per_task=args.gpus_per_task,
        time_min=args.time,
        mem_gb=args.mem_gb,
        account=args.account,
        qos=args.qos,
        constraint=args.constraint,
        mpi=args.mpi,
        signal_delay_s=args.signal_delay,
        job_name=args.job_name,
        sbatch=dict(args.sbatch),
        executor=executor or args.executor,
        max_requeues=args.max_requeues,
    )


def follow(run_dir: Path, job: Any, poll_s: float = 2.0) -> int:
    """Print a line whenever the run's state or round changes, until the job ends; exit code."""
    from hpcfl.launch import format_status, run_status

    last = None
    while True:
        status = run_status(run_dir)
        line = f"{status.state} round {status.rounds_done}/{status.rounds_total or '?'}"
        if line != last:
            print(f"hpcfl: job {status.job_id}: {line}", flush=True)
            last = line
        if status.failed or job.done():  # rank 0's result is written (or the job is gone)
            status = run_status(run_dir)
            print(format_status(status))
            return 0 if status.finished else 1
        time.sleep(poll_s)


def run(args: argparse.Namespace) -> int:
    """Validate, then print the script (``--dry-run``) or queue the job."""
    from hpcfl.config import load_cli_config
    from hpcfl.launch import render_sbatch, submit_run
    from hpcfl.launch.submit import SLURM_DIR, check_options, check_run_dir
    from hpcfl.runner import default_run_dir

    cfg = load_cli_config(args.config, args.set, args.data_root)
    run_dir = (args.run_dir or default_run_dir(cfg)).resolve()
    options = options_from_args(args)
    if args.dry_run:
        check_options(options, cfg)
        check_run_dir(run_dir, cfg)
        if options.executor != "slurm":
            raise ConfigError("--dry-run prints the sbatch script, so it needs --executor slurm")
        print(render_sbatch(options, run_dir / SLURM_DIR, options.job_name or f"hpcfl-{cfg.name}"), end="")
        return 0
    job, record = submit_run(cfg, run_dir, options)
    where = f"{record.ranks} rank{'s' if record.ranks != 1 else ''} on {record.nodes} node"
    where += ("s" if record.nodes != 1 else "") + (
        f", partition {record.partition}" if record.partition else ""
    )
    print(f"hpcfl: submitted job {record.job_id} ({where}) -> {run_dir}", file=sys.stderr)
    if not args.wait:
        print(f"hpcfl: follow it with: hpcfl status {run_dir}", file=sys.stderr)
        print(record.job_id)
        return 0
    return follow(run_dir, job)
