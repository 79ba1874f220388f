"""The callable a submitit job runs: one hpcfl run on every task of the allocation.

It follows submitit's checkpoint protocol (:class:`submitit.helpers.Checkpointable`) with one
change of timing. Submitit's own handler of the preemption / time-limit signal (``USR2``, sent
``signal_delay_s`` before the limit) calls :meth:`HpcflJob.checkpoint` at once, in the middle of a
round, and requeues. hpcfl instead lets every rank finish the round in flight and write a round
checkpoint (the ranks agree on the stop through their per-round allreduce), and only then does rank
0 go through submitit's checkpoint-and-requeue, so no finished work is lost and the rerun resumes
bit for bit. If the signal comes before the round loop is running, submitit's handler still does the
right thing: the resubmission :meth:`checkpoint` returns resumes from the last round checkpoint.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from hpcfl.comm import abort_world, finalize_mpi
from hpcfl.config import config_from_dict
from hpcfl.errors import EXIT_PEER_LOST, ConfigError, PeerLostError, StoppedError
from hpcfl.launch.records import error_path, missing_slurm_extra
from hpcfl.launch.requeue import requeue_lost_peer

try:
    import submitit
    from submitit.helpers import DelayedSubmission

    from hpcfl.launch.submitit_internals import checkpoint_and_requeue, preemption_signal
except ImportError as err:
    raise missing_slurm_extra("a SLURM job of hpcfl") from err

from hpcfl.runner import StopRequest, run_experiment
from hpcfl.runner.checkpoint import latest_round

#: Exit status of ranks that stopped for a requeue (submitit's own handler exits with -1 too).
REQUEUE_EXIT = 255


def _record_error(err: BaseException) -> None:
    """Write ``{"error": "Type: first line"}`` beside submitit's files (best effort): the job's
    folder, ``RUN_DIR/slurm`` for one run, the sweep's ``slurm/`` for an array task."""
    from hpcfl.files import atomic_write_text

    try:
        env = submitit.JobEnvironment()
        job_id, rank, folder = str(env.job_id), env.global_rank, env.paths.folder
    except (RuntimeError, KeyError):  # not inside a submitit job
        return
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    message = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    try:
        atomic_write_text(error_path(folder, job_id, rank), json.dumps({"error": message}))
    except OSError:
        pass


@dataclass
class HpcflJob(submitit.helpers.Checkpointable):
    """``hpcfl run CONFIG --run-dir RUN_DIR --resume`` as a submitit job (every task runs it).

    ``config`` is the resolved config (``Config.to_dict()``, validated at submission), ``run_dir``
    an absolute path on the shared file system. The job always resumes: the first run starts
    fresh, every rerun after a requeue continues from the newest round checkpoint.
    """

    config: dict[str, Any]
    run_dir: str

    def __call__(self) -> dict[str, Any]:
        """Run (or continue) the federation; returns a summary, or requeues and exits on a signal.

        A failure is also written as one line of JSON (:func:`error_path`) so that ``hpcfl status``
        can show it without unpickling anything from the run directory.
        """
        try:
            return self._run()
        except Exception as err:
            _record_error(err)
            raise

    def _run(self) -> dict[str, Any]:
        t_start = time.time()
        cfg = config_from_dict(self.config)
        run_dir = Path(self.run_dir)
        start = latest_round(run_dir / "checkpoints") or 0
        stop = StopRequest()
        stop.install()  # SIGUSR1 / SIGTERM
        try:  # and submitit's preemption / time-limit signal, which replaces its immediate requeue
            signal.signal(preemption_signal(), lambda signum, frame: setattr(stop, "requested", True))
        except (ValueError, RuntimeError):  # not the main thread, or an unknown SUBMITIT_PREEMPT_SIGNAL
            pass
        try:
            result = run_experiment(cfg, run_dir, resume=True, stop=stop)
        except StoppedError:  # stopped between rounds' checkpoints (feature extraction): work is kept
            self._requeue_after_checkpoint(t_start, start)
            raise
        except PeerLostError as err:  # this rank speaks for the ranks still reachable
            self._requeue_after_lost_peer(err)
        last = result.metrics[-1] if result.metrics else {}
        summary = {
            "run_dir": str(run_dir),
            "finished": result.finished,
            "rounds_done": result.rounds_done,
            "rounds": cfg.rounds,
            "test_accuracy": last.get("test_accuracy"),
        }
        if not result.finished:
            if result.rounds_done <= start:
                raise ConfigError(
                    f"stopped by a signal before finishing a round (still at round {start}); a round "
                    "does not fit in the time left: raise --time or --signal-delay"
                )
            self._requeue_after_checkpoint(t_start, result.rounds_done)
        return summary

    def checkpoint(self, *args: Any, **kwargs: Any) -> DelayedSubmission:
        """The resubmission after a preemption or time limit: the same job (it always resumes).

        The state lives in the run directory's round checkpoints, not in this object, so nothing
        needs saving here.
        """
        return DelayedSubmission(HpcflJob(config=self.config, run_dir=self.run_dir))

    def _requeue_after_lost_peer(self, err: PeerLostError) -> NoReturn:
        """A peer was lost (:mod:`hpcfl.comm.deadline`): say the one line, ask SLURM to requeue
        this job when this side holds a majority (``err.requeue``) (the rerun resumes from the last checkpoint; the job always resumes), and end
        every rank with exit 76. ``scontrol`` directly, not submitit's checkpoint-and-requeue:
        the speaking rank need not be rank 0, and the state is the run directory's checkpoints."""
        print(f"hpcfl: error: {err}", file=sys.stderr, flush=True)
        _record_error(err)
        if not err.requeue:  # not a majority: the line says it ends without requeueing
            abort_world(EXIT_PEER_LOST)
            sys.exit(EXIT_PEER_LOST)
        requeue_lost_peer(str(submitit.JobEnvironment().job_id))  # also from a batch host cut off
        abort_world(EXIT_PEER_LOST)
        sys.exit(EXIT_PEER_LOST)

    def _requeue_after_checkpoint(self, t_start: float, rounds_done: int) -> None:
        """After the round checkpoint: every rank finalizes MPI, then rank 0 runs submitit's
        checkpoint-and-requeue (writes the resubmission, ``scontrol requeue``, exits) and the
        other ranks exit.

        Finalizing first matters with MPICH: its start-up shared memory is named after the PMI
        job/step id, which the rerun of a requeued job reuses; ranks killed by the requeue before
        MPI_Finalize leave it in /dev/shm and the rerun's MPI_Init then fails ("Message truncated").
        """
        finalize_mpi()
        env = submitit.JobEnvironment()
        if env.global_rank == 0:
            print(
                f"hpcfl: stopped by a signal after round {rounds_done} (checkpoint saved); requeueing",
                file=sys.stderr,
            )
            checkpoint_and_requeue(env, t_start)  # t_start: submitit tells a time limit from a preemption
        sys.exit(REQUEUE_EXIT)
