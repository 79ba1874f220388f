"""Personalised FL against the global-model methods (issue 41), judged per client: Fashion-MNIST
``dir:0.1`` and ``classes:2``, 20 clients, each client's accuracy on its own held-out share
(``client_eval``), mean and worst-10 % (p10) over clients, last-5 mean ± std over 3 seeds.

    HPCFL_DATA=/path/to/datasets python benchmarks/personalised_table.py

What each row is judged by (the figure a user of the method would deploy per client):

- ``fedavg``, ``scaffold``: the global model on each client's held-out share (``client_acc_*``);
- ``fedavg + fine-tuning`` (row ``fedavg-ft``): FedAvg, the global model fine-tuned on each
  client's training data for ``--finetune-steps`` plain SGD steps before it is scored
  (``finetune_eval``, which never changes the trajectory); its lr is chosen by that fine-tuned
  figure, so its runs are its own (the same as the ``fedavg`` row's when both choose one lr);
- ``fedper``, ``fedrep``, ``fedbabu``, ``ditto``, ``apfl``: each client's own model
  (``personal_acc_*``); ``feduv`` learns a global model (``client_acc_*``).

**Budget** (the defaults, small on purpose: a 2-core machine shared with others): the MLP, 20
rounds × 10 local steps of batch 32, momentum 0.5, weight decay 1e-5, every method at its paper or
authors'-code defaults (FedRep 10 head passes + 1 body pass of the 10-step schedule, FedBABU τ_f = 5
fine-tuning epochs, Ditto λ = 1, APFL α₀ = 0.5 adaptive, FedUV λ = 2.5, μ = 0.5), 25 % of each
client held out for its evaluation, evaluated every 2 rounds (so the last-5 mean covers rounds
12–20), 3 seeds. Not in the table at this budget: FedBN (the MLP has no normalisation layer, so
FedBN is FedAvg bit for bit), FedPVR and TCT (TCT's stage 2 needs eNTK features: minutes per run
even here), and the choice of each method's own weight (λ, α, ...).

**The learning rate** of each method and partition is chosen from ``--lrs`` (default 0.02 0.05
0.1) before any reported run, on a *selection replicate*: one run per candidate at
``--selection-seed`` (default 100, not among the reported seeds 0 .. seeds−1, so its partition draw
and its clients' held-out shares are its own), scored by the figure the table reports for that row
(``personal_acc_mean`` for a personalised method, ``client_acc_mean`` for a global one,
``finetune_acc_mean`` for FedAvg + fine-tuning, which therefore may run at another lr than the
FedAvg row), last-k mean; ties go to the smaller lr. Why not ``validation:`` and ``hpcfl sweep
--search``: that split is scored by the server's model only (``val_accuracy``), which for FedPer
and FedRep carries the initial head and for Ditto and APFL is FedAvg's w, so it cannot choose a
personal model's lr; scoring each client's personal model on its own ``validation`` share is not in
the runner yet. ``--lrs 0.05`` fixes the lr (no selection runs).

Writes ``--out``/runs (ordinary run directories, reused when finished) and
``--results``/personalised_fmnist.{md,csv,json,png} (the protocol tables of every row, plus the
per-client table above).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from _runs import Setting, column_targets, run_protocol, write_tables

from hpcfl.report.methods import Cell
from hpcfl.report.protocol import Protocol
from hpcfl.report.protocol import fmt_mean_std as fmt

#: row -> (algorithm, params)
ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    "fedavg": ("fedavg", {}),
    "fedavg-ft": ("fedavg", {}),  # FedAvg judged after per-client fine-tuning: its own lr choice
    "scaffold": ("scaffold", {}),
    "fedper": ("fedper", {}),
    "fedrep": ("fedrep", {}),
    "fedbabu": ("fedbabu", {}),
    "ditto": ("ditto", {}),
    "apfl": ("apfl", {}),
    "feduv": ("feduv", {}),
}
PERSONALISED = {"fedper", "fedrep", "fedbabu", "ditto", "apfl"}


def judged_metric(row: str) -> str:
    """The per-client figure a row is judged (and its lr chosen) by."""
    if row in PERSONALISED:
        return "personal_acc"
    return "finetune_acc" if row == "fedavg-ft" else "client_acc"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-root", help="datasets directory (default: $HPCFL_DATA)")
    p.add_argument("--partitions", nargs="+", default=["dir:0.1", "classes:2"])
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lrs", type=float, nargs="+", default=[0.02, 0.05, 0.1])
    p.add_argument("--selection-seed", type=int, default=100, help="the replicate the lr is chosen on")
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--model", default="mlp")
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--finetune-steps", type=int, default=10)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--last", type=int, default=5, help="k of the last-k mean (evaluated rounds)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench-out/personalised"))
    p.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    return p.parse_args(argv)


def config(args: argparse.Namespace, partition: str, row: str, lr: float) -> dict[str, Any]:
    """The run of ``row`` on ``partition`` (without ``lr`` and ``seed``; ``lr`` sets FedAvg's
    fine-tuning lr, which follows the run's)."""
    algorithm, params = ROWS[row]
    cfg: dict[str, Any] = dict(
        dataset="fashion-mnist",
        partition=partition,
        num_clients=args.clients,
        model=args.model,
        algorithm=algorithm,
        rounds=args.rounds,
        local_steps=args.local_steps,
        batch_size=args.batch,
        momentum=args.momentum,
        weight_decay=1e-5,
        eval_every=args.eval_every,
        client_eval=0.25,
        threads=args.threads,
        progress=False,
        params=params,
    )
    if row == "fedavg-ft":  # FedAvg's trajectory, scored after per-client fine-tuning
        cfg["finetune_eval"] = {"steps": args.finetune_steps, "lr": lr}
    if args.data_root:
        cfg["data_root"] = args.data_root
    return cfg


def choose_lrs(args: argparse.Namespace, protocol: Protocol) -> dict[tuple[str, str], Any]:
    """Each (row, partition)'s lr: every candidate of ``--lrs`` run once at ``--selection-seed`` (a
    replicate none of the reported runs is), the one with the best last-k mean of the row's judged
    figure chosen (:func:`hpcfl.sweep.select.choose`: ties to the first, i.e. the smaller lr). With
    one candidate, that value (no runs). Returns (row, partition) -> Choice or the fixed lr."""
    from _runs import _run_all, run_dir_of

    from hpcfl.report import summarise
    from hpcfl.report.protocol import last_k_mean
    from hpcfl.sweep.select import choose

    lrs = sorted(args.lrs)
    pairs = [(row, part) for part in args.partitions for row in args.rows]
    if len(lrs) == 1:
        return {pair: lrs[0] for pair in pairs}
    selection = args.out / "selection"

    def cfg(row: str, part: str, lr: float) -> dict[str, Any]:
        name = f"select-{part}-{row}-lr{lr:g}"
        return {**config(args, part, row, lr), "name": name, "lr": lr, "seed": args.selection_seed}

    def where(row: str, part: str, lr: float) -> Path:
        return run_dir_of(selection, Setting(row, part, {}, ()), lr, args.selection_seed)

    _run_all([(cfg(r, p, lr), str(where(r, p, lr))) for r, p in pairs for lr in lrs], args.jobs)
    chosen = {}
    for row, part in pairs:
        vals: dict[int, list[float | None]] = {}
        for i, lr in enumerate(lrs):
            d = where(row, part, lr)
            rows = summarise(d).rows if (d / "DONE").exists() else []
            score = last_k_mean(rows, protocol.last_k, f"{judged_metric(row)}_mean")
            vals[i] = [score]
        chosen[(row, part)] = choose(lrs, vals)
    return chosen


def lr_table(chosen: dict[tuple[str, str], Any], partitions: list[str], k: int) -> str:
    """Which lr each row got per partition, with every candidate's selection score."""
    lines = ["| method | " + " | ".join(partitions) + " |", "|---|" + "---|" * len(partitions)]
    for row in dict.fromkeys(r for r, _ in chosen):
        cells = []
        for part in partitions:
            c = chosen[(row, part)]
            if c is None:
                cells.append("— (every candidate failed)")
            elif isinstance(c, float):
                cells.append(f"{c:g} (fixed)")
            else:
                scores = ", ".join(f"{float(v):g}: {100 * m:.2f}" for v, m in c.candidates.items())
                cells.append(f"**{c.value:g}** ({scores})")
        lines.append(f"| {row} ({judged_metric(row)}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def judged(cells: list[Cell], partitions: list[str], k: int) -> str:
    """The per-client table: each row's deployed figure, mean and p10 over clients."""
    rows: list[tuple[str, str, str]] = []  # (label, cell row, metric prefix)
    for cell_row in dict.fromkeys(c.row for c in cells):
        if cell_row == "fedavg":
            rows.append(("fedavg (global)", "fedavg", "client_acc"))
        elif cell_row == "fedavg-ft":
            rows.append(("fedavg + fine-tuning", "fedavg-ft", "finetune_acc"))
        elif cell_row in PERSONALISED:
            rows += [
                (f"{cell_row} (personal)", cell_row, "personal_acc"),
                (f"{cell_row} (global)", cell_row, "client_acc"),
            ]
        else:
            rows.append((f"{cell_row} (global)", cell_row, "client_acc"))
    by = {(c.row, c.column): c for c in cells}
    head = "| method (judged by) | " + " | ".join(f"{p} mean | {p} p10" for p in partitions) + " |"
    lines = [head, "|---|" + "---:|---:|" * len(partitions)]
    for label, cell_row, prefix in rows:
        out = []
        for p in partitions:
            c = by.get((cell_row, p))
            out += (
                ["—", "—"]
                if c is None
                else [fmt(c.last_k(k, f"{prefix}_mean")), fmt(c.last_k(k, f"{prefix}_p10"))]
            )
        lines.append(f"| {label} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    protocol = Protocol(last_k=args.last)
    t0 = time.perf_counter()
    chosen = choose_lrs(args, protocol)

    def lr_of(row: str, part: str) -> float | None:
        c = chosen[(row, part)]
        return c if isinstance(c, float) else None if c is None else float(c.value)

    settings = [
        Setting(row, part, config(args, part, row, lr), (lr,))
        for part in args.partitions
        for row in args.rows
        if (lr := lr_of(row, part)) is not None
    ]
    cells = run_protocol(
        settings, seeds=list(range(args.seeds)), out=args.out, jobs=args.jobs, protocol=protocol
    )
    targets = column_targets(cells, args.partitions, protocol)
    lr_text = (
        f"lr {args.lrs[0]:g} fixed (no selection)"
        if len(args.lrs) == 1
        else f"lr chosen per method and partition from {sorted(args.lrs)} on a selection replicate "
        f"(seed {args.selection_seed}, not reported; see below)"
    )
    header = (
        "# Personalised FL, Fashion-MNIST, judged per client\n\n"
        f"**Budget.** {args.model}, {args.clients} clients, {args.rounds} rounds × {args.local_steps} local "
        f"steps (batch {args.batch}), {lr_text}, momentum {args.momentum}, weight decay "
        f"1e-5, paper or authors'-code defaults for every method, 25 % of each client held out, evaluated every "
        f"{args.eval_every} rounds, {args.seeds} seeds, {args.jobs} run(s) at a time × {args.threads} "
        f"thread(s); wall time {time.perf_counter() - t0:.0f} s (runs already finished count 0).\n\n"
        f"## Per-client accuracy (%, last-{args.last} evaluated rounds, mean ± std over seeds)\n\n"
        + judged(cells, args.partitions, args.last)
        + f"\n\n## The lr of each row (selection replicate: last-{args.last} mean of the judged figure, %)\n\n"
        + lr_table(chosen, args.partitions, args.last)
        + "\n\n# The protocol tables (test accuracy of each method's global model)"
    )
    stem = args.results / "personalised_fmnist"
    text = write_tables(cells, protocol, targets, stem, header)
    print(text)
    print(f"wrote {stem}.{{md,csv,json,png}}; runs under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
