"""One federated run from config to finished run directory, on any number of ranks.

Rank 0 owns the shared files (config, metrics, partition, progress bar); every rank writes the
checkpoints of the clients it owns. Resuming loads the latest checkpoint and replays nothing:
client RNGs depend only on (seed, round, client), so the resumed run ends bit-identical. TCT runs
its two stages here in sequence; round numbers and checkpoints continue across them.
"""

from __future__ import annotations

import os
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
from hpcfl.files import append_jsonl, atomic_torch_save, atomic_write_text, read_jsonl, write_jsonl
from hpcfl.runner.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from hpcfl.runner.federation import Federation, build_federation, model_plan
from hpcfl.runner.progress import Progress
from hpcfl.runner.rounds import RoundHook, run_rounds
from hpcfl.runner.rundir import DONE, prepare_run_dir

STAGE1_MODEL = "stage1_model.pt"  # TCT: θ_T1, the bootstrapped model stage 2 is built from


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
    checkpoint it. The CLI installs it; inside submitit jobs submitit's own handlers stay."""

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
    save_partition(
        run_dir / "partition.json",
        fed.parts,
        fed.cfg.partition,
        fed.cfg.seed,
        counts,
        dataset=fed.cfg.dataset,
    )
    plot_partition_heatmap(counts, run_dir / "partition.png")


def set_threads(cfg: Config, comm: Communicator) -> None:
    """Torch threads per rank: the config's, else this node's cores shared among its ranks.

    Without this every rank of ``mpiexec -n R`` starts one thread per core and they oversubscribe
    the node, and spinning OpenMP threads make rounds many times slower.
    """
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    elif comm.local_size > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // comm.local_size))


def stage_rounds(cfg: Config) -> tuple[int, int]:
    """(rounds of the model-training stage, total rounds): TCT adds its stage-2 rounds."""
    if cfg.algorithm == "tct":
        return cfg.stage1.rounds, cfg.stage1.rounds + cfg.stage2.rounds
    return cfg.rounds, cfg.rounds


class _Bookkeeper:
    """Metrics rows, checkpoints, progress and stop requests after each round (the loop's hook)."""

    def __init__(
        self, cfg: Config, comm: Communicator, run_dir: Path, stop: StopRequest, start: int, total: int
    ) -> None:
        self.cfg, self.comm, self.run_dir, self.stop = cfg, comm, run_dir, stop
        self.metrics_path = run_dir / "metrics.jsonl"
        self.rows: list[dict[str, Any]] = []
        if comm.rank == 0:
            kept = [r for r in read_jsonl(self.metrics_path) if r["round"] <= start]
            write_jsonl(self.metrics_path, kept)
            self.rows = kept
        self.total = total
        self.progress = Progress(total=total, initial=start, enabled=cfg.progress and comm.rank == 0)

    def hook(self, stage: str, offset: int, last: int) -> RoundHook:
        def after_round(
            done: int, srv: ServerState, cls: dict[int, ClientState], row: dict[str, Any] | None
        ) -> bool:
            done += offset
            if row is not None and self.comm.rank == 0:
                append_jsonl(self.metrics_path, row)
                self.rows.append(row)
            self.progress.update(done, row)
            # a signal may reach any rank: agree on it so every rank checkpoints the same round
            flag = torch.tensor([float(self.stop.requested)], dtype=torch.float64)
            halt = bool(self.comm.allreduce(flag).item())
            if done % self.cfg.checkpoint_every == 0 or done in (last, self.total) or halt:
                save_checkpoint(
                    self.run_dir / "checkpoints",
                    done,
                    state_to_dict(srv),
                    {k: state_to_dict(c) for k, c in cls.items()},
                    self.comm,
                    extra={"stage": stage},
                )
            return halt

        return after_round


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
    set_threads(cfg, comm)
    has_state = _collective_check(
        comm, lambda: prepare_run_dir(run_dir, cfg, resume=resume, overwrite=overwrite)
    )
    fed = build_federation(cfg, comm)
    ckpt = load_checkpoint(run_dir / "checkpoints", fed.owned) if has_state else None
    start = ckpt.round if ckpt is not None else 0
    if comm.rank == 0:
        dump_config(cfg, run_dir / "config.yaml")
        _write_partition(fed, run_dir)
    first, total = stage_rounds(cfg)
    book = _Bookkeeper(cfg, comm, run_dir, stop or StopRequest(), start, total)
    t0 = time.perf_counter()

    # 1. the model-training stage (every algorithm; TCT's stage 1)
    algo = fed.algorithm
    server = algo.init_server(fed.flat.vector)
    clients: dict[int, ClientState] = {k: algo.init_client(k, server) for k in fed.owned}
    in_stage2 = ckpt is not None and ckpt.extra.get("stage") == "stage2"
    if ckpt is not None and not in_stage2:
        server, clients = _restore(ckpt, server, clients)
    done = start
    stage = "stage1" if cfg.algorithm == "tct" else "train"
    if start < first:
        server, clients, done = run_rounds(
            model_plan(fed), server, clients, start, first, stage=stage, hook=book.hook(stage, 0, first)
        )

    # 2. TCT's stage 2 on the convexified problem
    if cfg.algorithm == "tct" and done >= first and done < total:
        server, done = _run_tct_stage2(fed, run_dir, server, ckpt if in_stage2 else None, done, book)

    book.progress.close()
    finished = done >= total
    if comm.rank == 0 and finished:
        atomic_write_text(run_dir / DONE, f"rounds={done} seconds={time.perf_counter() - t0:.3f}\n")
    comm.barrier()
    return RunResult(run_dir=run_dir, rounds_done=done, server=server, metrics=book.rows, finished=finished)


def _restore(
    ckpt: Checkpoint, server: ServerState, clients: dict[int, ClientState]
) -> tuple[ServerState, dict[int, ClientState]]:
    server = state_from_dict(type(server), ckpt.server)
    clients = {k: state_from_dict(type(c), ckpt.clients[k]) for k, c in clients.items()}
    return server, clients


def _run_tct_stage2(
    fed: Federation, run_dir: Path, server: ServerState, ckpt: Checkpoint | None, done: int, book: _Bookkeeper
) -> tuple[ServerState, int]:
    from hpcfl.tct.pipeline import prepare_stage2

    cfg, comm = fed.cfg, fed.comm
    first, total = stage_rounds(cfg)
    theta_path = run_dir / STAGE1_MODEL
    if ckpt is None:  # stage 1 just finished (or T1 = 0): θ_T1 is the current server model
        theta = server.x
        if comm.rank == 0:
            atomic_torch_save(theta_path, theta)
        comm.barrier()
    else:
        if not theta_path.exists():
            raise RunDirError(f"{theta_path} is missing, so stage 2 cannot resume; rerun with --overwrite")
        theta = torch.load(theta_path, weights_only=True)
    setup = prepare_stage2(fed, theta, run_dir, cfg.stage2)
    server2 = setup.initial_server()
    clients2: dict[int, ClientState] = {k: setup.plan.algorithm.init_client(k, server2) for k in fed.owned}
    if ckpt is not None:
        server2, clients2 = _restore(ckpt, server2, clients2)
    start2 = done - first
    server2, clients2, done2 = run_rounds(
        setup.plan,
        server2,
        clients2,
        start2,
        cfg.stage2.rounds,
        stage="stage2",
        round_offset=first,
        hook=book.hook("stage2", first, total),
    )
    return server2, first + done2


def default_run_dir(cfg: Config) -> Path:
    """``runs/<name>`` under the working directory."""
    if not cfg.name or "/" in cfg.name:
        raise RunDirError(f"config name {cfg.name!r} cannot name a run directory; pass --run-dir")
    return Path("runs") / cfg.name
