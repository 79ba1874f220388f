"""TensorBoard, MLflow and Weights & Biases views of a run's ``metrics.jsonl`` (``loggers:``).

``metrics.jsonl`` stays the source of truth; a logger shows the rows that reached it, written by
rank 0 only. Every row's numbers become scalars under stable names (``test/accuracy``,
``train/local_loss``, ``comm/bytes_up``, ``time/compute_s``, ``clients/client_acc_p10``: the group
each observer declares, :func:`scalar_names`) at the step of the row's round; the resolved config
becomes the hyper-parameters; at the end of a finished run its figures (``partition.png``, ...) are
attached as artifacts / images.

Exactly once per round, across kills and resumes: a row is handed to the loggers only once a
checkpoint covers it (the run's bookkeeping calls :meth:`Loggers.flush` after saving one, every
round with the default ``checkpoint_every: auto`` of a synchronous method), and each logger records in ``loggers.json`` of the
run directory the last round it wrote (and, while writing, the rounds in doubt) and the id of its
run. A resumed run continues the same TensorBoard directory, MLflow run and W&B run, and first
writes what a logger has not seen yet (a logger added on resume catches up); a round that was
logged but not checkpointed before a kill cannot happen, and rounds a kill interrupted are settled
from the backend (:func:`open_loggers`), so no step is written twice and none is missing.

W&B offline. W&B does not resume an offline run: ``wandb.init(id=..., resume="allow")`` in offline
mode starts a new local folder for the same id every time, with ``run.resumed`` False (checked
with wandb 0.31; the feature request wandb/wandb#2423 is closed, and the pull request that would
make offline init honour ``resume``, wandb/wandb#12110, was still open when this was written).
Its service writes the transaction log behind the caller, so a SIGKILL can lose rows it was given:
rows count as written only once its run closed cleanly, and a resumed run first reads the earlier
segments' transaction logs back (:func:`wandb_records`, W&B's own protobuf classes) and writes only
the rounds they do not hold, so each round is in exactly one segment and the segments, in start-time
order, hold every round once (tested after a SIGKILL). Documented way to upload them as ONE run
(``wandb sync --help``, wandb 0.31: "--id: Upload to an existing run ID. If this is set when syncing
multiple files (with the same entity and project), the files will be synced in order of start
time"; the ``wandb beta sync`` reference adds "intended to work with syncing multiple resumed
fragments of the same run"): run, from the run directory, the command ``loggers.json`` records under
``wandb.sync``, ``wandb sync --id <id> -p <project> wandb/offline-run-...`` naming every segment.
What is NOT verified here: the upload itself (no network, no W&B server: ``wandb sync`` was not run),
and so not that the server stitches the segments into one history. Older clients' ``wandb sync
--append`` is not used: 0.31's ``wandb sync`` no longer offers it, and wandb/wandb#5865 reports it
did not append offline folders of the same id.

Where they write, and how a sweep's points are grouped (a point is a run directory
``SWEEP/runs/<point>`` beside the sweep's manifest):

- ``tensorboard``: ``RUN/tensorboard``; a sweep's point in ``SWEEP/tensorboard/<point>`` (one
  ``tensorboard --logdir SWEEP/tensorboard`` shows the whole sweep).
- ``mlflow``: ``$MLFLOW_TRACKING_URI`` when set, else a local SQLite store ``RUN/mlflow/mlflow.db``
  (artifacts beside it; MLflow 3 refuses new plain-file stores) — ``SWEEP/mlflow/`` for a sweep,
  whose points are child runs of one parent run named after the sweep. Experiment: the sweep's or
  run's name.
- ``wandb``: offline unless ``WANDB_MODE`` says otherwise (no network needed; the ``wandb sync
  --id`` command in ``loggers.json`` uploads later, see above), files under ``RUN/wandb``; project
  ``$WANDB_PROJECT`` or ``hpcfl``; a sweep's points share the group named after the sweep.

Each package is an optional extra (``pip install 'hpcfl[tensorboard]'`` ...); a missing one is
refused before the run starts, in one line naming the ``pip install`` to run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcfl.errors import ConfigError
from hpcfl.files import atomic_write_text
from hpcfl.runner.client_eval import ClientEval
from hpcfl.runner.heldout import HeldOutEval
from hpcfl.runner.observers import ClientMetrics, Participants, RankLoad, Timing, Traffic
from hpcfl.runner.rundir import (
    LOGGER_MARKER,
    SWEEP_MANIFEST,
    SWEEP_RUNS,
    claim_logger_dir,
    logger_dir_is_ours,
)

STATE = "loggers.json"  # per logger: the last round written and the id of its run
_PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
_SPLITS = ("test", "val", "train")  # evaluator columns: test_accuracy -> test/accuracy
_GROUPS = {
    c: obs.group
    for obs in (Participants, RankLoad, Traffic, Timing, ClientEval, HeldOutEval)
    for c in obs.columns
} | {"cka": "representation", "drift_diversity": "representation", "wall_s": "time", "stage_setup_s": "time"}


def check_loggers(names: Sequence[str], run_dir: Path | None = None) -> None:
    """Refuse a logger whose package is missing, in one line naming the ``pip install`` to run, and
    (with ``run_dir``) a tensorboard folder there that hpcfl did not make, before anything is written."""
    for name in names:
        if importlib.util.find_spec(_PACKAGES[name]) is None:
            raise ConfigError(
                f"loggers: {name} needs the {_PACKAGES[name]} package, which is not installed: "
                f"pip install 'hpcfl[{name}]' (or drop {name} from loggers)"
            )
    if run_dir is not None and "tensorboard" in names:
        _check_tensorboard_dir(tensorboard_dir(Path(run_dir)), Path(run_dir))


def tensorboard_dir(run_dir: Path) -> Path:
    """``RUN/tensorboard``, or ``SWEEP/tensorboard/<point>`` for a sweep's point."""
    sweep = sweep_of(run_dir)
    return sweep[0] / "tensorboard" / run_dir.name if sweep else run_dir / "tensorboard"


def _check_tensorboard_dir(logdir: Path, run_dir: Path) -> None:
    """A fresh tensorboard log replaces its folder: refuse one hpcfl's records do not say it made."""
    if logdir.exists() and not logger_dir_is_ours(logdir, run_dir, "tensorboard"):
        raise ConfigError(
            f"loggers: {logdir} exists and hpcfl did not make it (no {LOGGER_MARKER}); a fresh "
            "tensorboard log would mix with its files: move it away or choose another --run-dir"
        )


def scalar_names(row: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row under stable names ``group/column`` (nested per-layer values
    ``group/column/layer``); strings and lists (stage, participants) are not scalars."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key == "round":
            continue
        split, _, rest = key.partition("_")
        if split in _SPLITS and rest:
            name = f"{split}/{rest}"
        elif key in _GROUPS:
            name = f"{_GROUPS[key]}/{key}"
        elif key == "local_loss" or key.startswith(("local_loss_", "client_")):
            name = f"{ClientMetrics.group}/{key}"
        else:
            name = f"metrics/{key}"
        if isinstance(value, Mapping):
            for sub, v in value.items():
                if _number(v):
                    out[f"{name}/{sub}"] = float(v)
        elif _number(value):
            out[name] = float(value)
    return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The resolved config as ``dotted.key -> text`` hyper-parameters (lists as their YAML-ish text)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


def sweep_of(run_dir: Path) -> tuple[Path, str] | None:
    """(the sweep directory, the sweep's name) when ``run_dir`` is a sweep's point, else None."""
    parent = run_dir.resolve().parent
    manifest = parent.parent / SWEEP_MANIFEST
    if parent.name != SWEEP_RUNS or not manifest.exists():
        return None
    try:
        return parent.parent, str(json.loads(manifest.read_text())["name"])
    except (OSError, ValueError, KeyError):
        return parent.parent, parent.parent.name


class Logger:
    """One tracking backend: ``log`` rows (a step per round), ``close`` with the figures when done."""

    name = ""
    durable_log = True  # a logged row is on disk when log() returns (else only after close())

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        raise NotImplementedError

    def close(self, figures: Sequence[Path], finished: bool) -> None:
        raise NotImplementedError

    def record(self) -> dict[str, Any]:
        """What ``loggers.json`` keeps to continue the same run after a resume."""
        return {}


class TensorBoardLogger(Logger):
    """Scalars and the config (hparams plugin and a text summary) in one event directory."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, config: Mapping[str, Any], fresh: bool) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.logdir = tensorboard_dir(run_dir)
        if fresh and self.logdir.exists():  # a run started over: its old events would repeat steps
            _check_tensorboard_dir(self.logdir, run_dir)
            shutil.rmtree(self.logdir)
        claim_logger_dir(self.logdir)
        self.writer = SummaryWriter(log_dir=str(self.logdir))
        if fresh:
            params = flat_params(config)
            for summary in hparams(params, {}):
                self.writer.file_writer.add_summary(summary)
            text = "\n".join(f"    {k}: {v}" for k, v in params.items())
            self.writer.add_text("config", text, 0)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, figures: Sequence[Path], finished: bool) -> None:
        if finished:
            import matplotlib.image

            for path in figures:
                image = matplotlib.image.imread(path)[..., :3]  # (H, W, 3)
                self.writer.add_image(f"figures/{path.stem}", image, dataformats="HWC")
        self.writer.close()


class MLflowLogger(Logger):
    """One MLflow run per run directory (a sweep's points: children of the sweep's parent run)."""

    name = "mlflow"

    def __init__(self, run_dir: Path, config: Mapping[str, Any], record: Mapping[str, Any]) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        sweep = sweep_of(run_dir)
        root = (sweep[0] if sweep else run_dir) / "mlflow"
        uri = os.environ.get("MLFLOW_TRACKING_URI") or record.get("tracking_uri")
        if not uri:
            claim_logger_dir(root)
            uri = f"sqlite:///{root / 'mlflow.db'}"
        self.uri, self.client = uri, MlflowClient(tracking_uri=uri)
        experiment = sweep[1] if sweep else str(config.get("name", run_dir.name))
        params = flat_params(config)
        self.run_id = record.get("run_id")
        if self.run_id is None:
            exp = self.client.get_experiment_by_name(experiment)
            exp_id = (
                exp.experiment_id
                if exp is not None
                else self.client.create_experiment(
                    experiment, artifact_location=(root / "artifacts").as_uri()
                )
            )
            tags = {"hpcfl.run_dir": str(run_dir.resolve())}
            if sweep:
                tags["mlflow.parentRunId"] = self._parent(exp_id, sweep[1], sweep[0])
            run = self.client.create_run(exp_id, tags=tags, run_name=run_dir.name)
            self.run_id = run.info.run_id
            known: dict[str, str] = {}
        else:
            known = self.client.get_run(self.run_id).data.params
            self.client.update_run(self.run_id, status="RUNNING")
        new = [Param(k, v[:6000]) for k, v in params.items() if k not in known]
        for i in range(0, len(new), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=new[i : i + 100])
        changed = {f"resumed_with.{k}": v[:5000] for k, v in params.items() if k in known and known[k] != v}
        for key, value in changed.items():  # a resumable key changed: MLflow params never change
            self.client.set_tag(self.run_id, key, value)

    def _parent(self, exp_id: str, sweep_name: str, sweep_dir: Path) -> str:
        """The sweep's parent run, created once (a lock file orders parallel points)."""
        import fcntl

        with open(sweep_dir / "mlflow" / "parent.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            found = self.client.search_runs(
                [exp_id], filter_string="tags.`hpcfl.sweep_parent` = 'true'", max_results=1
            )
            if found:
                return found[0].info.run_id
            run = self.client.create_run(exp_id, tags={"hpcfl.sweep_parent": "true"}, run_name=sweep_name)
            return run.info.run_id

    def held_through(self, through: int, pending: int) -> int:
        """The last round up to ``pending`` this run holds (a killed flush's rounds are settled by
        what the store has: one ``log_batch`` per round, so a round is there whole or not at all)."""
        steps = {m.step for m in self.client.get_metric_history(self.run_id, "time/seconds")}
        return max((s for s in steps if through < s <= pending), default=through)  # written in order

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in scalars.items()]
        # MLflow takes at most 1000 metrics a batch; "time/seconds" (every row has it) goes last, so
        # a round whose last batch is stored is whole (held_through)
        metrics.sort(key=lambda m: m.key == "time/seconds")
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self, figures: Sequence[Path], finished: bool) -> None:
        if finished:
            for path in figures:
                self.client.log_artifact(self.run_id, str(path), "figures")
            self.client.set_terminated(self.run_id, "FINISHED")
        else:
            self.client.set_terminated(self.run_id, "KILLED")

    def record(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "tracking_uri": self.uri}


class WandbLogger(Logger):
    """One W&B run per run directory (offline unless ``WANDB_MODE`` is set); a sweep is a group.

    Offline, every invocation of the run is one segment (``RUN/wandb/offline-run-<time>-<id>``,
    W&B's own choice: it does not resume an offline run in place); ``loggers.json`` lists them and
    the one ``wandb sync`` command that uploads them as one run (see the module docstring)."""

    name = "wandb"
    # W&B's service process writes the offline transaction log behind the caller: a killed run can
    # lose rows it logged, so they count as written only once the run closed; a resume after a kill
    # first reads what the killed segment holds (held_through) and logs the rest
    durable_log = False

    def __init__(self, run_dir: Path, config: Mapping[str, Any], record: Mapping[str, Any]) -> None:
        import wandb

        sweep = sweep_of(run_dir)
        self.run_id = record.get("run_id") or secrets.token_hex(4)
        self.project = os.environ.get("WANDB_PROJECT", "hpcfl")
        self.mode = os.environ.get("WANDB_MODE", "offline")
        claim_logger_dir(run_dir / "wandb")
        self.run = wandb.init(
            project=self.project,
            dir=str(run_dir),
            id=self.run_id,
            name=str(config.get("name", run_dir.name)),
            group=sweep[1] if sweep else None,
            config=dict(config),
            mode=self.mode,  # type: ignore[arg-type]
            resume="allow",
            reinit="create_new",
        )
        segment = Path(self.run.dir).parent.name  # RUN/wandb/<segment>/files
        earlier = [s for s in record.get("segments", []) if s != segment]
        self.segments = [*earlier, segment] if self.mode == "offline" else []

    @staticmethod
    def held_through(run_dir: Path, run_id: str, through: int) -> int:
        """The last round after ``through`` that the offline segments of ``run_id`` already hold
        without a gap (their transaction logs read back; a record a kill tore is not counted), so a
        resumed run writes each round into exactly one segment."""
        steps = {
            int(step)
            for path in (run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
            for step in wandb_steps(path)
        }
        while through + 1 in steps:
            through += 1
        return through

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self, figures: Sequence[Path], finished: bool) -> None:
        import wandb

        if finished and figures:
            self.run.log({f"figures/{p.stem}": wandb.Image(str(p)) for p in figures})
        self.run.finish(exit_code=0 if finished else 1)

    def record(self) -> dict[str, Any]:
        if not self.segments:
            return {"run_id": self.run_id}
        paths = " ".join(f"wandb/{s}" for s in self.segments)
        return {
            "run_id": self.run_id,
            "segments": self.segments,
            "sync": f"wandb sync --id {self.run_id} -p {self.project} {paths}",  # from the run directory
        }


def wandb_records(path: Path) -> list[Any]:
    """The records of one W&B transaction log (``run-<id>.wandb``), decoded with W&B's own protobuf
    classes (leveldb log format: 7-byte header, 32 KiB blocks; a record a kill tore is left out)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, records, pending = path.read_bytes(), [], b""
    pos = 7  # the file's own header
    while pos + 7 <= len(data):
        block_left = 32768 - pos % 32768
        if block_left < 7:
            pos += block_left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        if len(chunk) < length:  # cut short by a kill
            break
        pending += chunk
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(pending)
            except Exception:  # noqa: BLE001  # a torn record: what follows is not trusted either
                break
            records.append(record)
            pending = b""
    return records


def wandb_steps(path: Path) -> list[int]:
    """The steps of the history rows of one W&B transaction log, in the order written."""
    steps = []
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                if item.key == "_step":
                    steps.append(int(json.loads(item.value_json)))
    return steps


class Loggers:
    """The run's loggers on rank 0: each writes the rows after the last round it wrote."""

    def __init__(
        self,
        loggers: list[Logger],
        run_dir: Path,
        through: dict[str, int],
        others: Mapping[str, Any] | None = None,
    ) -> None:
        self.loggers, self.run_dir, self.through = loggers, run_dir, through
        self.others = dict(others or {})  # records of loggers not configured now (kept for a later resume)
        self.durable = dict(through)  # what loggers.json says each logger holds for sure
        self.pending: dict[str, int] = {}  # rounds being written now (a kill leaves them in doubt)

    def flush(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Write every row a logger has not written yet (rows a checkpoint covers), then record it.

        ``loggers.json`` names the rounds about to be written first (``pending``), so a kill in the
        middle leaves a record of which rounds are in doubt (see :func:`open_loggers`)."""
        rows = list(rows)
        last = max((int(r["round"]) for r in rows), default=0)
        behind = [lg for lg in self.loggers if last > self.through.get(lg.name, 0)]
        if not behind:
            return
        self.pending = {lg.name: last for lg in behind if lg.durable_log}
        if self.pending:
            self._save()
        for logger in self.loggers:
            seen = self.through.get(logger.name, 0)
            for row in rows:
                if int(row["round"]) > seen:
                    logger.log(int(row["round"]), scalar_names(row))
                    seen = int(row["round"])
            self.through[logger.name] = seen
            if logger.durable_log:
                self.durable[logger.name] = seen
        self.pending = {}
        self._save()

    def close(self, finished: bool) -> None:
        """Attach the run's figures (when it finished) and close every logger."""
        figures = sorted(self.run_dir.glob("*.png")) + sorted((self.run_dir / "plots").glob("*.png"))
        for logger in self.loggers:
            logger.close(figures, finished)
            self.durable[logger.name] = self.through.get(logger.name, 0)  # closed: all of it is written
        self._save()
        self.loggers = []

    def _save(self) -> None:
        state = dict(self.others) | {
            lg.name: {
                "through": self.durable.get(lg.name, 0),
                **({"pending": self.pending[lg.name]} if lg.name in self.pending else {}),
                **lg.record(),
            }
            for lg in self.loggers
        }
        atomic_write_text(self.run_dir / STATE, json.dumps(state, indent=1) + "\n")


def open_loggers(names: Sequence[str], run_dir: Path, config: Mapping[str, Any]) -> Loggers:
    """Open (or, after a resume, continue) the configured loggers of ``run_dir`` (rank 0 only).

    Rounds a kill left in doubt (``pending`` beyond ``through`` in ``loggers.json``: the process
    died while writing them) are settled from the backend itself: TensorBoard's directory is
    written again from ``metrics.jsonl`` (its event files cannot drop a step), MLflow's run is
    asked which of those rounds it holds; W&B offline (whose rows are durable only once its run
    closed) is asked what its earlier segments' transaction logs hold."""
    run_dir = Path(run_dir)
    try:
        saved = json.loads((run_dir / STATE).read_text())
    except (OSError, ValueError):
        saved = {}
    made: list[Logger] = []
    through: dict[str, int] = {}
    for name in names:
        record = saved.get(name, {})
        done, doubt = (
            int(record.get("through", 0)),
            int(record.get("pending", 0)) > int(record.get("through", 0)),
        )
        if name == "tensorboard":
            made.append(TensorBoardLogger(run_dir, config, fresh=not record or doubt))
            done = 0 if doubt else done
        elif name == "mlflow":
            logger = MLflowLogger(run_dir, config, record)
            done = logger.held_through(done, int(record["pending"])) if doubt else done
            made.append(logger)
        else:
            if record and os.environ.get("WANDB_MODE", "offline") == "offline":
                done = WandbLogger.held_through(run_dir, record["run_id"], done)
            made.append(WandbLogger(run_dir, config, record))
        through[name] = done
    loggers = Loggers(made, run_dir, through, {k: v for k, v in saved.items() if k not in names})
    loggers._save()  # the runs' ids, before any row: a kill now still resumes the same runs
    return loggers


__all__ = ["STATE", "Loggers", "check_loggers", "open_loggers", "scalar_names"]
