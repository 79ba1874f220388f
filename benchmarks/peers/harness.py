"""The peers harness: the same FedAvg experiment through hpcfl and its peers, interleaved, one table.

    PYTHONPATH=. python benchmarks/peers/harness.py                  # the full run -> benchmarks/results/
    PYTHONPATH=. python benchmarks/peers/harness.py --frameworks hpcfl flower --seeds 0 --rounds 5
                                                                     # a smoke run -> bench-out/peers/results/

Runs in hpcfl's venv. Builds the experiment bundle if it is missing (experiment.py), then runs every
(framework, mode) once per seed as its own subprocess with the framework's own venv
(``.peers/NAME/bin/python``; hpcfl: this Python), seeds outermost so that the frameworks interleave
(A B C D, A B C D, ...). A peer without an environment is refused before anything runs, in one
line naming the command that builds it; a peer whose environment failed to build
(``.peers/NAME/FAILED``), or whose run fails, gets one row saying what failed. Each run writes its
record (peer_common.write_record); the load (/proc/loadavg) is taken before and after each run.

Outputs ``peers_cpu.{json,csv,md,png}``: one row per framework, mode and seed; a summary per
framework and mode (mean ± std over seeds, the ratio of its seconds per round to hpcfl's, its
accuracy difference from hpcfl's and whether it is within max(2 points, 2 × pooled std)); test
accuracy against wall time. Only the full default run writes ``benchmarks/results/``; any option
that narrows it writes ``bench-out/peers/results/`` unless ``--out`` says otherwise.

``--combine DIR [DIR ...]`` runs nothing: it joins the records of earlier invocations (each DIR's
``peers_<device>.json``, e.g. every framework's default mode over 3 seeds and the parallel modes
over 1) into one table, with each invocation's conditions kept beside it.

``--algorithms`` (issue 60, item 5; default ``fedavg``): hpcfl's server optimisers beside Flower's
strategies of the same name (fedadam, fedyogi, fedadagrad, fedavgm), each at Flower's defaults;
only the runners that define ``ALGORITHMS`` run them (hpcfl, Flower), and without ``--modes`` each
runs in its default mode (the comparison is accuracy; the modes' speed is FedAvg's table). The
summary then groups by algorithm, each against hpcfl's run of the same algorithm, and the outputs
are ``peers_server_opt_cpu.{json,csv,md,png}`` (``benchmarks/results/`` only for the full run,
``--algorithms fedadam fedyogi fedadagrad fedavgm`` with nothing else narrowed)::

    PYTHONPATH=. python benchmarks/peers/harness.py --algorithms fedadam fedyogi fedadagrad fedavgm
"""

from __future__ import annotations

import argparse
import ast
import csv
import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

FRAMEWORKS = ("hpcfl", "flower", "pfl", "blazefl", "fedlab")
SERVER_OPTIMISERS = ("fedadam", "fedyogi", "fedadagrad", "fedavgm")
ALGORITHMS = ("fedavg", *SERVER_OPTIMISERS)
ALGORITHM_NAMES = {
    "fedavg": "FedAvg",
    "fedadam": "FedAdam",
    "fedyogi": "FedYogi",
    "fedadagrad": "FedAdagrad",
    "fedavgm": "FedAvgM",
}
#: what hpcfl's server optimisers do differently from Flower's at the same parameters (run_hpcfl.py)
SERVER_OPT_NOTES = (
    "Both sides at Flower 1.42's defaults (FedAdam eta 0.1, beta1 0.9, beta2 0.99, tau 1e-3; FedYogi eta 0.01, "
    "beta1 0.9, beta2 0.99, tau 1e-3; FedAdagrad eta 0.1, beta1 0, tau 1e-3; FedAvgM server lr 1, momentum 0, "
    "which is FedAvg's step), clients at the bundle's lr (Flower's eta_l is stored, never sent to a client). "
    "What hpcfl does differently at those parameters: its adaptive methods start the second moment at "
    "v = tau^2 (Reddi et al.'s Algorithm 2), Flower's at 0; Flower's FedAdam scales eta by the bias correction "
    "sqrt(1 - beta2^(t+1)) / (1 - beta1^(t+1)), hpcfl's does not. Given Flower's v and eta_t, both server steps "
    "give the same model to 1e-6 (benchmarks/peers/server_opt_check.py, tests/test_server_opt_flower.py)."
)
REFERENCE = ("hpcfl", "1proc")  # ratios and accuracy differences are taken against it
FULL_OUT = REPO / "benchmarks" / "results"
SMOKE_OUT = REPO / "bench-out" / "peers" / "results"
ACC_TOLERANCE = 0.02  # 2 points
METRICS = (
    "seconds_per_round",
    "seconds_per_round_with_eval",
    "samples_per_s",
    "peak_rss_mb",
    "final_accuracy",
    "startup_s",
)
"""A run's figures: a row's columns and the summary's means ± std."""


class HarnessError(Exception):
    """A refusal: one line, exit 2."""


def peers_dir() -> Path:
    return Path(os.environ.get("PEERS_DIR", REPO / ".peers"))


def runner_path(framework: str) -> Path:
    return HERE / f"run_{framework}.py"


def _runner_literal(framework: str, name: str) -> Any:
    """The value of the runner's top-level literal ``name`` (read, not imported: the runner needs
    its own venv); None when it has none."""
    path = runner_path(framework)
    if not path.is_file():
        raise HarnessError(f"framework {framework!r} has no runner ({path.relative_to(REPO)} is missing)")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
    return None


def runner_modes(framework: str) -> dict[str, str]:
    """The runner's ``MODES`` literal."""
    modes = _runner_literal(framework, "MODES")
    if isinstance(modes, dict) and modes:
        return {str(k): str(v) for k, v in modes.items()}
    raise HarnessError(f"{runner_path(framework).relative_to(REPO)} defines no MODES dict")


def runner_algorithms(framework: str) -> tuple[str, ...]:
    """The algorithms the runner takes as ``--algorithm`` (its ``ALGORITHMS`` literal; without
    one, FedAvg only)."""
    algorithms = _runner_literal(framework, "ALGORITHMS")
    return tuple(str(a) for a in algorithms) if algorithms else ("fedavg",)


def framework_python(framework: str) -> tuple[Path | None, str | None]:
    """(the Python that runs the framework's runner, or None; why not, when its env failed to build).
    A framework with no environment at all is a HarnessError naming the command that builds it."""
    if framework == "hpcfl":
        return Path(sys.executable), None
    env = peers_dir() / framework
    if (env / "READY").is_file() and (env / "bin" / "python").exists():
        return env / "bin" / "python", None
    if (env / "FAILED").is_file():
        return None, "environment did not build: " + (env / "FAILED").read_text().strip().splitlines()[-1]
    raise HarnessError(
        f"peer {framework!r} has no environment: run `bash benchmarks/peers/setup.sh {framework}`"
    )


def choose_modes(framework: str, wanted: list[str], device: str = "cpu") -> list[str]:
    """The framework's modes on ``device`` named by ``wanted`` (``all``, ``default``, KEY or
    FRAMEWORK:KEY); a mode whose key starts with ``cuda`` is a GPU mode."""
    modes = [m for m in runner_modes(framework) if m.startswith("cuda") == (device == "cuda")]
    if not modes:
        return []
    if "all" in wanted:
        return modes
    chosen = [m for m in modes if m in wanted or f"{framework}:{m}" in wanted]
    if "default" in wanted and modes[0] not in chosen:
        chosen.insert(0, modes[0])
    return chosen


def make_plan(
    frameworks: list[str], algorithms: list[str], wanted_modes: list[str] | None, device: str, explicit: bool
) -> list[tuple[str, str, str]]:
    """(algorithm, framework, mode) in the order they run for each seed; refuses (HarnessError)
    before anything runs. A framework named by ``--frameworks`` must run every asked algorithm;
    by default the frameworks whose runner has one run it (the others are FedAvg's). Without
    ``--modes``, FedAvg runs in every mode and a server optimiser in the framework's default."""
    plan: list[tuple[str, str, str]] = []
    for algorithm in algorithms:
        for fw in frameworks:
            if algorithm not in runner_algorithms(fw):
                if explicit:
                    raise HarnessError(
                        f"framework {fw!r} runs {', '.join(runner_algorithms(fw))} only, not {algorithm}"
                    )
                continue
            framework_python(fw)
            wanted = wanted_modes or (["all"] if algorithm == "fedavg" else ["default"])
            modes = choose_modes(fw, wanted, device)
            if not modes:
                raise HarnessError(
                    f"none of the modes {wanted} is a {device} mode of {fw} ({', '.join(runner_modes(fw))})"
                )
            plan += [(algorithm, fw, m) for m in modes]
    if not plan:
        raise HarnessError(f"no framework among {', '.join(frameworks)} runs {', '.join(algorithms)}")
    return plan


def loadavg() -> list[float]:
    try:
        return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


# ---------------------------------------------------------------------------------------- one run
def run_one(
    framework: str,
    mode: str,
    seed: int,
    rounds: int,
    experiment: Path,
    out: Path,
    timeout: float,
    algorithm: str = "fedavg",
) -> dict[str, Any]:
    """Run one (framework, mode, seed, algorithm) and return its record (a failed one if it wrote none)."""
    python, why = framework_python(framework)
    base = {
        "framework": framework,
        "version": None,
        "mode": runner_modes(framework)[mode],
        "mode_key": mode,
        "algorithm": algorithm,
        "seed": seed,
    }
    if python is None:
        return {**base, "status": "failed", "error": why}
    stem = f"{framework}_{mode}_{seed}" if algorithm == "fedavg" else f"{framework}_{algorithm}_{mode}_{seed}"
    record_path = out / "records" / f"{stem}.json"
    log_path = out / "logs" / f"{stem}.log"
    for p in (record_path, log_path):
        p.parent.mkdir(parents=True, exist_ok=True)
    record_path.unlink(missing_ok=True)
    cmd = [str(python), str(runner_path(framework)), "--experiment", str(experiment), "--seed", str(seed)]
    cmd += ["--mode", mode, "--rounds", str(rounds), "--out", str(record_path)]
    if algorithm != "fedavg":
        cmd += ["--algorithm", algorithm]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    if framework == "hpcfl":
        env["PYTHONPATH"] = str(REPO)
    before, t0 = loadavg(), time.perf_counter()
    error = None
    with open(log_path, "wb") as log:
        try:
            subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            error = f"no record within the {timeout:.0f} s timeout"
    wall = time.perf_counter() - t0
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        tail = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()][-1:] or [""]
        record = {
            **base,
            "status": "failed",
            "error": error or f"the runner wrote no record ({tail[0][:200]})",
        }
    record.update(
        {"load_before": before, "load_after": loadavg(), "process_wall_s": wall, "log": str(log_path)}
    )
    return record


# -------------------------------------------------------------------------------------- the tables
def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def row_of(record: dict[str, Any]) -> dict[str, Any]:
    """The table row of one record: medians of rounds 2..R, the last-3-evaluations accuracy."""
    row = {k: record.get(k) for k in ("framework", "version", "mode", "mode_key", "seed", "status", "error")}
    row["algorithm"] = record.get("algorithm") or "fedavg"  # records from before item 5 are FedAvg's
    round_s, with_eval = record.get("round_s") or [], record.get("round_eval_s") or []
    samples = record.get("samples_per_round") or []
    evals = record.get("eval") or []
    ok = record.get("status") == "ok" and len(round_s) > 1
    later = round_s[1:] if ok else []
    row.update(
        {
            "seconds_per_round": statistics.median(later) if later else None,
            # the mean over rounds 2..R: each evaluation's cost spread over the rounds it covers
            "seconds_per_round_with_eval": _mean(with_eval[1:]) if ok and len(with_eval) > 1 else None,
            "samples_per_s": sum(samples[1:]) / sum(later) if later and sum(later) > 0 else None,
            "peak_rss_mb": record.get("peak_rss_mb") if ok else None,
            "final_accuracy": _mean([e["accuracy"] for e in evals[-3:]]) if ok and evals else None,
            "startup_s": record.get("startup_s") if ok else None,
            "rounds": len(round_s),
            "load_before": record.get("load_before"),
            "load_after": record.get("load_after"),
        }
    )
    return row


def _stats(xs: list[float]) -> tuple[float | None, float | None]:
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean ± std over seeds per (algorithm, framework, mode), the ratio to hpcfl's seconds per round
    and the accuracy difference from hpcfl's (within max(2 points, 2 × pooled std)), each against
    hpcfl's run of the same algorithm."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r.get("algorithm") or "fedavg", r["framework"], r["mode_key"]), []).append(r)
    out = []
    for (algorithm, fw, mode), rs in groups.items():
        good = [r for r in rs if r["status"] == "ok"]
        s: dict[str, Any] = {
            "algorithm": algorithm,
            "framework": fw,
            "mode_key": mode,
            "mode": rs[0]["mode"],
            "version": rs[0]["version"],
        }
        s["seeds"], s["failed"] = len(good), len(rs) - len(good)
        s["error"] = next((r["error"] for r in rs if r["status"] != "ok"), None)
        for key in METRICS:
            s[key], s[key + "_std"] = _stats([r[key] for r in good if r[key] is not None])
        out.append(s)
    refs = {s["algorithm"]: s for s in out if (s["framework"], s["mode_key"]) == REFERENCE and s["seeds"]}
    for s in out:
        s["ratio_to_hpcfl"] = s["accuracy_diff"] = s["accuracy_tolerance"] = s["accuracy_within"] = None
        ref = refs.get(s["algorithm"])
        if ref is None or not s["seeds"]:
            continue
        if s["seconds_per_round"] and ref["seconds_per_round"]:
            s["ratio_to_hpcfl"] = s["seconds_per_round"] / ref["seconds_per_round"]
        if s["final_accuracy"] is not None and ref["final_accuracy"] is not None:
            pooled = ((s["final_accuracy_std"] ** 2 + ref["final_accuracy_std"] ** 2) / 2) ** 0.5
            s["accuracy_diff"] = s["final_accuracy"] - ref["final_accuracy"]
            s["accuracy_tolerance"] = max(ACC_TOLERANCE, 2 * pooled)
            s["accuracy_within"] = abs(s["accuracy_diff"]) <= s["accuracy_tolerance"]
    return out


ROW_COLUMNS = ("framework", "version", "mode", "seed", "status", *METRICS, "error")


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _pm(s: dict[str, Any], key: str, digits: int = 3, scale: float = 1.0) -> str:
    if s[key] is None:
        return "—"
    return f"{s[key] * scale:.{digits}g} ± {s[key + '_std'] * scale:.2g}"


def server_opt_doc(doc: dict[str, Any]) -> bool:
    """Whether ``doc`` holds a server optimiser's runs (the item-5 table)."""
    return any((r.get("algorithm") or "fedavg") != "fedavg" for r in doc["rows"])


def markdown(doc: dict[str, Any]) -> str:
    c = doc["conditions"]
    opt = server_opt_doc(doc)
    algo_col = "algorithm | " if opt else ""
    lines = [
        "# Server optimisers at Flower's defaults: hpcfl and Flower (CPU)"
        if opt
        else "# FedAvg on the same experiment: hpcfl and its peers (CPU)",
        "",
        f"{c['experiment']}. {c['machine']}. Load (1-min loadavg) {c['load_start']} at the start, "
        f"{c['load_end']} at the end; rounds {c['rounds']}, seeds {c['seeds']}, interleaved.",
        *(["", SERVER_OPT_NOTES] if opt else []),
        "",
        f"| {algo_col}framework | mode | version | seeds | s/round (train+agg) | s/round incl. eval | samples/s "
        "| peak RSS MB | final acc % | startup s | ratio to hpcfl | acc diff (pts) | within tol |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if opt else ""),
    ]
    for s in doc["summary"]:
        algo = f"{s['algorithm']} | " if opt else ""
        if not s["seeds"]:
            lines.append(
                f"| {algo}{s['framework']} | {s['mode']} | {_fmt(s['version'])} | 0 | failed: {s['error']} |||||||||"
            )
            continue
        diff = (
            "—"
            if s["accuracy_diff"] is None
            else f"{100 * s['accuracy_diff']:+.2f} (±{100 * s['accuracy_tolerance']:.2f})"
        )
        within = "—" if s["accuracy_within"] is None else ("yes" if s["accuracy_within"] else "**no**")
        lines.append(
            f"| {algo}{s['framework']} | {s['mode']} | {_fmt(s['version'])} | {s['seeds']} | {_pm(s, 'seconds_per_round')} "
            f"| {_pm(s, 'seconds_per_round_with_eval')} | {_pm(s, 'samples_per_s', 4)} | {_pm(s, 'peak_rss_mb', 4)} "
            f"| {_pm(s, 'final_accuracy', 4, 100)} | {_pm(s, 'startup_s')} | {_fmt(s['ratio_to_hpcfl'])} | {diff} | {within} |"
        )
    lines += [
        "",
        "s/round: median of rounds 2..R (training and aggregation); incl. eval: the mean of rounds 2..R with the "
        "evaluation every 5 rounds; ratio to hpcfl: the framework's s/round over hpcfl's (1 process), > 1 = hpcfl "
        "faster; final acc: the mean of the last 3 evaluations; tolerance max(2 points, 2 x pooled std)"
        + ("; each algorithm against hpcfl's run of the same algorithm." if opt else "."),
        "",
        "## Runs",
        "",
    ]
    columns = ("algorithm", *ROW_COLUMNS) if opt else ROW_COLUMNS
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in doc["rows"]:
        lines.append("| " + " | ".join(_fmt(r[k], 4) for k in columns) + " |")
    notes = {
        (r["framework"], r.get("mode"), r.get("algorithm") or "fedavg"): r.get("notes")
        for r in doc["records"]
        if r.get("notes")
    }
    if notes:
        lines += ["", "## Notes from the runners", ""]
        lines += [
            f"- **{fw}**, {mode}{f', {algo}' if opt else ''}: {note}"
            for (fw, mode, algo), note in notes.items()
        ]
    return "\n".join(lines) + "\n"


def write_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(
        buf,
        fieldnames=[*ROW_COLUMNS, "mode_key", "algorithm", "load_before", "load_after"],
        extrasaction="ignore",
    )
    w.writeheader()
    for r in rows:
        w.writerow({k: (json.dumps(v) if isinstance(v, list) else v) for k, v in r.items()})
    return buf.getvalue()


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """Test accuracy against wall time (start-up included) for every run; one panel per algorithm."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from hpcfl.files import save_figure

    algorithms = list(dict.fromkeys(r.get("algorithm") or "fedavg" for r in records)) or ["fedavg"]
    fig = Figure(figsize=(8 if len(algorithms) == 1 else 5 * len(algorithms), 5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(algorithms), squeeze=False)[0]
    colors: dict[tuple[str, str], str] = {}
    for algorithm, ax in zip(algorithms, axes, strict=True):
        _plot_panel(ax, [r for r in records if (r.get("algorithm") or "fedavg") == algorithm], colors)
        ax.set_title(
            "FedAvg, Fashion-MNIST dir:0.5, 100 clients, 10 per round"
            if algorithms == ["fedavg"]
            else f"{algorithm} at Flower's defaults"
        )
    save_figure(fig, path, dpi=110, fmt="png")


def _plot_panel(ax: Any, records: list[dict[str, Any]], colors: dict[tuple[str, str], str]) -> None:
    """One panel of :func:`plot`: each run's accuracy against its wall time, a colour per
    framework and mode (shared by the panels)."""
    for rec in records:
        if rec.get("status") != "ok" or not rec.get("eval"):
            continue
        key = (rec["framework"], rec["mode"])
        color = colors.setdefault(key, f"C{len(colors) % 10}")
        clock = [rec["startup_s"]]
        for s in rec["round_eval_s"]:
            clock.append(clock[-1] + s)
        xs = [clock[e["round"]] for e in rec["eval"]]
        ys = [100 * e["accuracy"] for e in rec["eval"]]
        ax.plot(
            xs,
            ys,
            "o-",
            ms=3,
            color=color,
            alpha=0.8,
            label=f"{key[0]}: {key[1]}"
            if rec["seed"] == min(r["seed"] for r in records if (r["framework"], r["mode"]) == key)
            else None,
        )
    ax.set_xlabel("wall time since the script started (s)")
    ax.set_ylabel("test accuracy (%)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def write_outputs(out: Path, doc: dict[str, Any], name: str = "peers_cpu") -> None:
    from hpcfl.bench.machine import csv_with_machine, with_machine
    from hpcfl.files import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / f"{name}.json", json.dumps(with_machine(doc), indent=1) + "\n")
    atomic_write_text(out / f"{name}.csv", csv_with_machine(write_csv(doc["rows"])))
    atomic_write_text(out / f"{name}.md", markdown(doc))
    plot(doc["records"], out / f"{name}.png")


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({cpu})"


def gpu_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, IndexError):
        return "unknown GPU"


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frameworks", nargs="+", default=None, help=f"default: {' '.join(FRAMEWORKS)}")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="default: the bundle's (0 1 2)")
    p.add_argument("--rounds", type=int, default=None, help="default: the bundle's (50)")
    p.add_argument(
        "--modes", nargs="+", default=None, help="all (default) | default | KEY | FRAMEWORK:KEY ..."
    )
    p.add_argument(
        "--algorithms",
        nargs="+",
        default=None,
        help=f"default: fedavg; the server optimisers ({' '.join(SERVER_OPTIMISERS)}) run on the frameworks "
        "whose runner has them (hpcfl, flower), at Flower's defaults -> peers_server_opt_*",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: the frameworks' GPU modes (only hpcfl has them: the peers' environments are built "
        "here, not on a lent GPU) -> peers_cuda.*",
    )
    p.add_argument("--experiment", default=str(REPO / "bench-out" / "peers" / "experiment"))
    p.add_argument("--data-root", default=None)
    p.add_argument("--out", default=None, help=f"default: {FULL_OUT} for the full run, else {SMOKE_OUT}")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run before it counts as failed")
    p.add_argument(
        "--combine",
        nargs="+",
        default=None,
        metavar="DIR",
        help="run nothing: join these earlier outputs' records into one table in --out",
    )
    return p.parse_args(argv)


def combine(dirs: list[str], out: Path, device: str) -> int:
    """One table from the records of earlier invocations (their conditions listed, in order)."""
    docs = []
    for d in dirs:
        path = Path(d) / f"peers_{device}.json"
        try:
            docs.append(json.loads(path.read_text()))
        except (OSError, ValueError) as err:
            print(f"harness: cannot read {path}: {err}", file=sys.stderr)
            return 2
    records = [r for doc in docs for r in doc["records"]]
    rows = [row_of(r) for r in records]
    first = docs[0]["conditions"]
    conditions = {
        **first,
        "load_start": min(doc["conditions"]["load_start"] for doc in docs),
        "load_end": max(doc["conditions"]["load_end"] for doc in docs),
        "seeds": sorted({s for doc in docs for s in doc["conditions"]["seeds"]}),
        "combined_from": [{"dir": str(d), **doc["conditions"]} for d, doc in zip(dirs, docs, strict=True)],
    }
    write_outputs(out, {"conditions": conditions, "rows": rows, "summary": summarise(rows), "records": records},
                  f"peers_{device}")  # fmt: skip
    print(
        f"harness: {len(records)} records from {len(docs)} runs -> {out}/peers_{device}.{{json,csv,md,png}}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.combine:
        return combine(args.combine, Path(args.out) if args.out else FULL_OUT, args.device)
    algorithms = list(dict.fromkeys(args.algorithms or ["fedavg"]))
    full = (
        args.device == "cpu"
        and all(getattr(args, k) is None for k in ("frameworks", "seeds", "rounds", "modes"))
        and (algorithms == ["fedavg"] or sorted(algorithms) == sorted(SERVER_OPTIMISERS))
    )
    out = Path(args.out) if args.out else (FULL_OUT if full else SMOKE_OUT)
    try:
        unknown = [a for a in algorithms if a not in ALGORITHMS]
        if unknown:
            raise HarnessError(f"unknown algorithm {unknown[0]!r}; known: {', '.join(ALGORITHMS)}")
        frameworks = args.frameworks or (list(FRAMEWORKS) if args.device == "cpu" else ["hpcfl"])
        unknown = [f for f in frameworks if f not in FRAMEWORKS]
        if unknown:
            raise HarnessError(f"unknown framework {unknown[0]!r}; known: {', '.join(FRAMEWORKS)}")
        plan = make_plan(frameworks, algorithms, args.modes, args.device, explicit=bool(args.frameworks))
        for algorithm in algorithms:
            left = [fw for fw in frameworks if all(p[:2] != (algorithm, fw) for p in plan)]
            if left:  # only without --frameworks: the runners that are FedAvg's only
                print(
                    f"harness: {algorithm} runs on {', '.join(sorted({p[1] for p in plan if p[0] == algorithm}))}; "
                    f"not on {', '.join(left)} (their runners are FedAvg's only)"
                )
        import experiment

        try:
            bundle = experiment.ensure(args.experiment, args.data_root)
        except Exception as err:  # hpcfl's DataError/ConfigError: one line
            raise HarnessError(f"cannot build the experiment bundle: {err}") from None
        spec = json.loads((bundle / "spec.json").read_text())
        seeds = args.seeds if args.seeds is not None else list(spec["seeds"])
        rounds = args.rounds or int(spec["rounds"])
        missing = [s for s in seeds if str(s) not in json.loads((bundle / "draws.json").read_text())]
        if missing or not 1 <= rounds <= int(spec["rounds"]):
            raise HarnessError(f"the bundle has draws for seeds {spec['seeds']} and {spec['rounds']} rounds")
    except HarnessError as err:
        print(f"harness: {err}", file=sys.stderr)
        return 2
    load_start = loadavg()
    records = []
    total = len(seeds) * len(plan)
    for seed in seeds:  # seeds outermost: the frameworks interleave (within each algorithm)
        for algorithm, fw, mode in plan:
            rec = run_one(fw, mode, seed, rounds, bundle, out, args.timeout, algorithm)
            records.append(rec)
            row = row_of(rec)
            what = (
                f"{_fmt(row['seconds_per_round'])} s/round, acc {_fmt(row['final_accuracy'], 4)}"
                if rec["status"] == "ok"
                else rec.get("error")
            )
            what_run = f"{fw} {mode}" if algorithm == "fedavg" else f"{fw} {algorithm} {mode}"
            print(
                f"[{len(records)}/{total}] {what_run} seed {seed}: {rec['status']} ({what}); load {rec.get('load_after')}",
                flush=True,
            )
    rows = [row_of(r) for r in records]
    doc = {
        "conditions": {
            "experiment": (
                f"{', '.join(ALGORITHM_NAMES[a] for a in algorithms)}, Fashion-MNIST {spec['partition']} over {spec['num_clients']} clients, {spec['clients_per_round']} "
                f"per round, {spec['local_epochs']} local epoch, batch {spec['batch_size']}, SGD lr {spec['lr']}, "
                f"{spec['model']} ({spec['num_params']:,} parameters), sample-weighted, test every {spec['eval_every']} rounds"
            ),
            "machine": machine() + (f", {gpu_name()}" if args.device == "cuda" else ""),
            "load_start": load_start,
            "load_end": loadavg(),
            "rounds": rounds,
            "seeds": seeds,
            "algorithms": algorithms,
            "full_run": full,
            "spec": spec,
        },
        "rows": rows,
        "summary": summarise(rows),
        "records": records,
    }
    name = f"peers_{args.device}" if algorithms == ["fedavg"] else f"peers_server_opt_{args.device}"
    write_outputs(out, doc, name)
    failed = sum(r["status"] != "ok" for r in records)
    print(f"harness: {len(records)} runs, {failed} failed -> {out}/{name}.{{json,csv,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
