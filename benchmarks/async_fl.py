"""Asynchronous FL (issue 54): synchronous FedAvg and FedProx against FedBuff and FedAsync on
Fashion-MNIST ``dir:0.1`` with heterogeneous client speeds, at equal client updates, plotted against
simulated time and against client updates.

    HPCFL_DATA=/path/to/datasets python benchmarks/async_fl.py

Every method gets the same budget of ``--updates`` client updates (a synchronous round applies
``--per-round`` of them, a FedBuff step ``--buffer``, a FedAsync step one) and the same virtual clock
(``system.clock``: speeds lognormal exp(N(``--speed-mu``, ``--speed-sigma``²)) samples per simulated
second, drawn once per client, and a constant ``--delay`` seconds per update), so the curves compare
the methods at equal simulated time and at equal client updates. The asynchronous methods keep
``--concurrency`` clients training at once (FedBuff's paper: concurrency ≫ K).

Protocol (``benchmarks/_runs.py``, :mod:`hpcfl.report.protocol`): each method's lr is chosen from
``--lrs`` on the last-k mean validation accuracy (``--validation`` of each client's data held out)
at the first seed, never on test accuracy; then ``--seeds`` seeds at the chosen lr. Tables: the
protocol's (last-k mean ± std over seeds) and, per method, the simulated seconds and client updates
to a target on the protocol's running mean (mean ± std over the seeds that reach it); curves of
test accuracy against simulated time and against client updates (mean ± std over seeds; the
synchronous runs' seeds share their update counts, their simulated times are interpolated on a
common grid).

The question (FedBuff, Nguyen et al. 2022, §6): does FedBuff reach the target in less simulated time
than synchronous FedAvg, and in fewer client updates than FedAsync, at this budget? The MLP, 100
clients, batch 64 and a few thousand client updates are far below the paper's cross-device scale
(millions of updates); the figures are a reduced-budget check of the direction of each effect. Runs
are ordinary run directories under ``--out``/runs (resumed if unfinished, reused if finished); the
script writes ``benchmarks/results/async_fl.{md,json,png}`` and ``async_fl_protocol.{md,csv,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from _runs import Setting, add_option_arguments, column_targets, federation_keys, run_protocol, write_tables

from hpcfl.bench.machine import with_machine
from hpcfl.report.methods import Cell
from hpcfl.report.protocol import Protocol

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("fedavg", "fedprox", "fedbuff", "fedasync")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-root", help="datasets directory (default: $HPCFL_DATA)")
    p.add_argument("--dataset", default="fashion-mnist")
    add_option_arguments(p)
    p.add_argument("--partition", default="dir:0.1")
    p.add_argument("--model", default="mlp")
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--per-round", type=int, default=10, help="synchronous participants per round")
    p.add_argument("--concurrency", type=int, default=20, help="asynchronous clients training at once")
    p.add_argument("--buffer", type=int, default=10, help="FedBuff's K")
    p.add_argument("--updates", type=int, default=3000, help="client updates per run (every method)")
    p.add_argument("--eval-updates", type=int, default=100, help="evaluate every N client updates")
    p.add_argument("--local-steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--speed-mu", type=float, default=5.0, help="log-speed mean (samples per simulated s)")
    p.add_argument("--speed-sigma", type=float, default=1.0)
    p.add_argument("--delay", type=float, default=1.0, help="simulated seconds per update (network)")
    p.add_argument(
        "--duration",
        default=None,
        choices=["gaussian", "per_example_gaussian", "half_normal", "uniform", "exponential"],
        help="FLSim's training-duration law in place of the speeds (system.clock.duration), drawn per update",
    )
    p.add_argument("--duration-mean", type=float, default=10.0)
    p.add_argument("--duration-sd", type=float, default=0.0)
    p.add_argument("--duration-min", type=float, default=0.0)
    p.add_argument(
        "--starts-rate",
        type=float,
        default=None,
        help="asynchronous methods: Poisson training starts per simulated second (FLSim); default: a "
        "freed slot is refilled at once",
    )
    p.add_argument("--mu", type=float, default=0.01, help="FedProx's μ")
    p.add_argument("--alpha", type=float, default=0.6, help="FedAsync's α")
    p.add_argument("--staleness", default="polynomial", help="s(τ) of both asynchronous methods")
    p.add_argument("--staleness-a", type=float, default=0.5, help="its exponent (FedBuff: 1/√(1+τ))")
    p.add_argument("--server-lr", type=float, default=1.0, help="FedBuff's η_g")
    p.add_argument("--lrs", type=float, nargs="+", default=[0.03, 0.1], help="lr candidates")
    p.add_argument("--validation", type=float, default=0.05)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--last", type=int, default=5, help="k of the last-k mean (evaluated rounds)")
    p.add_argument("--window", type=int, default=3)
    p.add_argument("--target", type=float, default=None, help="accuracy target (default: every run's)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench-out/async_fl"))
    p.add_argument("--results", type=Path, default=RESULTS, help="where the tables and figures go")
    p.add_argument(
        "--stem", default="async_fl", help="the results files' stem (STEM.md, STEM_protocol.md, ...)"
    )
    return p.parse_args(argv)


def per_step(args: argparse.Namespace, method: str) -> int:
    """Client updates one round (synchronous) or server step (asynchronous) applies."""
    return {"fedavg": args.per_round, "fedprox": args.per_round, "fedbuff": args.buffer, "fedasync": 1}[
        method
    ]


def config(args: argparse.Namespace, method: str) -> dict[str, Any]:
    """``method``'s run (without lr and seed): the same clock and client-update budget for all."""
    step = per_step(args, method)
    if args.updates % step or args.eval_updates % step:
        raise SystemExit(f"--updates and --eval-updates must be multiples of {step} ({method})")
    params: dict[str, Any] = {}
    asynchronous = {"staleness": args.staleness, "a": args.staleness_a, "concurrency": args.concurrency}
    if method == "fedprox":
        params = {"mu": args.mu}
    elif method == "fedbuff":
        params = {**asynchronous, "buffer_size": args.buffer, "server_lr": args.server_lr}
    elif method == "fedasync":
        params = {**asynchronous, "alpha": args.alpha}
    return dict(
        federation_keys(args),
        algorithm=method,
        params=params,
        rounds=args.updates // step,
        eval_every=args.eval_updates // step,
        local_steps=args.local_steps,
        momentum=0.0,
        weight_decay=1e-5,
        batch_size=args.batch,
        validation=args.validation,
        threads=args.threads,
        progress=False,
        system={"clock": clock(args, asynchronous=method in ("fedbuff", "fedasync"))},
    )


def clock(args: argparse.Namespace, *, asynchronous: bool) -> dict[str, Any]:
    """The ``system.clock`` section: lognormal speeds, or FLSim's duration law drawn per update
    (``--duration``); Poisson starts (``--starts-rate``) for the asynchronous methods only."""
    out: dict[str, Any] = {"delay": {"kind": "constant", "value": args.delay}}
    if args.duration is None:
        out["speed"] = {"kind": "lognormal", "mu": args.speed_mu, "sigma": args.speed_sigma}
    else:
        law = {
            "kind": args.duration,
            "mean": args.duration_mean,
            "sd": args.duration_sd,
            "min": args.duration_min,
        }
        out.update(duration=law, per_update=True)
    if asynchronous and args.starts_rate is not None:
        out["starts"] = {"kind": "poisson", "rate": args.starts_rate}
    return out


def clock_text(args: argparse.Namespace) -> str:
    """The clock in words, for the tables' header."""
    if args.duration is None:
        text = f"speeds lognormal(μ={args.speed_mu}, σ={args.speed_sigma}) samples/s"
    else:
        text = (
            f"FLSim {args.duration} durations (mean {args.duration_mean}, sd {args.duration_sd}, min "
            f"{args.duration_min} s) per update"
        )
    if args.starts_rate is not None:
        text += f", asynchronous starts Poisson at {args.starts_rate}/s"
    return text


def _mean_std(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    return mean, (math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0)


def _fmt(values: list[float], seeds: int, digits: int = 0) -> str:
    if not values:
        return f"not reached (0/{seeds})"
    mean, std = _mean_std(values)
    reached = "" if len(values) == seeds else f" ({len(values)}/{seeds} seeds)"
    return f"{mean:,.{digits}f} ± {std:,.{digits}f}{reached}"


def time_table(cells: list[Cell], target: float, protocol: Protocol, seeds: int) -> list[str]:
    """Per method: simulated seconds and client updates to ``target`` (the running mean's first
    crossing), mean ± std over the seeds that reach it."""
    from hpcfl.report.targets import sim_time_to_target

    lines = [
        f"| method | sim. s to {100 * target:g}% | client updates to {100 * target:g}% | final sim. s |",
        "|---|---:|---:|---:|",
    ]
    for cell in cells:
        hits = [sim_time_to_target(r, target, window=protocol.window) for r in cell.runs]
        sims = [s for s, _ in hits if s is not None]
        updates = [float(u) for _, u in hits if u is not None]
        final = [float(r.rows[-1]["sim_time"]) for r in cell.runs if r.rows]
        lines.append(
            f"| {cell.row} | {_fmt(sims, seeds)} | {_fmt(updates, seeds)} | {_fmt(final, len(final))} |"
        )
    return lines


#: The FedBuff paper's headline ratios (Nguyen et al. 2022, abstract): client updates to a target
#: accuracy of synchronous FL and of FedAsync over FedBuff's.
PAPER_RATIOS = {"fedavg": 3.3, "fedprox": 3.3, "fedasync": 2.5}


def ratio_table(cells: list[Cell], target: float, protocol: Protocol) -> list[str]:
    """Each other method's mean client updates and simulated seconds to ``target`` over FedBuff's
    (> 1: FedBuff needs fewer), beside the paper's claim; "—" where a side never reaches it."""
    from hpcfl.report.targets import sim_time_to_target

    means: dict[str, tuple[float | None, float | None]] = {}
    for cell in cells:
        hits = [sim_time_to_target(r, target, window=protocol.window) for r in cell.runs]
        sims = [s for s, _ in hits if s is not None]
        updates = [float(u) for _, u in hits if u is not None]
        full = len(cell.runs)
        means[cell.row] = (
            _mean_std(updates)[0] if updates and len(updates) == full else None,
            _mean_std(sims)[0] if sims and len(sims) == full else None,
        )
    if "fedbuff" not in means:
        return []
    lines = [
        "| method / FedBuff | client updates | simulated s | paper (client updates) |",
        "|---|---:|---:|---:|",
    ]
    base = means["fedbuff"]
    for row, (updates, sims) in means.items():
        if row == "fedbuff":
            continue
        cols = [
            f"{mine / theirs:.2f}×" if mine is not None and theirs is not None else "—"
            for mine, theirs in ((updates, base[0]), (sims, base[1]))
        ]
        lines.append(f"| {row} | {cols[0]} | {cols[1]} | {PAPER_RATIOS.get(row, float('nan')):g}× |")
    return lines


def curve(runs: list[Any], key: str, grid: list[float]) -> tuple[list[float], list[float]]:
    """Mean and std over ``runs`` of the test accuracy last logged at or before each grid point of
    column ``key`` (NaN before a run's first row)."""
    means, stds = [], []
    for x in grid:
        accs = []
        for r in runs:
            logged = [float(row["test_accuracy"]) for row in r.rows if float(row[key]) <= x]
            if logged:
                accs.append(logged[-1])
        mean, std = _mean_std(accs) if len(accs) == len(runs) else (float("nan"), 0.0)
        means.append(mean)
        stds.append(std)
    return means, stds


def plot(cells: list[Cell], path: Path) -> None:
    """Test accuracy against simulated time (left) and client updates (right), mean ± std."""
    from hpcfl.files import save_figure
    from hpcfl.report.plots import _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, key, label in (
        (axes[0], "sim_time", "simulated seconds"),
        (axes[1], "client_updates", "client updates"),
    ):
        top = max((float(row[key]) for c in cells for r in c.runs for row in r.rows), default=1.0)
        grid = [top * i / 200 for i in range(1, 201)]
        for cell in cells:
            if not cell.runs:
                continue
            mean, std = curve(cell.runs, key, grid)
            ax.plot(grid, mean, label=cell.row)
            ax.fill_between(
                grid,
                [m - s for m, s in zip(mean, std, strict=True)],
                [m + s for m, s in zip(mean, std, strict=True)],
                alpha=0.2,
            )
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy")
    axes[1].legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    protocol = Protocol(last_k=args.last, window=args.window)
    t0 = time.perf_counter()
    settings = [Setting(m, args.partition, config(args, m), tuple(args.lrs)) for m in args.methods]
    if len(args.lrs) == 1:
        settings = [Setting(s.row, s.column, {**s.config, "validation": 0.0}, s.lrs) for s in settings]
    seeds = list(range(args.seeds))
    cells = run_protocol(settings, seeds=seeds, out=args.out, jobs=args.jobs, protocol=protocol)
    for cell in cells:  # the per-update lists (participants, staleness, applied) stay in the run dirs
        for run in cell.runs:
            run.rows[:] = [{k: v for k, v in row.items() if not isinstance(v, list)} for row in run.rows]
    targets = column_targets(cells, [args.partition], protocol)
    target = args.target if args.target is not None else targets[args.partition]
    given = f", {' '.join(args.dataset_option)}" if args.dataset_option else ""
    header = f"# Asynchronous FL at equal client updates ({args.dataset} {args.partition}{given})"
    protocol_md = write_tables(
        cells, protocol, {args.partition: target}, args.results / f"{args.stem}_protocol", header
    )
    budget = (
        f"{args.model}{' (' + ' '.join(args.model_option) + ')' if args.model_option else ''}, {args.clients} clients, {args.updates} client updates per run ({args.per_round} per "
        f"synchronous round, FedBuff K = {args.buffer}, concurrency {args.concurrency}), {args.local_steps} "
        f"local steps of batch {args.batch}, {clock_text(args)}, delay {args.delay} s, {args.seeds} seeds"
    )
    chosen = [f"- {c.row}: lr {c.choice.value if c.choice else args.lrs[0]:g}" for c in cells]
    md = [
        header,
        "",
        f"Budget: {budget}.",
        "",
        f"Simulated time and client updates to {100 * target:g}% test accuracy (running mean over "
        f"{protocol.window} evaluated rows):",
        "",
        *time_table(cells, target, protocol, args.seeds),
        "",
        "FedBuff's efficiency: each method's mean to the target over FedBuff's (every seed must reach "
        "it), beside the paper's:",
        "",
        *ratio_table(cells, target, protocol),
        "",
        "Chosen learning rates (validation):",
        *chosen,
        "",
        f"Curves: {args.stem}.png (accuracy vs simulated seconds and vs client updates); the protocol's "
        f"tables: {args.stem}_protocol.md.",
        "",
        f"Wall time of this invocation: {time.perf_counter() - t0:.0f} s (finished runs count 0).",
    ]
    text = "\n".join(md) + "\n"
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"{args.stem}.md").write_text(text)
    (args.results / f"{args.stem}.json").write_text(
        json.dumps(
            with_machine(
                {
                    "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    "target": target,
                    "runs": {c.row: [{"name": r.name, "rows": r.rows} for r in c.runs] for c in cells},
                }
            ),
            indent=1,
        )
    )
    if any(c.runs for c in cells):
        plot(cells, args.results / f"{args.stem}.png")
    print(text + "\n" + protocol_md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
