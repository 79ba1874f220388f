"""One line per run directory: its numbers as a markdown and a CSV table (secondary to the
per-method table of :mod:`hpcfl.report.methods`: a single round's accuracy is no headline)."""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from pathlib import Path

from hpcfl.errors import RunDirError
from hpcfl.files import read_yaml
from hpcfl.rows import read_client_rows, read_metrics_rows


@dataclass
class RunSummary:
    """The headline numbers of one run directory."""

    name: str
    algorithm: str
    partition: str
    rounds: int
    final_accuracy: float
    best_accuracy: float
    seconds: float  # Σ of the logged rounds' seconds (no stage setup; unlogged rounds not counted)
    rows: list[dict]
    participation: str = "all"  # "all", or "M of K (each client trained a..b times)"
    form: str | None = None  # the form the algorithm ran in (SCAFFOLD's control_variates/one_model)
    config: dict = field(default_factory=dict)  # the run's config.yaml, as written
    final_clients: dict | None = None  # the last line of client_metrics.jsonl (client_eval), if any

    @property
    def wall_seconds(self) -> float | None:
        """The whole run's wall time: the last row's ``wall_s`` (None for runs that predate it)."""
        return float(self.rows[-1]["wall_s"]) if all("wall_s" in r for r in self.rows) else None

    @property
    def stage_seconds(self) -> dict[str, float]:
        """Each stage's time, its setup included (TCT's stage 2: the eNTK feature extraction): the
        run's wall clock from the previous stage's last row to this stage's last row (the first
        stage from the start, data loading included). Runs that predate ``wall_s``: the stage's
        round seconds plus its ``stage_setup_s``."""
        stages: dict[str, float] = {}
        if self.wall_seconds is not None:
            before = 0.0
            for row in self.rows:
                stages[_stage(row)] = float(row["wall_s"]) - before + stages.get(_stage(row), 0.0)
                before = float(row["wall_s"])
            return stages
        for row in self.rows:
            spent = float(row.get("seconds", 0.0)) + float(row.get("stage_setup_s", 0.0))
            stages[_stage(row)] = stages.get(_stage(row), 0.0) + spent
        return stages

    @property
    def setup_seconds(self) -> dict[str, float]:
        """Per stage, the seconds its entry took (``stage_setup_s``: TCT's eNTK extraction and
        problem build), for the stages that have one."""
        setup: dict[str, float] = {}
        for row in self.rows:
            if "stage_setup_s" in row:
                setup[_stage(row)] = setup.get(_stage(row), 0.0) + float(row["stage_setup_s"])
        return setup

    def time_text(self) -> str:
        """``stage1 12.3 + stage2 45.6 (setup 40.1)``; a one-stage run just ``12.3``."""
        stages, setup = self.stage_seconds, self.setup_seconds
        parts = [
            (f"{name} " if len(stages) > 1 else "")
            + f"{s:.1f}"
            + (f" (setup {setup[name]:.1f})" if name in setup else "")
            for name, s in stages.items()
        ]
        return " + ".join(parts)

    @property
    def label(self) -> str:
        """The algorithm with the form it actually used, ``scaffold (control_variates)``, and the
        privacy it was trained under, ``fedavg [client-level DP, ε=3.00 at δ=1e-05]``."""
        label = f"{self.algorithm} ({self.form})" if self.form else self.algorithm
        return f"{label} [{self.privacy}]" if self.privacy else label

    @property
    def privacy(self) -> str | None:
        """The run's differential privacy as its last row accounted it (None: not private)."""
        section = self.config.get("privacy")
        level = section.get("level", "none") if isinstance(section, dict) else "none"
        eps = next((r["epsilon"] for r in reversed(self.rows) if "epsilon" in r), None)
        if level == "none" or eps is None:
            return None
        return f"{level}-level DP, {epsilon_text(float(eps))} at δ={section.get('delta', 1e-5):g}"


def epsilon_text(eps: float) -> str:
    """``ε=3.00``; a positive ε below 0.005 keeps two significant digits (``ε=0.0012``), never
    ``ε=0.00``; ε = 0 says that no private step was taken (the model never trained: a run that
    trains without a private step is refused, :meth:`hpcfl.privacy.private.Private.seal`)."""
    if eps == 0:
        return "ε=0 (no private step taken)"
    return f"ε={eps:.2f}" if eps >= 0.005 else f"ε={eps:.2g}"


def summarise(run_dir: Path) -> RunSummary:
    """Read one run directory's config and metrics."""
    run_dir = Path(run_dir)
    rows = read_metrics_rows(run_dir / "metrics.jsonl")
    if not (run_dir / "config.yaml").exists() or not rows:
        raise RunDirError(f"{run_dir} holds no finished round (no config.yaml or empty metrics.jsonl)")
    cfg = read_yaml(run_dir / "config.yaml")
    return RunSummary(
        name=str(cfg.get("name", run_dir.name)),
        algorithm=str(cfg.get("algorithm")),
        partition=str(cfg.get("partition")),
        rounds=int(rows[-1]["round"]),
        final_accuracy=float(rows[-1]["test_accuracy"]),
        best_accuracy=max(float(r["test_accuracy"]) for r in rows),
        seconds=sum(float(r.get("seconds", 0.0)) for r in rows),
        rows=rows,
        participation=_participation(cfg, rows),
        form=recorded_form(cfg, rows),
        config=cfg,
        final_clients=_final_clients(run_dir),
    )


def _stage(row: dict) -> str:
    return str(row.get("stage", "main"))


def _final_clients(run_dir: Path) -> dict | None:
    """Per-client values of the last evaluated round ({id: {accuracy, loss, n, ...}}), or None."""
    rows = read_client_rows(run_dir / "client_metrics.jsonl")
    return rows[-1]["clients"] if rows else None


def recorded_form(cfg: dict, rows: list[dict]) -> str | None:
    """The form the run used: what its metrics rows record (``<algorithm>_form``, e.g. SCAFFOLD's
    ``scaffold_form``, the form ``auto`` resolved to; or ``form``), else ``params.form`` of its
    config.yaml; None when neither says (algorithms with one form)."""
    keys = (f"{cfg.get('algorithm')}_form", "form")
    for row in reversed(rows):
        for key in keys:
            if isinstance(row.get(key), str) and row[key]:
                return row[key]
    params = cfg.get("params")
    form = params.get("form") if isinstance(params, dict) else None
    return None if form is None else str(form)


def _participation(cfg: dict, rows: list[dict]) -> str:
    """Who trained: every client every round, or M of K per round with how often each trained
    (counted over the rounds that wrote a metrics row; every round when eval_every is 1)."""
    drawn = [r["participants"] for r in rows if "participants" in r]
    if not drawn:
        return "all"
    K = int(cfg.get("num_clients", 0)) or 1 + max(k for who in drawn for k in who)
    times = [0] * K
    for who in drawn:
        for k in who:
            times[k] += 1
    return f"{len(drawn[-1])} of {K} (each trained {min(times)}..{max(times)}× in {len(drawn)} logged rounds)"


def markdown_table(runs: list[RunSummary]) -> str:
    """A markdown table with one line per run (single-round numbers: final and best)."""
    lines = [
        "| run | algorithm | partition | participants per round | rounds | final test acc. | best test acc. "
        "| time per stage, setup included (s) | wall time of the run (s) |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        wall = "—" if r.wall_seconds is None else f"{r.wall_seconds:.1f}"
        lines.append(
            f"| {r.name} | {r.label} | {r.partition} | {r.participation} | {r.rounds} | {100 * r.final_accuracy:.2f}% "
            f"| {100 * r.best_accuracy:.2f}% | {r.time_text()} | {wall} |"
        )
    return "\n".join(lines) + "\n"


def csv_table(runs: list[RunSummary]) -> str:
    """The markdown table's numbers, one line per run (``seconds``: Σ of the logged rounds' seconds;
    ``stage_seconds`` and ``setup_seconds``: ``stage:seconds`` pairs; ``wall_seconds``: the run's)."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(
        ["run", "algorithm", "form", "partition", "rounds", "final_test_accuracy", "best_test_accuracy",
         "seconds", "stage_seconds", "setup_seconds", "wall_seconds"]
    )  # fmt: skip
    for r in runs:
        stages = " ".join(f"{k}:{v:.3f}" for k, v in r.stage_seconds.items())
        setup = " ".join(f"{k}:{v:.3f}" for k, v in r.setup_seconds.items())
        writer.writerow(
            [r.name, r.algorithm, r.form or "", r.partition, r.rounds, r.final_accuracy, r.best_accuracy,
             r.seconds, stages, setup, "" if r.wall_seconds is None else r.wall_seconds]
        )  # fmt: skip
    return buf.getvalue()
