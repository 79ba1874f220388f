"""TCT paper, Table 2 (Fashion-MNIST rows) and Figure 3(a), on a CPU budget.

    HPCFL_DATA=/work/shared/datasets python benchmarks/tct_fmnist_table.py

What is measured, and why. Table 2 of TCT (Yu et al., NeurIPS 2022) compares FedAvg, FedProx,
SCAFFOLD and TCT on Fashion-MNIST with SimpleCNN and 10 clients under four degrees of label skew
(#C = 1, #C = 2, Dir(0.1), Dir(0.5); ``classes:C`` is NIID-Bench's #C rule and ``dir:ALPHA`` its
label Dirichlet, the paper's partitions): the claim is that TCT is hardly hurt by heterogeneity while
the baselines collapse at #C = 1. The paper's budget (200 rounds × 5 local epochs for the baselines,
100 FedAvg + 100 stage-2 rounds with p = 100,000 for TCT) is GPU-sized; this script runs the same
grid at a budget that fits a shared 2-core CPU and states it in every output:

- baselines: R = ``--rounds`` (10) rounds of ``--local-steps`` (40) SGD steps per client (batch
  ``--batch`` 64, no momentum, weight decay 1e-5; FedProx μ = ``--mu`` 0.01); SCAFFOLD is the
  one-model-per-round form of TCT Appendix A.1 (``form: one_model``; with equal step counts it is
  Option II up to the server weighting);
- the protocol (``benchmarks/_runs.py``, as every table script): each baseline's lr is chosen per
  partition from ``--lrs`` (0.01, 0.05) at seed 0 on the mean validation accuracy of the last
  ``--last`` (5) evaluated rounds, ``--validation`` (5 %) of each client's data held out, then
  ``--seeds`` (3) seeds run at it; TCT's stage 1 uses the lr FedAvg chose on the same partition
  (TCT's stage 2 evaluates on the test set only, so TCT itself is not searched); the table gives
  each method's mean ± std over seeds of the last-5 mean test accuracy;
- TCT: T1 = ``--stage1-rounds`` (R/2) rounds of the same FedAvg, then eNTK features (the output of
  a fresh seeded 1-output classifier, as TCT's code; p = ``--p`` (2000) random coordinates), standardised, and
  T2 = ``--stage2-rounds`` (R − T1) rounds of SCAFFOLD on the linear regression with
  M = ``--stage2-steps`` (100) local steps in closed form and η2 = half the largest stable rate
  (``stage2.auto_lr``). T1 + T2 = R communication rounds, the baselines' count.

M defaults to 100, not the paper's 500: with p = 2000 < n_k ≈ 6000 every client's local problem is
strongly convex, the local steps run to the client's own optimum and SCAFFOLD's correction lags —
on #C=2 the stage-2 test accuracy after 5 rounds is 78.7 / 79.7 / 77.3 / 72.8 / 60.8 / 46.6 % for
M = 50 / 100 / 200 / 500 / 2000 / 10000 (benchmarks/README.md). The paper's M = 500 goes with
p = 100,000 ≫ n_k. With the defaults (4 partitions × (3 baselines × (2 + 2) + 3 TCT) = 60 runs)
the whole script takes a few hours on 2 shared cores (one seed without a search took about 40
minutes); ``--partitions``, ``--seeds`` and ``--lrs`` cut it down.

Every run is an ordinary ``hpcfl`` run directory under ``--out`` (default benchmarks/out/tct_fmnist/
runs/<partition>/<method>/lr=<lr>,seed=<seed>); a run whose directory holds DONE with the same config is skipped, an
unfinished one is resumed, so the script can be interrupted and restarted.

Figure 3(a) (``--figure3``, on by default): stage-2 *training* accuracy vs round on #C = 2 for TCT
with M ∈ ``--fig3-steps`` local steps against full-batch GD (``stage2.variant=gd``, one step per
round, at 1.9·η2 — just under the largest rate the per-client stability check admits — at η2
and at η2/10), all re-solved on the #C = 2 TCT run's stored features with
``hpcfl tct-stage2 RUN_DIR --set stage2.local_steps=... stage2.variant=...`` (metrics land in
RUN_DIR/stage2/<settings>/metrics.jsonl).

Outputs: ``<results>/tct_fmnist_table.{md,csv,json,png}`` (the protocol's tables, ours beside the
paper's numbers, the budget, the shape checks; curves with ± std bands) and
``<results>/tct_figure3.png``; ``--results`` defaults to benchmarks/results.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _runs import Setting, column_targets, run_dir_of, run_protocol, write_tables

from hpcfl.bench.machine import with_machine
from hpcfl.report.methods import Cell
from hpcfl.report.protocol import Protocol

PARTITIONS = ["classes:1", "classes:2", "dir:0.1", "dir:0.5"]
METHODS = ["fedavg", "fedprox", "scaffold", "tct"]
LABELS = {"fedavg": "FedAvg", "fedprox": "FedProx", "scaffold": "SCAFFOLD", "tct": "TCT"}
PAPER = {  # TCT Table 2, Fashion-MNIST / SimpleCNN, top-1 test accuracy (%)
    "fedavg": {"classes:1": 35.10, "classes:2": 85.18, "dir:0.1": 86.18, "dir:0.5": 90.09},
    "fedprox": {"classes:1": 50.04, "classes:2": 84.91, "dir:0.1": 86.31, "dir:0.5": 89.77},
    "scaffold": {"classes:1": 12.80, "classes:2": 42.80, "dir:0.1": 83.87, "dir:0.5": 89.40},
    "tct": {"classes:1": 86.32, "classes:2": 90.33, "dir:0.1": 90.78, "dir:0.5": 91.13},
}
PAPER_CENTRALISED = 91.40
COLUMN = {"classes:1": "#C=1", "classes:2": "#C=2", "dir:0.1": "α=0.1", "dir:0.5": "α=0.5"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", help="datasets directory (default: $HPCFL_DATA)")
    p.add_argument(
        "--partitions", nargs="+", default=PARTITIONS, help="partition specs (default: the four of Table 2)"
    )
    p.add_argument(
        "--methods", nargs="+", default=METHODS, choices=METHODS, help="methods (default: all four)"
    )
    p.add_argument("--clients", type=int, default=10, help="clients (default 10)")
    p.add_argument("--rounds", type=int, default=10, help="R: baseline rounds (default 10)")
    p.add_argument("--local-steps", type=int, default=40, help="SGD steps per round (0: --local-epochs)")
    p.add_argument("--local-epochs", type=int, default=1, help="epochs per round when --local-steps 0")
    p.add_argument(
        "--lrs", type=float, nargs="+", default=[0.01, 0.05], help="lr candidates of the baselines"
    )
    p.add_argument("--lr", type=float, default=0.05, help="TCT stage-1 lr when FedAvg is not run")
    p.add_argument("--validation", type=float, default=0.05, help="held-out share for the lr choice")
    p.add_argument("--last", type=int, default=5, help="k of the last-k mean (evaluated rounds)")
    p.add_argument("--window", type=int, default=3, help="running-mean window of rounds to target")
    p.add_argument("--mu", type=float, default=0.01, help="FedProx μ (default 0.01)")
    p.add_argument("--batch", type=int, default=64, help="SGD batch size (default 64)")
    p.add_argument("--stage1-rounds", type=int, default=None, help="T1 (default R/2)")
    p.add_argument("--stage2-rounds", type=int, default=None, help="T2 (default R − T1)")
    p.add_argument("--p", type=int, default=2000, help="eNTK coordinates kept (default 2000)")
    p.add_argument(
        "--stage2-steps",
        type=int,
        default=100,
        help="M of stage 2 (default 100; the paper's 500 assumes p ≫ n_k)",
    )
    p.add_argument("--seeds", type=int, default=3, help="seeds at the chosen lr (0, 1, ...)")
    p.add_argument("--eval-every", type=int, default=2, help="baselines and stage 1 (stage 2: every round)")
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel (processes)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (1 avoids oversubscription)")
    p.add_argument(
        "--device", default="cpu", help="the runs' device: cpu | cuda (one GPU: use --jobs 1; default cpu)"
    )
    p.add_argument("--no-figure3", dest="figure3", action="store_false", help="skip Figure 3")
    p.add_argument("--fig3-partition", default="classes:2", help="partition of Figure 3 (classes:2)")
    p.add_argument(
        "--fig3-steps", type=int, nargs="+", default=[100, 1000], help="TCT local steps M of Figure 3"
    )
    p.add_argument("--fig3-rounds", type=int, default=30, help="stage-2 rounds of the Figure 3 curves")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/tct_fmnist"), help="run directories")
    p.add_argument("--results", type=Path, default=Path("benchmarks/results"), help="summary files")
    args = p.parse_args(argv)
    if args.stage1_rounds is None:
        args.stage1_rounds = args.rounds // 2
    if args.stage2_rounds is None:
        args.stage2_rounds = args.rounds - args.stage1_rounds
    args.data_root = args.data_root or os.environ.get("HPCFL_DATA")
    return args


def budget(args: argparse.Namespace) -> str:
    local = (
        f"{args.local_steps} SGD steps (batch {args.batch})"
        if args.local_steps
        else f"{args.local_epochs} local epoch(s) (batch {args.batch})"
    )
    return (
        f"Fashion-MNIST, SimpleCNN, {args.clients} clients, {args.seeds} seeds. Baselines: R = {args.rounds} "
        f"rounds × {local}, lr chosen from {args.lrs} on a {100 * args.validation:g}% validation split "
        f"(last-{args.last} mean, seed 0), momentum 0, weight decay 1e-5, FedProx μ = {args.mu}. TCT: T1 = "
        f"{args.stage1_rounds} rounds of the same FedAvg (FedAvg's chosen lr), eNTK features of a fresh seeded 1-output head (p = {args.p}), T2 = "
        f"{args.stage2_rounds} stage-2 rounds of SCAFFOLD with M = {args.stage2_steps} local steps "
        f"(closed form), η2 = stage2.auto_lr (half the largest stable rate). "
        f"{args.jobs} run(s) at a time × {args.threads} thread(s), on {args.device}."
    )


def config(args: argparse.Namespace, partition: str, method: str) -> dict[str, Any]:
    """The run config of ``method`` on ``partition`` (without lr and seed)."""
    cfg: dict[str, Any] = dict(
        dataset="fashion-mnist",
        partition=partition,
        num_clients=args.clients,
        model="simplecnn",
        algorithm=method,
        rounds=args.rounds,
        local_epochs=args.local_epochs,
        local_steps=args.local_steps or None,
        momentum=0.0,
        weight_decay=1e-5,
        batch_size=args.batch,
        threads=args.threads,
        device=args.device,
        progress=False,
        eval_every=args.eval_every,
    )
    if args.data_root:
        cfg["data_root"] = args.data_root
    if method != "tct":
        cfg["validation"] = args.validation  # TCT's stage 2 evaluates on the test set only
    if method == "fedprox":
        cfg["fedprox"] = {"mu": args.mu}
    if method == "scaffold":
        cfg["params"] = {"form": "one_model"}  # TCT Appendix A.1
    if method == "tct":
        cfg["stage1"] = {"rounds": args.stage1_rounds}
        cfg["stage2"] = {
            "p": args.p,
            "rounds": args.stage2_rounds,
            "local_steps": args.stage2_steps,
            "auto_lr": True,
            "solver": "closed_form",
        }
    return cfg


def tct_setting(args: argparse.Namespace, partition: str, cells: list[Cell]) -> Setting:
    """TCT on ``partition`` at the stage-1 lr FedAvg chose there (``--lr`` without FedAvg)."""
    fedavg = next((c for c in cells if c.row == "fedavg" and c.column == partition and c.choice), None)
    lr = fedavg.choice.value if fedavg is not None else args.lr
    return Setting("tct", partition, config(args, partition, "tct"), (lr,))


def run_grid(args: argparse.Namespace, protocol: Protocol) -> list[Cell]:
    """The baselines under the protocol (lr search, then seeds), then TCT at FedAvg's lr."""
    seeds = list(range(args.seeds))
    baselines = [
        Setting(m, part, config(args, part, m), tuple(args.lrs))
        for part in args.partitions
        for m in args.methods
        if m != "tct"
    ]
    cells = run_protocol(baselines, seeds=seeds, out=args.out, jobs=args.jobs, protocol=protocol)
    if "tct" in args.methods:
        tct = [tct_setting(args, part, cells) for part in args.partitions]
        cells += run_protocol(tct, seeds=seeds, out=args.out, jobs=args.jobs, protocol=protocol)
    order = {(p, m): i for i, (p, m) in enumerate((p, m) for p in args.partitions for m in args.methods)}
    return sorted(cells, key=lambda c: order[(c.column, c.row)])


# ----------------------------------------------------------------------------------------------
# Figure 3


def figure3_runs(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Stage-2 re-solves on the Figure 3 partition's TCT run: {label: metrics rows}."""
    tct = Setting("tct", args.fig3_partition, {}, (args.fig3_lr,))
    run_dir = run_dir_of(args.out, tct, args.fig3_lr, 0)
    rounds = args.fig3_rounds
    sweeps: dict[str, list[str]] = {
        f"TCT, M = {m}": [f"stage2.local_steps={m}", f"stage2.rounds={rounds}"] for m in args.fig3_steps
    }
    out = {label: _tct_stage2(run_dir, pairs, rounds) for label, pairs in sweeps.items()}
    lr = next(iter(out.values()))[0]["stage2_lr"]  # η2 that stage2.auto_lr chose for this run
    for scale, name in ((1.9, "1.9·η2"), (1.0, "η2"), (0.1, "η2/10")):
        pairs = [
            "stage2.variant=gd",
            "stage2.auto_lr=false",
            f"stage2.lr={lr * scale:.6e}",
            f"stage2.rounds={rounds}",
        ]
        out[f"GD, η = {name}"] = _tct_stage2(run_dir, pairs, rounds)
    return out


def _tct_stage2(run_dir: Path, pairs: list[str], rounds: int) -> list[dict[str, Any]]:
    """``hpcfl tct-stage2 RUN_DIR --set PAIRS`` unless its metrics are already complete."""
    from hpcfl.cli.tct_stage2 import _sweep_config
    from hpcfl.files import read_jsonl

    _, tag = _sweep_config(run_dir, pairs)
    metrics = run_dir / "stage2" / tag / "metrics.jsonl"
    rows = read_jsonl(metrics) if metrics.exists() else []
    if len(rows) < rounds:
        cmd = [sys.executable, "-m", "hpcfl", "tct-stage2", str(run_dir), "--set", *pairs]
        print("$ hpcfl " + " ".join(cmd[3:]), flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        (metrics.parent / "WALL_SECONDS").write_text(f"{time.perf_counter() - t0:.1f}\n")
        rows = read_jsonl(metrics)
    wall = metrics.parent / "WALL_SECONDS"
    seconds = float(wall.read_text()) if wall.exists() else float("nan")
    return [{**r, "sweep_seconds": seconds} for r in rows]


# ----------------------------------------------------------------------------------------------
# summary


def summarise(args: argparse.Namespace, cells: list[Cell], protocol: Protocol) -> list[dict[str, Any]]:
    """Per (partition, method): our last-k mean and std over seeds beside the paper's number."""
    from hpcfl.report.protocol import mean_std

    table = []
    for c in cells:
        mean, std = mean_std(c.last_k(protocol.last_k))
        table.append(
            {
                "partition": c.column,
                "method": c.row,
                "ours_last_k_mean": round(100 * mean, 2),
                "ours_last_k_std": round(100 * std, 2),
                "seeds": c.n,
                "chosen_lr": None if c.choice is None else c.choice.value,
                "paper": PAPER[c.row][c.column],
                "status": "ok" if c.n else "failed",
            }
        )
    return table


def shape_checks(args: argparse.Namespace, table: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    """The required shape on the last-k means: TCT ≥ every baseline + 30 at #C=1, within 2 of the
    best baseline elsewhere."""
    acc = {(r["partition"], r["method"]): r["ours_last_k_mean"] for r in table}
    checks = []
    baselines = [m for m in args.methods if m != "tct"]
    if "tct" not in args.methods or not baselines:
        return checks
    for part in args.partitions:
        best = max((acc[(part, m)] for m in baselines if acc[(part, m)] == acc[(part, m)]), default=0.0)
        tct = acc[(part, "tct")]
        if part == "classes:1":
            checks.append(
                (f"{COLUMN[part]}: TCT {tct:.2f} ≥ best baseline {best:.2f} + 30", tct >= best + 30)
            )
        else:
            checks.append((f"{COLUMN[part]}: TCT {tct:.2f} ≥ best baseline {best:.2f} − 2", tct >= best - 2))
    return checks


def markdown(args: argparse.Namespace, table: list[dict[str, Any]], checks, protocol: Protocol) -> str:
    """Ours (last-k mean ± std over seeds) beside the paper's, and the shape checks."""
    acc = {(r["partition"], r["method"]): r for r in table}
    head = "| method | " + " | ".join(f"{COLUMN[p]} ours (paper)" for p in args.partitions) + " |"
    lines = [head, "|---" * (len(args.partitions) + 1) + "|"]
    for m in args.methods:
        cells = []
        for p in args.partitions:
            r = acc[(p, m)]
            std = f" ± {r['ours_last_k_std']:.2f}" if r["ours_last_k_std"] == r["ours_last_k_std"] else ""
            ours = f"{r['ours_last_k_mean']:.2f}{std}" if r["status"] == "ok" else "failed"
            cells.append(f"{ours} ({PAPER[m][p]:.2f})")
        lines.append(f"| {LABELS[m]} | " + " | ".join(cells) + " |")
    lines.append(f"| Centralised (paper) | {PAPER_CENTRALISED:.2f} |" + " |" * (len(args.partitions) - 1))
    return "\n".join(
        [
            f"## Ours beside the paper: last-{protocol.last_k} mean ± std over seeds (%) (TCT Table 2: final "
            "accuracy after 200 rounds × 5 epochs for the baselines; 100 + 100 rounds and p = 100,000 for TCT)",
            "",
            *lines,
            "",
            "Shape checks on the last-k means (TCT beats every baseline by ≥ 30 points at #C=1, is within 2 "
            "points of the best baseline or better elsewhere):",
            "",
            *[f"- {'PASS' if ok else 'FAIL'}: {text}" for text, ok in checks],
            "",
        ]
    )


def plot_figure3(args: argparse.Namespace, curves: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for label, rows in curves.items():
        label = f"{label} = {rows[0]['stage2_lr']:.2g}" if label.startswith("GD") else label
        first = rows[0]["round"] - 1
        style = dict(ls=":", marker="s") if label.startswith("GD") else dict(ls="--", marker="o")
        ax.plot(
            [r["round"] - first for r in rows],
            [100 * r["train_accuracy"] for r in rows],
            ms=3,
            label=label,
            **style,
        )
    ax.set_xlabel("stage-2 communication round")
    ax.set_ylabel("stage-2 training accuracy (%)")
    lr = next(iter(curves.values()))[0]["stage2_lr"]
    ax.set_title(
        f"Fashion-MNIST {COLUMN[args.fig3_partition]}, stage 2 (p = {args.p}, η2 = {lr:.2g}):\n"
        "TCT (SCAFFOLD, M local steps at η2) vs full-batch GD",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    protocol = Protocol(last_k=args.last, window=args.window)
    args.out.mkdir(parents=True, exist_ok=True)
    args.results.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    print(budget(args), flush=True)
    cells = run_grid(args, protocol)
    table = summarise(args, cells, protocol)
    checks = shape_checks(args, table)
    fig3: dict[str, list[dict[str, Any]]] = {}
    if args.figure3 and "tct" in args.methods and args.fig3_partition in args.partitions:
        args.fig3_lr = tct_setting(args, args.fig3_partition, cells).lrs[0]
        fig3 = figure3_runs(args)
        plot_figure3(args, fig3, args.results / "tct_figure3.png")
    fig3_s = sum(rows[0]["sweep_seconds"] for rows in fig3.values() if rows)
    targets = column_targets(cells, args.partitions, protocol)
    header = (
        "# TCT Table 2, Fashion-MNIST rows, on a CPU budget\n\n"
        f"**Budget.** {budget(args)} This invocation: {time.perf_counter() - t0:.0f} s wall (runs already "
        "DONE are not re-run)" + (f"; Figure 3 re-solves: {fig3_s:.0f} s." if fig3_s else ".")
    )
    stem = args.results / "tct_fmnist_table"
    md = write_tables(cells, protocol, targets, stem, header) + "\n" + markdown(args, table, checks, protocol)
    if fig3:
        marks = sorted({r for r in (1, 2, 5, 10, 20, args.fig3_rounds) if r <= args.fig3_rounds})
        md += f"\nFigure 3(a): stage-2 training accuracy (%) on {COLUMN[args.fig3_partition]} after stage-2 round …\n\n"
        md += "| curve | " + " | ".join(f"{r}" for r in marks) + " |\n"
        md += "|---" * (len(marks) + 1) + "|\n"
        for label, rows in fig3.items():
            cells_ = [f"{100 * rows[r - 1]['train_accuracy']:.2f}" for r in marks]
            md += f"| {label} | " + " | ".join(cells_) + " |\n"
    stem.with_suffix(".md").write_text(md)
    (args.out / "summary.json").write_text(
        json.dumps(
            with_machine({"budget": budget(args), "table": table, "checks": checks, "figure3": fig3}),
            indent=1,
        )
    )
    print(md)
    print(f"wrote {stem}.{{md,csv,json,png}}, tct_figure3.png")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
