"""System heterogeneity (issue 42): FedNova vs FedAvg vs FedProx under unequal local epochs, and
FedProx's straggler experiment, on Fashion-MNIST ``dir:0.1``, under the comparison protocol.

    HPCFL_DATA=/path/to/datasets python benchmarks/system_heterogeneity.py

1. **Unequal local work** (FedNova, Wang et al. 2020, §6: local epochs uniform in [2, 5], drawn per
   client and round). FedAvg, FedProx and FedNova, each with its lr chosen from ``--lrs`` on a
   validation split; FedProx's μ is chosen from ``--mus`` on the same split (each μ with its own lr
   choice; the μ whose chosen lr has the best validation accuracy is reported). The question: is
   there an objective-inconsistency gap between FedAvg and FedNova at this budget?
2. **Stragglers** (FedProx, Li et al. 2020, Fig. 1): E = ``--straggler-epochs`` local epochs;
   0 %, 50 %, 90 % of each round's participants are stragglers doing a uniformly drawn [1, E − 1]
   epochs. Three methods per level: μ = 0 dropping the stragglers (the paper's FedAvg), μ = 0
   keeping their partial work, μ > 0 keeping it (μ chosen from ``--prox-mus`` on validation per
   level). One lr for the whole experiment, as in the paper: chosen from ``--lrs`` on validation for
   μ = 0 at 0 % stragglers.

Protocol (``benchmarks/_runs.py``, :mod:`hpcfl.report.protocol`): every choice is made on the
last-k mean validation accuracy (``--validation`` of each client's data held out) at the first seed,
never on test accuracy; then ``--seeds`` seeds run at the chosen values. Tables: mean ± std over
seeds of each seed's last-k mean test accuracy (the smoothed figure), rounds to target on a running
mean, final accuracy; curves with ± std bands.

Budget (stated against the papers'): the MLP (784-100-10), ``--clients`` 100 clients of which
``--per-round`` 10 train per round, batch 64, plain SGD (momentum 0, weight decay 1e-5),
``--rounds`` 30 rounds, evaluation every 2nd round. FedNova's §6 trains a VGG-11 on non-IID
CIFAR-10 with 16 clients for hundreds of rounds; FedProx's Fig. 1 runs 20 local epochs, 10 of
1000 (synthetic) or more clients per round, for 100-200 rounds (40 for MNIST), on MNIST, FEMNIST,
Shakespeare and Sent140. The numbers here are a reduced-budget check of the direction of each
effect, not a reproduction of the papers' figures. Every run is an ordinary run directory under
``--out``/runs (resumed if unfinished, reused if finished); the script writes
``benchmarks/results/system_heterogeneity_{work,stragglers}.{md,csv,json,png}`` and
``system_heterogeneity.md`` (both tables, the choices, the wall time).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from _runs import (
    Setting,
    add_option_arguments,
    column_targets,
    federation_keys,
    run_dir_of,
    run_protocol,
    write_tables,
)

from hpcfl.bench.machine import with_machine
from hpcfl.report.methods import Cell
from hpcfl.report.protocol import VALIDATION, Protocol, last_k_mean

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-root", help="datasets directory (default: $HPCFL_DATA)")
    p.add_argument("--dataset", default="fashion-mnist")
    add_option_arguments(p)
    p.add_argument("--partition", default="dir:0.1")
    p.add_argument("--model", default="mlp")
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--per-round", type=int, default=10)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument(
        "--epochs-low", type=int, default=2, help="experiment 1: local epochs uniform in [low, high]"
    )
    p.add_argument("--epochs-high", type=int, default=5)
    p.add_argument("--straggler-epochs", type=int, default=5, help="experiment 2: E of the non-stragglers")
    p.add_argument(
        "--straggler-steps", type=int, default=0, help="experiment 2: E in local steps instead of epochs"
    )
    p.add_argument("--stem", default="system_heterogeneity", help="results file names' stem")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.5, 0.9], help="straggler shares")
    p.add_argument("--lrs", type=float, nargs="+", default=[0.03, 0.1], help="lr candidates")
    p.add_argument("--mus", type=float, nargs="+", default=[0.01, 0.1], help="FedProx μ candidates, exp. 1")
    p.add_argument("--prox-mus", type=float, nargs="+", default=[0.1, 1.0], help="μ > 0 candidates, exp. 2")
    p.add_argument("--validation", type=float, default=0.05, help="held-out share for every choice")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--last", type=int, default=5, help="k of the last-k mean (evaluated rounds)")
    p.add_argument("--window", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--experiments", nargs="+", default=["work", "stragglers"], choices=["work", "stragglers"])
    p.add_argument("--out", type=Path, default=Path("bench-out/system_heterogeneity"))
    p.add_argument("--results", type=Path, default=RESULTS, help="where the tables and figures go")
    return p.parse_args(argv)


def base_config(args: argparse.Namespace, algorithm: str, **extra: Any) -> dict[str, Any]:
    """A run of ``algorithm`` on the benchmark's federation (without lr and seed)."""
    return dict(
        federation_keys(args),
        algorithm=algorithm,
        rounds=args.rounds,
        momentum=0.0,
        weight_decay=1e-5,
        batch_size=args.batch,
        validation=args.validation,
        threads=args.threads,
        progress=False,
        eval_every=args.eval_every,
        **extra,
    )


def validation_score(cell: Cell, out: Path, setting: Setting, seed: int, k: int) -> float:
    """The last-k mean validation accuracy of ``setting`` at its chosen lr and ``seed`` (NaN if none)."""
    from hpcfl.report import summarise

    lr = setting.lrs[0] if cell.choice is None else cell.choice.value
    path = run_dir_of(out, setting, lr, seed)
    if not (path / "DONE").exists():
        return float("nan")
    value = last_k_mean(summarise(path).rows, k, VALIDATION)
    return float("nan") if value is None else value


def best_of(scores: dict[Any, float]) -> Any:
    """The key with the best score (ties: the first); NaN never wins."""
    finite = {k: v for k, v in scores.items() if v == v}
    if not finite:
        raise SystemExit("every candidate failed; see the FAILED files under --out")
    return max(finite, key=lambda k: finite[k])


def renamed(cell: Cell, row: str) -> Cell:
    return Cell(row, cell.column, cell.runs, cell.choice)


def unequal_work(args: argparse.Namespace, protocol: Protocol) -> tuple[str, float]:
    """Experiment 1; returns its markdown and the lr FedAvg chose."""
    work = {"work": {"kind": "uniform", "unit": "epochs", "low": args.epochs_low, "high": args.epochs_high}}
    column = f"E~U[{args.epochs_low},{args.epochs_high}]"
    rows = {"fedavg": base_config(args, "fedavg", system=work)}
    rows["fednova"] = base_config(args, "fednova", system=work)
    for mu in args.mus:
        rows[f"fedprox-mu{mu:g}"] = base_config(args, "fedprox", system=work, params={"mu": mu})
    settings = [Setting(row, column, cfg, tuple(args.lrs)) for row, cfg in rows.items()]
    cells = run_protocol(
        settings, seeds=list(range(args.seeds)), out=args.out, jobs=args.jobs, protocol=protocol
    )
    by_row = {c.row: c for c in cells}
    mu_scores = {
        mu: validation_score(by_row[f"fedprox-mu{mu:g}"], args.out, s, 0, args.last)
        for mu, s in zip(args.mus, settings[2:], strict=True)
    }
    mu = best_of(mu_scores)
    reported = [
        by_row["fedavg"],
        renamed(by_row[f"fedprox-mu{mu:g}"], f"fedprox (μ={mu:g})"),
        by_row["fednova"],
    ]
    targets = column_targets(reported, [column], protocol)
    header = (
        "# Unequal local work: FedAvg vs FedProx vs FedNova (FedNova §6's setting)\n\n"
        f"Local epochs drawn per client and round uniformly in [{args.epochs_low}, {args.epochs_high}] "
        f"(`system.work: {{kind: uniform, unit: epochs, low: {args.epochs_low}, high: {args.epochs_high}}}`)"
        f", Fashion-MNIST `{args.partition}`; {budget(args)}. FedProx μ chosen from {args.mus} on "
        f"validation (last-{args.last} mean val. accuracy at seed 0, each at its chosen lr: "
        + ", ".join(f"μ={m:g}: {100 * v:.2f}%" for m, v in mu_scores.items())
        + f") → μ = {mu:g}."
    )
    stem = args.results / f"{args.stem}_work"
    text = write_tables(reported, protocol, targets, stem, header)
    fedavg_lr = by_row["fedavg"].choice.value if by_row["fedavg"].choice else args.lrs[0]
    return text, fedavg_lr


def stragglers(args: argparse.Namespace, protocol: Protocol) -> str:
    """Experiment 2 (FedProx Fig. 1's shape)."""
    seeds = list(range(args.seeds))

    def cfg(fraction: float, mu: float, drop: bool) -> dict[str, Any]:
        unit = "steps" if args.straggler_steps else "epochs"
        system = {"work": {"kind": "stragglers", "unit": unit, "fraction": fraction, "drop": drop}}
        work = (
            {"local_steps": args.straggler_steps}
            if args.straggler_steps
            else {"local_epochs": args.straggler_epochs}
        )
        return base_config(args, "fedprox", system=system, params={"mu": mu}, **work)

    def column(fraction: float) -> str:
        return f"{100 * fraction:g}% stragglers"

    # the experiment's one lr: chosen on validation for μ = 0 at the first straggler level
    first = args.fractions[0]
    keep0 = Setting("mu0-keep", column(first), cfg(first, 0.0, False), tuple(args.lrs))
    (cell0,) = run_protocol([keep0], seeds=seeds, out=args.out, jobs=args.jobs, protocol=protocol)
    lr = cell0.choice.value if cell0.choice is not None else args.lrs[0]
    cells: list[Cell] = []
    choices: dict[str, dict[float, float]] = {}
    for fraction in args.fractions:
        col = column(fraction)
        fixed = [
            Setting("mu0-drop", col, cfg(fraction, 0.0, True), (lr,)),
            Setting("mu0-keep", col, cfg(fraction, 0.0, False), (lr,)),
        ]
        candidates = [Setting(f"mu{mu:g}-keep", col, cfg(fraction, mu, False), (lr,)) for mu in args.prox_mus]
        done = run_protocol(fixed, seeds=seeds, out=args.out, jobs=args.jobs, protocol=protocol)
        tried = run_protocol(candidates, seeds=seeds[:1], out=args.out, jobs=args.jobs, protocol=protocol)
        scores = {
            mu: validation_score(c, args.out, s, 0, args.last)
            for mu, c, s in zip(args.prox_mus, tried, candidates, strict=True)
        }
        choices[col] = scores
        mu = best_of(scores)
        chosen = next(s for m, s in zip(args.prox_mus, candidates, strict=True) if m == mu)
        (best,) = run_protocol([chosen], seeds=seeds, out=args.out, jobs=args.jobs, protocol=protocol)
        cells += [
            renamed(done[0], "FedAvg (μ=0, drop stragglers)"),
            renamed(done[1], "FedProx μ=0 (keep partial work)"),
            renamed(best, f"FedProx μ>0 (keep; μ={mu:g})"),
        ]
    targets = column_targets(cells, [column(f) for f in args.fractions], protocol)
    e, unit = (args.straggler_steps, "steps") if args.straggler_steps else (args.straggler_epochs, "epochs")
    options = f" ({', '.join(args.dataset_option)})" if args.dataset_option else ""
    chosen_text = "; ".join(
        f"{col}: " + ", ".join(f"μ={m:g} {100 * v:.2f}%" for m, v in s.items()) for col, s in choices.items()
    )
    header = (
        f"# Stragglers: FedProx's Fig. 1 on {args.dataset}\n\n"
        f"E = {e} local {unit}; a share of each round's participants are stragglers "
        f"doing [1, {e - 1}] {unit} (`system.work: {{kind: stragglers, fraction: F, "
        f"drop: true|false}}`), {args.dataset} `{args.partition}`{options}; {budget(args)}. One lr for the "
        f"experiment, {lr:g}, chosen from {args.lrs} on validation for μ = 0 at {column(first)}. μ > 0 "
        f"chosen from {args.prox_mus} per level on validation at seed 0 ({chosen_text})."
    )
    header += "\n\n" + paired_keep_table(cells, [column(f) for f in args.fractions], protocol)
    stem = args.results / f"{args.stem}_stragglers"
    text = write_tables(cells, protocol, targets, stem, header)
    plot_levels(cells, args.fractions, protocol, stem.with_name(stem.name + "_levels.png"))
    return text


def paired_keep_table(cells: list[Cell], columns: list[str], protocol: Protocol) -> str:
    """Keeping the stragglers' partial work against dropping them, paired by seed (same clients,
    same stragglers each round): per level, mean ± std of the per-seed last-k differences, and each
    seed's (percentage points)."""
    from hpcfl.report.protocol import mean_std

    lines = [
        f"Paired by seed, last-{protocol.last_k} test accuracy, percentage points:",
        "",
        "| level | FedProx μ=0 (keep) − FedAvg (drop) | per seed | FedProx μ>0 − μ=0 | per seed |",
        "|---|---:|---|---:|---|",
    ]
    for col in columns:
        drop, keep, prox = (next(c for c in cells if c.column == col and c.row.startswith(p)) for p in _ROWS)
        cells_text = []
        for diffs in (keep.paired_last_k(drop, protocol.last_k), prox.paired_last_k(keep, protocol.last_k)):
            m, s = mean_std(diffs)
            cells_text += [f"{100 * m:+.2f} ± {100 * s:.2f}", ", ".join(f"{100 * d:+.2f}" for d in diffs)]
        lines.append(f"| {col} | " + " | ".join(cells_text) + " |")
    return "\n".join(lines)


_ROWS = ("FedAvg (μ=0, drop", "FedProx μ=0 (keep", "FedProx μ>0")
"""The straggler experiment's three rows, by the start of their names."""


def plot_levels(cells: list[Cell], fractions: list[float], protocol: Protocol, path: Path) -> None:
    """Last-k mean test accuracy (mean ± std over seeds) per method against the straggler share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hpcfl.report.protocol import mean_std

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    labels = (
        "FedAvg (μ = 0, stragglers dropped)",
        "FedProx μ = 0 (partial work kept)",
        "FedProx μ > 0 (partial work kept)",
    )
    for method, label in zip(_ROWS, labels, strict=True):
        xs, ms, ss = [], [], []
        for f in fractions:
            cell = next(c for c in cells if c.row.startswith(method) and c.column.startswith(f"{100 * f:g}%"))
            values = [v for r in cell.runs if (v := last_k_mean(r.rows, protocol.last_k)) is not None]
            if values:
                m, s = mean_std(values)
                xs.append(100 * f)
                ms.append(100 * m)
                ss.append(100 * s)
        ax.errorbar(xs, ms, yerr=ss, marker="o", capsize=3, label=label)
    ax.set_xlabel("stragglers (% of each round's participants)")
    ax.set_ylabel(f"test accuracy, last-{protocol.last_k} mean (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def budget(args: argparse.Namespace) -> str:
    return (
        f"{args.model}, {args.clients} clients, {args.per_round} per round, {args.rounds} rounds, batch "
        f"{args.batch}, momentum 0, weight decay 1e-5, evaluation every {args.eval_every} rounds, "
        f"{args.seeds} seeds, {args.jobs} run(s) at a time × {args.threads} thread(s)"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    protocol = Protocol(last_k=args.last, window=args.window)
    t0 = time.perf_counter()
    parts = []
    if "work" in args.experiments:
        text, _ = unequal_work(args, protocol)
        parts.append(text)
    if "stragglers" in args.experiments:
        parts.append(stragglers(args, protocol))
    wall = time.perf_counter() - t0
    summary = "\n\n".join(parts) + f"\nWall time of this invocation: {wall:.0f} s (finished runs count 0).\n"
    (args.results / f"{args.stem}.md").write_text(summary)
    (args.results / f"{args.stem}_args.json").write_text(
        json.dumps(
            with_machine({k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}), indent=1
        )
    )
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
