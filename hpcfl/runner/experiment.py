"""One federated run from config to finished run directory, on any number of ranks.

Rank 0 owns the shared files (config, metrics, partition, progress bar); every rank writes the
checkpoints of the clients it owns. Resuming loads the latest checkpoint and replays nothing:
client RNGs depend only on (seed, round, client), so the resumed run ends bit-identical.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpcfl.algorithms import ClientState, ServerState
from hpcfl.algorithms.base import state_from_dict, state_to_dict
from hpcfl.comm import Communicator, get_comm
from hpcfl.config import Config, dump_config
from hpcfl.errors import HpcflError, RunDirError
from hpcfl.runner.checkpoint import load_checkpoint, save_checkpoint
from hpcfl.runner.federation import Federation, build_federation, model_plan
from hpcfl.runner.files import append_jsonl, atomic_write_text, read_jsonl, write_jsonl
from hpcfl.runner.progress import Progress
from hpcfl.runner.rounds import run_rounds
from hpcfl.runner.rundir import DONE, prepare_run_dir


@dataclass
class RunResult:
    """Final state of a run as seen by this rank."""

    run_dir: Path
    rounds_done: int
    server: ServerState
    metrics: list[dict[str, Any]]
    finished: bool


class StopRequest:
    """Set by SIGUSR1/SIGTERM (SLURM preemption, time limit): stop after the round in flight and
    checkpoint it. Installed only on the main thread; submitit installs its own handlers."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            try:
                signal.signal(sig, self._handle)
            except (ValueError, OSError):  # pragma: no cover
                pass

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True


def _collective_check(comm: Communicator, fn: Any) -> Any:
    """Run ``fn`` on rank 0 and raise its user error on every rank (so no rank waits forever)."""
    result, error = None, None
    if comm.rank == 0:
        try:
            result = fn()
        except HpcflError as err:
            error = (type(err), str(err))
    result, error = comm.bcast((result, error))
    if error is not None:
        raise error[0](error[1])
    return result


def _write_partition(fed: Federation, run_dir: Path) -> None:
    from hpcfl.data import partition_stats, plot_partition_heatmap, save_partition

    counts = partition_stats(fed.dataset.train.y, fed.parts, fed.dataset.num_classes)
    save_partition(run_dir / "partition.json", fed.parts, fed.cfg.partition, fed.cfg.seed, counts)
    plot_partition_heatmap(counts, run_dir / "partition.png")


def run_experiment(
    cfg: Config,
    run_dir: Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    comm: Communicator | None = None,
    stop: StopRequest | None = None,
) -> RunResult:
    """Run (or continue) the configured federation; every rank returns the same server state."""
    comm = comm or get_comm(cfg.comm)
    run_dir = Path(run_dir)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    has_state = _collective_check(
        comm, lambda: prepare_run_dir(run_dir, cfg, resume=resume, overwrite=overwrite)
    )
    fed = build_federation(cfg, comm)
    algo = fed.algorithm
    ckpt_root = run_dir / "checkpoints"
    server = algo.init_server(fed.flat.vector)
    clients: dict[int, ClientState] = {k: algo.init_client(k, server) for k in fed.owned}
    start = 0
    ckpt = load_checkpoint(ckpt_root, fed.owned) if has_state else None
    if ckpt is not None:
        start = ckpt.round
        server = state_from_dict(type(server), ckpt.server)
        clients = {k: state_from_dict(type(clients[k]), ckpt.clients[k]) for k in fed.owned}
    metrics_path = run_dir / "metrics.jsonl"
    if comm.rank == 0:
        dump_config(cfg, run_dir / "config.yaml")
        _write_partition(fed, run_dir)
        kept = [r for r in read_jsonl(metrics_path) if r["round"] <= start]
        write_jsonl(metrics_path, kept)
    rows = read_jsonl(metrics_path) if comm.rank == 0 else []
    progress = Progress(total=cfg.rounds, initial=start, enabled=cfg.progress and comm.rank == 0)
    stop = stop or StopRequest()

    def hook(done: int, srv: ServerState, cls: dict[int, ClientState], row: dict[str, Any] | None) -> bool:
        if row is not None and comm.rank == 0:
            append_jsonl(metrics_path, row)
            rows.append(row)
        progress.update(done, row)
        # stop requests arrive on any rank; agree on them so every rank checkpoints the same round
        halt = bool(comm.allreduce(torch.tensor([float(stop.requested)], dtype=torch.float64)).item())
        if done % cfg.checkpoint_every == 0 or done == cfg.rounds or halt:
            save_checkpoint(
                ckpt_root, done, state_to_dict(srv), {k: state_to_dict(c) for k, c in cls.items()}, comm
            )
        return halt

    t0 = time.perf_counter()
    server, clients, done = run_rounds(model_plan(fed), server, clients, start, cfg.rounds, hook=hook)
    progress.close()
    finished = done >= cfg.rounds
    if comm.rank == 0 and finished:
        atomic_write_text(run_dir / DONE, f"rounds={done} seconds={time.perf_counter() - t0:.3f}\n")
    comm.barrier()
    return RunResult(run_dir=run_dir, rounds_done=done, server=server, metrics=rows, finished=finished)


def default_run_dir(cfg: Config) -> Path:
    """``runs/<name>`` under the working directory."""
    if not cfg.name or "/" in cfg.name:
        raise RunDirError(f"config name {cfg.name!r} cannot name a run directory; pass --run-dir")
    return Path("runs") / cfg.name
