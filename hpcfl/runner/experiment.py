"""One federated run from config to finished run directory, on any number of ranks.

Rank 0 owns the shared files (config, metrics, partition, progress bar); every rank writes the
checkpoints of the client states it holds. Resuming loads the latest checkpoint and replays
nothing: participants depend only on (seed, stage, round) and client RNGs on (seed, round, client),
so the resumed run ends bit-identical. The algorithm declares its stages (TCT: two); the driver
runs them in sequence, continuing round numbers and checkpoints across them.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from hpcfl import node
from hpcfl.algorithms import ServerState
from hpcfl.algorithms.asynchronous import AsyncAlgorithm
from hpcfl.algorithms.base import Stage, resolve_hook, state_to_dict
from hpcfl.algorithms.stage_types import StageInput, StagePlan
from hpcfl.comm import Communicator, get_comm
from hpcfl.config import Config, dump_config
from hpcfl.entk.settings import applied as entk_settings_in_force
from hpcfl.errors import ConfigError, HpcflError, PeerLostError, RunDirError
from hpcfl.files import append_jsonl, append_line, atomic_write_text, read_jsonl, write_jsonl
from hpcfl.privacy.build import budget_line
from hpcfl.runner import determinism
from hpcfl.runner.checkpoint import Checkpoint, load_checkpoint, placed_state, save_checkpoint
from hpcfl.runner.checkpoint_check import expected_states
from hpcfl.runner.client_eval import CLIENT_ROWS
from hpcfl.runner.client_states import ClientStates
from hpcfl.runner.federation import Federation, build_federation, evaluation_notes, model_plan
from hpcfl.runner.lock import RunLock
from hpcfl.runner.loggers import Loggers, check_loggers, open_loggers
from hpcfl.runner.progress import Progress
from hpcfl.runner.rounds import MemoryStates, RoundHook, run_rounds
from hpcfl.runner.rundir import BUDGET_STOP, DONE, FAILED, PEER_LOST, prepare_run_dir
from hpcfl.tct.pipeline import STAGE1_MODEL as STAGE1_MODEL
from hpcfl.units import parse_client_batch, parse_memory_budget


@dataclass
class RunResult:
    """Final state of a run as seen by this rank."""

    run_dir: Path
    rounds_done: int
    server: ServerState
    metrics: list[dict[str, Any]]
    finished: bool
    budget_stop: str | None = None  # the line of a run stopped by privacy.epsilon_budget (finished)


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

    def stop_now(self) -> bool:
        """Polled inside long steps between rounds (the eNTK extraction), every few seconds."""
        return self.requested


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


def _write_partition(fed: Federation, run_dir: Path) -> Future[Path]:
    """Write ``partition.json`` now (a resume compares its split with it) and start drawing
    ``partition.png`` beside the first rounds; the caller waits for the returned future before the
    run ends.

    The heatmap is for people, and drawing it before the first round delayed every rank's start by
    matplotlib's import and the drawing: 0.6 CPU s (measured on the 2-core host, 100 clients), about
    a quarter of hpcfl's own start-up besides importing torch. In a thread it overlaps the first
    round, whose kernels release the GIL."""
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
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpcfl-heatmap")
    drawn = pool.submit(plot_partition_heatmap, counts, run_dir / "partition.png")
    pool.shutdown(wait=False)  # the drawing goes on; nothing else is submitted
    return drawn


def _check_same_partition(fed: Federation, run_dir: Path) -> None:
    """A resume must train on the split the run started with: refuse when the partition computed
    now differs from the run's ``partition.json`` (a run started by an hpcfl whose partitioner
    drew differently, e.g. ``classes:C`` before it followed NIID-Bench's rule)."""
    from hpcfl.data import load_partition
    from hpcfl.errors import DataError

    try:
        saved = load_partition(run_dir / "partition.json")
    except DataError:  # missing or damaged: nothing to compare, and it is rewritten below
        return
    same = len(saved.parts) == len(fed.parts) and all(
        torch.equal(a, b.to(a.dtype)) for a, b in zip(saved.parts, fed.parts, strict=True)
    )
    if not same:
        hint = (
            f" (classes:C now follows NIID-Bench's rule; the round-robin layout of earlier versions is "
            f"balanced-{fed.cfg.partition})"
            if fed.cfg.partition.startswith("classes:")
            else ""
        )
        raise RunDirError(
            f"{run_dir}: partition {fed.cfg.partition!r} (seed {fed.cfg.seed}) now gives a different split "
            f"from the run's partition.json{hint}, so resuming would change the clients' data; start over "
            "with --overwrite"
        )


def set_threads(cfg: Config, comm: Communicator) -> None:
    """Torch threads per rank: the config's (at most the cores this process may use), else this
    node's cores shared among its ranks.

    Without this every rank of ``mpiexec -n R`` starts one thread per core and they oversubscribe
    the node, and spinning OpenMP threads make rounds many times slower.
    """
    cores = len(node.allowed_cores())
    if cfg.threads:
        if cfg.threads > cores and comm.rank == 0:  # torch segfaults creating 100,000 threads
            print(
                f"hpcfl: note: threads: {cfg.threads} is more than the {cores} cores this process may use; "
                f"using {cores}",
                file=sys.stderr,
            )
        torch.set_num_threads(min(cfg.threads, cores))
    elif comm.local_size > 1:
        torch.set_num_threads(max(1, cores // comm.local_size))
    threads = torch.get_num_threads()
    if comm.rank == 0 and cfg.device == "cpu" and threads > 1:  # a shared node: say so once, with the remedy
        busy = node.busy_cores()
        note = node.oversubscription_note(threads, comm.local_size, cores, busy)
        if note is not None:
            print(note, file=sys.stderr)


def run_stages(cfg: Config) -> list[Stage]:
    """The run's stages with their round counts (the single default stage runs ``cfg.rounds``)."""
    from hpcfl.algorithms import ALGORITHMS

    algo_cls = ALGORITHMS[cfg.algorithm]
    stages = list(algo_cls.stages(algo_cls(cfg.params, layout=_NO_LAYOUT)))
    return [dataclasses.replace(s, rounds=cfg.rounds) if s.rounds < 0 else s for s in stages]


def checkpoint_interval(setting: str, algorithm: object) -> int:
    """Rounds (server steps) between checkpoints: ``setting``, or for ``auto`` 1 (synchronous), and
    for an asynchronous method concurrency / K steps: its checkpoint holds every update in flight
    (concurrency × the model), so one a step made a FedAsync run at concurrency 100 spend ten times
    its training time writing them; one every concurrency / K steps writes about one model per
    client update, as a synchronous run does."""
    if (every := parse_client_batch(setting, "checkpoint_every")) != "auto":
        return int(every)
    if isinstance(algorithm, AsyncAlgorithm):
        return max(1, algorithm.concurrency // algorithm.buffer_size)
    return 1


def stage_rounds(cfg: Config) -> tuple[int, int]:
    """(rounds of the first stage, total rounds over every stage)."""
    stages = run_stages(cfg)
    return stages[0].rounds, sum(s.rounds for s in stages)


CLIENT_METRICS = "client_metrics.jsonl"  # per-client evaluation, one line per evaluated round


class _Bookkeeper:
    """Metrics rows (per-client values into ``client_metrics.jsonl``), checkpoints, the loggers'
    views, progress and stop requests after each round (the loop's hook).

    Every row gets ``wall_s``: the run's wall seconds up to that row, from ``started`` (the process's
    start of the run, data loading included) plus, on a resume, the ``wall_s`` of the last row the
    checkpoint kept; so the last row's ``wall_s`` is the whole run's wall time (less the work a
    killed process did after its last checkpoint, which the resume redid and counted)."""

    def __init__(
        self,
        cfg: Config,
        comm: Communicator,
        run_dir: Path,
        stop: StopRequest,
        start: int,
        total: int,
        started: float | None = None,
        checkpoint_every: int = 1,
    ) -> None:
        self.started = time.perf_counter() if started is None else started
        self.cfg, self.comm, self.run_dir, self.stop = cfg, comm, run_dir, stop
        self.metrics_path = run_dir / "metrics.jsonl"
        self.clients_path = run_dir / CLIENT_METRICS
        self.rows: list[dict[str, Any]] = []
        self.loggers: Loggers | None = None  # rank 0's views of the rows (cfg.loggers)
        if comm.rank == 0:
            kept = [r for r in read_jsonl(self.metrics_path) if r["round"] <= start]
            write_jsonl(self.metrics_path, kept)
            self.rows = kept
            if self.clients_path.exists():
                write_jsonl(
                    self.clients_path, [r for r in read_jsonl(self.clients_path) if r["round"] <= start]
                )
        self.total = total
        self.note: dict[str, Any] = {}  # columns for the next metrics row (a resume's resets)
        self.wall_before = float(self.rows[-1].get("wall_s", 0.0)) if self.rows else 0.0
        self.progress = Progress(total=total, initial=start, enabled=cfg.progress and comm.rank == 0)
        self.budget_stop: str | None = None  # set when privacy.epsilon_budget ends the run
        self.checkpoint_every = checkpoint_every  # rounds between checkpoints (checkpoint_interval)

    def open_loggers(self, cfg: Config) -> None:
        """Open the configured loggers (rank 0) and write the rows they have not seen yet."""
        try:
            self.loggers = open_loggers(cfg.loggers, self.run_dir, cfg.to_dict())
        except HpcflError:
            raise
        except Exception as err:  # a tracking server that refuses, a damaged store: one line
            raise ConfigError(f"loggers: could not open {', '.join(cfg.loggers)}: {err}") from None
        self.loggers.flush(self.rows)

    def hook(self, stage: str, offset: int, last: int) -> RoundHook:
        def after_round(done: int, srv: ServerState, states: Any, row: dict[str, Any] | None) -> bool:
            done += offset
            if row is not None and self.comm.rank == 0:
                wall = self.wall_before + time.perf_counter() - self.started
                row, self.note = {**row, **self.note, "wall_s": wall}, {}
                if (per_client := row.pop(CLIENT_ROWS, None)) is not None:
                    append_jsonl(
                        self.clients_path, {"round": row["round"], "stage": stage, "clients": per_client}
                    )
                append_jsonl(self.metrics_path, row)
                self.rows.append(row)
            self.progress.update(done, row)
            # a signal may reach any rank: agree on it so every rank checkpoints the same round
            flag = torch.tensor([float(self.stop.requested)], dtype=torch.float64)  # host: a stop flag
            halt = bool(self.comm.allreduce(flag).item())
            # the privacy budget: the server state (identical on every rank) says the next round
            # would exceed it
            if done < self.total and (line := budget_line(srv)) is not None:
                self.budget_stop, halt = line, True
            if done % self.checkpoint_every == 0 or done in (last, self.total) or halt:
                extra: dict[str, Any] = {"stage": stage}
                held, part = states.checkpoint()  # files per client, or the store's slot map
                extra.update(part)
                extra["clients"] = sorted(k for part in self.comm.allgather(sorted(held)) for k in part)
                save_checkpoint(
                    self.run_dir / "checkpoints", done, state_to_dict(srv), held, self.comm, extra=extra
                )
                if self.loggers is not None:  # rows a checkpoint covers: never logged twice on resume
                    self.loggers.flush(self.rows)
            return halt

        return after_round


class RecordingBook:
    """The driver's bookkeeping without files: rows kept in memory, no checkpoints (benchmarks)."""

    def __init__(self, run_dir: Path, comm: Communicator) -> None:
        self.run_dir, self.comm, self.stop = run_dir, comm, StopRequest()
        self.rows: list[dict[str, Any]] = []
        self.note: dict[str, Any] = {}  # dropped: benchmarks time rounds, not stage entries
        self.budget_stop: str | None = None

    def hook(self, stage: str, offset: int, last: int) -> RoundHook:
        def after_round(done: int, srv: ServerState, states: Any, row: dict[str, Any] | None) -> bool:
            if row is not None:
                self.rows.append(row)
            return False

        return after_round


def run_experiment(
    cfg: Config,
    run_dir: Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    comm: Communicator | None = None,
    stop: StopRequest | None = None,
    reset_clients: Sequence[int] = (),
) -> RunResult:
    """Run (or continue) the configured federation; every rank returns the same server state.

    Rank 0 holds the run directory's lock for the whole run (a second run on it is refused).
    ``reset_clients`` (with ``resume``): clients whose saved states are dropped and re-initialised
    (``--reset-client-states``: a damaged client-state chunk); the first metrics row after the
    resume records them as ``reset_client_states``.
    """
    reset_clients = sorted({int(k) for k in reset_clients})
    if reset_clients and not resume:
        raise ConfigError("--reset-client-states applies to a resume; add --resume")
    if outside := [k for k in reset_clients if not 0 <= k < cfg.num_clients]:
        raise ConfigError(f"--reset-client-states names clients outside 0..{cfg.num_clients - 1}: {outside}")
    comm = comm or get_comm(cfg.comm, cfg.comm_timeout)
    run_dir = Path(run_dir)
    lock = RunLock(run_dir) if comm.rank == 0 else None
    _collective_check(comm, lambda: lock.acquire() if lock else None)
    if lock is not None:  # this start answers an earlier lost peer (the requeue it asked for)
        (run_dir / PEER_LOST).unlink(missing_ok=True)
    try:
        return _run_locked(
            cfg, run_dir, resume=resume, overwrite=overwrite, comm=comm, stop=stop, reset=reset_clients
        )
    except PeerLostError as err:  # a side's speaking rank: leave its line where a batch script looks
        append_line(run_dir / PEER_LOST, str(err))  # both sides of a cut link may speak
        raise
    finally:
        if lock is not None:
            lock.release()


def _run_locked(
    cfg: Config,
    run_dir: Path,
    *,
    resume: bool,
    overwrite: bool,
    comm: Communicator,
    stop: StopRequest | None,
    reset: Sequence[int],
) -> RunResult:
    started = time.perf_counter()  # the run's wall clock (metrics rows' wall_s) includes loading
    check_loggers(cfg.loggers, run_dir)  # every rank alike: a missing extra is one line before any work
    set_threads(cfg, comm)
    has_state = _collective_check(
        comm, lambda: prepare_run_dir(run_dir, cfg, resume=resume, overwrite=overwrite)
    )
    fed = build_federation(cfg, comm)
    for note in evaluation_notes(fed.algorithm, fed.client_eval) if comm.rank == 0 else ():
        print(note, file=sys.stderr)
    if has_state:
        _collective_check(comm, lambda: _check_same_partition(fed, run_dir))
    stages = run_stages(cfg)
    for stage in stages[1:]:  # what a later stage can refuse from the config alone (TCT: disk space)
        if stage.check is not None and stage.rounds > 0:
            _collective_check(comm, lambda stage=stage: resolve_hook(stage.check)(fed, run_dir))
    held = fed.owned if comm.size > 1 else list(range(len(fed.parts)))  # states this rank may train
    every = list(range(len(fed.parts)))  # every rank checks all client files, so all pick one round
    entk = determinism.entk_settings(cfg)  # config + environment, in force while the run runs
    record = determinism.collect(
        cfg, comm, client_batch_used=fed.client_batch, device=str(fed.device), entk=entk
    )  # collective: the threads, host and device every rank uses
    if fed.heldout is not None:
        record["heldout_clients"] = list(fed.heldout.ids)  # partition ids, never trained on
    if isinstance(algo := fed.algorithm, AsyncAlgorithm):  # what the defaults resolved to (FedBuff's K)
        record["asynchronous"] = {"concurrency": algo.concurrency, "buffer_size": algo.buffer_size}
    if comm.rank == 0 and has_state and (note := determinism.resume_note(run_dir, record)) is not None:
        print(note, file=sys.stderr)
    ckpt = (  # onto this rank's device, whichever device wrote it; another run's files fall back
        load_checkpoint(
            run_dir / "checkpoints",
            held,
            device=fed.device,
            all_clients=every,
            reset=reset,
            expect=expected_states(fed, stages),
        )
        if has_state
        else None
    )
    start = ckpt.round if ckpt is not None else 0
    heatmap: Future[Path] | None = None  # rank 0's partition.png, drawn beside the first rounds
    if comm.rank == 0:
        dump_config(cfg, run_dir / "config.yaml")
        if not has_state or determinism.read_record(run_dir) is None:  # what the run BEGAN with
            determinism.write_record(run_dir, record)
        heatmap = _write_partition(fed, run_dir)
    total = sum(s.rounds for s in stages)
    if comm.rank == 0 and start < total:  # only now that the checkpoint loaded: unfinished again
        (run_dir / DONE).unlink(missing_ok=True)
    interval = checkpoint_interval(cfg.checkpoint_every, fed.algorithm)
    book = _Bookkeeper(cfg, comm, run_dir, stop or StopRequest(), start, total, started, interval)
    if reset and ckpt is not None:
        book.note["reset_client_states"] = reset
    if cfg.loggers:
        _collective_check(comm, lambda: book.open_loggers(cfg) if comm.rank == 0 else None)
    t0 = time.perf_counter()
    finished = False
    try:
        with entk_settings_in_force(entk):
            server, done = drive_stages(fed, stages, run_dir, ckpt, book, reset=reset)
        finished = done >= total or book.budget_stop is not None
    finally:
        drawing = heatmap.exception() if heatmap is not None else None  # waits: the loggers attach it
        book.progress.close()
        if book.loggers is not None:
            book.loggers.close(finished)
    if drawing is not None:
        raise drawing
    if comm.rank == 0 and finished:
        stopped = f" stopped={BUDGET_STOP}" if book.budget_stop is not None else ""  # read by `status`
        atomic_write_text(run_dir / DONE, f"rounds={done} seconds={time.perf_counter() - t0:.3f}{stopped}\n")
        (run_dir / FAILED).unlink(missing_ok=True)  # a point that failed before is now done
    comm.barrier()
    return RunResult(
        run_dir=run_dir,
        rounds_done=done,
        server=server,
        metrics=book.rows,
        finished=finished,
        budget_stop=book.budget_stop,
    )


def drive_stages(
    fed: Federation,
    stages: Sequence[Stage],
    run_dir: Path,
    ckpt: Checkpoint | None,
    book: _Bookkeeper | RecordingBook,
    *,
    round_base: int = 0,
    first_index: int = 0,
    sweep: bool = False,
    reset: Sequence[int] = (),
) -> tuple[ServerState, int]:
    """Run every stage from the checkpoint on; returns the final server state and rounds done.

    ``reset``: clients whose checkpointed states are dropped (re-initialised) on the resume.

    ``run_dir`` is where stages find their inputs (TCT: θ_T1 and the feature stores); metrics and
    checkpoints go where ``book`` writes. ``round_base``/``first_index`` let a caller run only the
    later stages of a run (``hpcfl tct-stage2``) with the run's own round numbers.
    """
    names = [s.name for s in stages]
    resume_at = names.index(ckpt.extra.get("stage", names[0])) if ckpt is not None else 0
    done = ckpt.round - round_base if ckpt is not None else 0
    server: ServerState | None = None
    offset = 0
    for si, stage in enumerate(stages):
        lo, hi = offset, offset + stage.rounds
        offset = hi
        if si < resume_at:
            continue
        if si > resume_at and stage.rounds == 0:
            continue
        resumed_here = ckpt is not None and si == resume_at
        entered = time.perf_counter()
        entry = enter_stage(fed, stage, first_index + si, run_dir, server, book.stop, sweep=sweep)
        if stage.enter is not None:  # its own setup (TCT: eNTK extraction), on the stage's first row
            book.note["stage_setup_s"] = time.perf_counter() - entered
        form = None
        if resumed_here:
            assert ckpt is not None
            form = "disk" if "client_map" in ckpt.extra else "memory"
        srv, states = entry.server, client_states(fed, entry, book.run_dir, stage.name, resumed_form=form)
        if resumed_here:
            assert ckpt is not None
            srv = placed_state(srv, ckpt.server)  # each field where a fresh state keeps it
            states.restore(ckpt, reset)
        if done < hi and (line := budget_line(srv)) is not None:
            server, book.budget_stop = srv, line  # spent before this stage's next round
            break
        srv, stage_done = run_rounds(
            entry.plan,
            srv,
            states,
            done - lo,
            stage.rounds,
            stage=stage.name,
            round_offset=round_base + lo,
            hook=book.hook(stage.name, round_base + lo, round_base + hi),
        )
        server, done = srv, lo + stage_done
        if done < hi:  # stopped by a signal
            break
        if stage.finish is not None:
            finish = resolve_hook(stage.finish)
            finish(StageInput(fed, fed.comm, run_dir, previous=server, stage_index=first_index + si))
    assert server is not None
    return server, round_base + done


def enter_stage(
    fed: Federation,
    stage: Stage,
    index: int,
    run_dir: Path,
    previous: ServerState | None,
    book_stop: StopRequest | None = None,
    *,
    sweep: bool = False,
) -> StagePlan:
    """The plan of ``stage``: the configured model's rounds, or what the stage's ``enter`` builds."""
    if stage.enter is None:
        plan = model_plan(fed)
        plan.stage_index = index
        algo = plan.algorithm
        server = algo.init_server(fed.flat.vector) if previous is None else previous
        return StagePlan(plan=plan, server=server, init_client=lambda k: algo.init_client(k, server))
    stop = book_stop.stop_now if book_stop is not None else None
    entry = StageInput(fed, fed.comm, run_dir, previous, index, stop=stop, sweep=sweep)
    return resolve_hook(stage.enter)(entry)


def client_states(
    fed: Federation, entry: StagePlan, run_dir: Path, stage: str, *, resumed_form: str | None = None
) -> MemoryStates | ClientStates:
    """Where this stage's client states live.

    In memory (the per-rank dict, checkpointed as one file per client) while a client is always
    trained on the same rank (one rank, or full participation) and the states fit the budget;
    otherwise in the client-state store ``client_states_<stage>.zarr`` of the run directory, one
    chunk per client, which any rank reads and writes (``client_state_memory: disk`` forces it).
    ``resumed_form`` (``"disk"``/``"memory"``): how the checkpoint being resumed keeps them. A
    checkpoint with a store resumes with the store whatever the (resumable) ``client_state_memory``
    or rank count says now, and a memory-form one in memory where a client keeps its rank: the
    other choice would start every client's state again from zero without a word.
    """
    algo = entry.plan.algorithm
    probe = entry.init_client(0)
    if not fields(probe):
        return MemoryStates(entry.init_client)
    choice = parse_memory_budget(fed.cfg.client_state_memory)
    sticky = fed.comm.size == 1 or algo.participation.full(entry.plan.population)
    if resumed_form == "disk":
        choice = "disk"
    elif resumed_form == "memory" and sticky:
        choice = "memory"
    if choice == "memory" and not sticky:
        raise ConfigError(
            f"client_state_memory: memory cannot hold {algo.name}'s client states with partial participation "
            f"on {fed.comm.size} ranks (a client may train on another rank each round); use auto or disk"
        )
    if choice == "memory" or (sticky and choice != "disk" and _fits(probe, entry.server, fed, choice)):
        return MemoryStates(entry.init_client)
    return ClientStates(
        entry.init_client,
        num_clients=entry.plan.population.size,
        budget_bytes=0,
        path=run_dir / f"client_states_{stage}.zarr",
        device=fed.device,  # stored states come back on this rank's device, not the writer's
    )


def _fits(probe: Any, server: ServerState, fed: Federation, choice: int | str) -> bool:
    """Whether every client's state fits the budget (``auto``: a quarter of available memory).

    A client's size is taken from its state (``probe``, a fresh one), not guessed from the upload:
    each tensor field's bytes, and a field a fresh state leaves unset counted as one vector the
    size of the server's ``x`` (what every built-in state field holds once trained).
    """
    from hpcfl.runner.client_states import resolve_budget, state_nbytes

    per_client = state_nbytes(probe, unset=server.x.nbytes)
    budget = resolve_budget(choice if isinstance(choice, int) else "auto")
    return per_client * len(fed.parts) <= budget


def default_run_dir(cfg: Config) -> Path:
    """``runs/<name>`` under the working directory."""
    if not cfg.name or "/" in cfg.name:
        raise RunDirError(f"config name {cfg.name!r} cannot name a run directory; pass --run-dir")
    return Path("runs") / cfg.name


class _NoLayout:
    """Stands in for a model layout when only an algorithm's declared stages are read."""

    num_params = 0
    size = 0


_NO_LAYOUT: Any = _NoLayout()
