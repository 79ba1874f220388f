"""Personalised FL against the global-model methods (issue 41), judged per client: Fashion-MNIST
``dir:0.1`` and ``classes:2``, 20 clients, each client's accuracy on its own held-out share
(``client_eval``), mean and worst-10 % (p10) over clients, last-5 mean ± std over 3 seeds.

    HPCFL_DATA=/path/to/datasets python benchmarks/personalised_table.py

What each row is judged by (the figure a user of the method would deploy per client):

- ``fedavg``, ``scaffold``, ``fedpvr``: the global model on each client's held-out share
  (``client_acc_*``); ``tct``: its stage-2 linear model on each client's held-out share (through the
  share's eNTK features); ``feduv`` learns a global model (``client_acc_*``);
- ``fedavg + fine-tuning`` (row ``fedavg-ft``): FedAvg, the global model fine-tuned on each
  client's training data for ``--finetune-steps`` plain SGD steps before it is scored
  (``finetune_eval``, which never changes the trajectory, at the run's lr);
- ``fedper``, ``fedrep``, ``fedbabu``, ``ditto``, ``apfl``: each client's own model
  (``personal_acc_*``).

**Budget** (the defaults, small on purpose: a 2-core machine shared with others): the MLP (784-100-10),
20 rounds × 10 local steps of batch 32, momentum 0.5, weight decay 1e-5, every method at its paper or
authors'-code defaults (FedRep 10 head passes + 1 body pass of the 10-step schedule, FedBABU τ_f = 5
fine-tuning epochs, FedPVR's variance reduction on the classifier — its "last layers" on an MLP whose
every layer is Linear, where the paper's default mask would make it SCAFFOLD), 10 % of each client's
training data held out as its validation share and 25 % of the rest as its held-out (test) share,
evaluated every 2 rounds (so the last-5 mean covers rounds 12–20), 3 seeds. TCT splits the 20 rounds
as 10 FedAvg + 10 on the convexified problem (p = 2,000 eNTK coordinates, M = 500 local steps, η2
automatic, closed form), as the Fashion-MNIST sweep does. Not in the table: FedBN (the MLP has no
normalisation layer, so FedBN is FedAvg bit for bit).

**Hyper-parameters are chosen on validation, never on the held-out (test) share.** Per method and
partition, every candidate — the lr from ``--lrs`` (default 0.02 0.05 0.1), crossed with the
method's own weight where it has one (Ditto λ ∈ {0.1, 1}, APFL α ∈ {0.25, 0.5}, FedUV's variance
weight ∈ {1, 2.5}) — runs at seed 0; the one with the best last-5 mean of the row's figure *on the
clients' validation shares* (``personal_val_acc_mean``, ``finetune_val_acc_mean`` or
``client_val_acc_mean``: the same models scored on each client's own validation share) is chosen
(ties to the smaller lr), and seeds 1 and 2 run at it (seed 0's run is reused). TCT's stage 1 is
FedAvg: it runs at FedAvg's chosen lr (its stage 2's η2 is set by the stability bound).

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
    "fedpvr": ("fedpvr", {"layers": ["classifier"]}),
    "tct": ("tct", {"stage2": {"p": 2000, "local_steps": 500, "auto_lr": True, "solver": "closed_form"}}),
    "fedper": ("fedper", {}),
    "fedrep": ("fedrep", {}),
    "fedbabu": ("fedbabu", {}),
    "ditto": ("ditto", {}),
    "apfl": ("apfl", {}),
    "feduv": ("feduv", {}),
}
PERSONALISED = {"fedper", "fedrep", "fedbabu", "ditto", "apfl"}
#: row -> (params key, values): the method's own weight, searched beside the lr
OWN: dict[str, tuple[str, tuple[float, ...]]] = {
    "ditto": ("lam", (0.1, 1.0)),
    "apfl": ("alpha", (0.25, 0.5)),
    "feduv": ("variance_weight", (1.0, 2.5)),
}


def judged_metric(row: str) -> str:
    """The per-client figure a row is judged (and its lr chosen) by."""
    if row in PERSONALISED:
        return "personal_acc"
    return "finetune_acc" if row == "fedavg-ft" else "client_acc"


def validation_metric(row: str) -> str:
    """What a row's candidates are chosen by: its judged figure on the clients' validation shares."""
    model = judged_metric(row).removesuffix("_acc")
    return f"{model}_val_acc_mean"


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


def config(args: argparse.Namespace, partition: str, row: str) -> dict[str, Any]:
    """The run of ``row`` on ``partition`` (without ``lr`` and ``seed``)."""
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
        validation=0.1,
        client_eval=0.25,
        threads=args.threads,
        progress=False,
        params=params,
    )
    if row == "tct":  # the rounds split in halves: FedAvg, then the convexified problem
        first = args.rounds // 2
        cfg["params"] = {
            "stage1": {"rounds": first},
            "stage2": {**params["stage2"], "rounds": args.rounds - first},
        }
    if row == "fedavg-ft":  # FedAvg's trajectory, scored after per-client fine-tuning at the run's lr
        cfg["finetune_eval"] = {"steps": args.finetune_steps}  # lr: the run's (Setting.lr_keys)
    if args.data_root:
        cfg["data_root"] = args.data_root
    return cfg


def choices_table(cells: list[Cell], partitions: list[str], fixed: dict[tuple[str, str], float]) -> str:
    """Which candidate each row got per partition, with every candidate's validation score
    (``fixed``: the lr of a row that was not searched)."""
    lines = ["| method (chosen by) | " + " | ".join(partitions) + " |", "|---|" + "---|" * len(partitions)]
    by = {(c.row, c.column): c for c in cells}
    for row in dict.fromkeys(c.row for c in cells):
        out = []
        for part in partitions:
            c = by.get((row, part))
            if c is None or c.choice is None:
                lr = fixed.get((row, part))
                out.append("— (every candidate failed)" if lr is None else f"lr {lr:g} (fixed)")
                continue
            scores = ", ".join(f"{_show(v)}: {100 * m:.2f}" for v, m in c.choice.candidates.items())
            out.append(f"**{_show(repr(c.choice.value))}** ({scores})")
        by_what = "FedAvg's lr" if row == "tct" else validation_metric(row)
        lines.append(f"| {row} ({by_what}) | " + " | ".join(out) + " |")
    return "\n".join(lines)


def _show(value: str) -> str:
    """A candidate's repr as the table shows it: ``0.05`` or ``lr 0.05, lam 0.1``."""
    import ast

    v = ast.literal_eval(value)
    return f"lr {v[0]:g}, own {v[1]:g}" if isinstance(v, tuple) else f"lr {v:g}"


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
    lrs = tuple(sorted(args.lrs))
    seeds = list(range(args.seeds))

    def setting(row: str, part: str, lrs: tuple[float, ...]) -> Setting:
        return Setting(
            row,
            part,
            config(args, part, row),
            lrs,
            own=OWN.get(row),
            judge=validation_metric(row),
            lr_keys=("lr", "finetune_eval.lr") if row == "fedavg-ft" else ("lr",),
        )

    searched = [setting(row, part, lrs) for part in args.partitions for row in args.rows if row != "tct"]
    cells = run_protocol(searched, seeds=seeds, out=args.out, jobs=args.jobs, protocol=protocol)
    fixed: dict[tuple[str, str], float] = {}
    if "tct" in args.rows:  # stage 1 is FedAvg: FedAvg's chosen lr (run FedAvg's search if not asked)
        fedavg = {c.column: c for c in cells if c.row == "fedavg"}
        missing = [p for p in args.partitions if p not in fedavg]
        if missing:
            extra = [setting("fedavg", p, lrs) for p in missing]
            for c in run_protocol(extra, seeds=seeds[:1], out=args.out, jobs=args.jobs, protocol=protocol):
                fedavg[c.column] = c
        tct = []
        for part in args.partitions:
            choice = fedavg[part].choice
            lr = lrs[0] if len(lrs) == 1 else None if choice is None else float(choice.value)
            if lr is not None:
                fixed[("tct", part)] = lr
                tct.append(setting("tct", part, (lr,)))
        cells += run_protocol(tct, seeds=seeds, out=args.out, jobs=args.jobs, protocol=protocol)
    for c in cells:
        if c.choice is None and len(lrs) == 1:
            fixed.setdefault((c.row, c.column), lrs[0])
    order = {row: i for i, row in enumerate(ROWS)}
    cells.sort(key=lambda c: (args.partitions.index(c.column), order[c.row]))
    targets = column_targets(cells, args.partitions, protocol)
    search = (
        f"lr {lrs[0]:g} fixed (no search)"
        if len(lrs) == 1
        else f"lr from {list(lrs)} (× the method's own weight) chosen on the clients' validation shares"
    )
    header = (
        "# Personalised FL, Fashion-MNIST, judged per client\n\n"
        f"**Budget.** {args.model}, {args.clients} clients, {args.rounds} rounds × {args.local_steps} local "
        f"steps (batch {args.batch}), {search}, momentum {args.momentum}, weight decay 1e-5, paper or "
        f"authors'-code defaults for every method, 10 % of each client's data held out for validation and "
        f"25 % of the rest for its evaluation, evaluated every {args.eval_every} rounds, {args.seeds} seeds, "
        f"{args.jobs} run(s) at a time × {args.threads} thread(s); wall time "
        f"{time.perf_counter() - t0:.0f} s (runs already finished count 0).\n\n"
        f"## Per-client accuracy on each client's held-out share (%, last-{args.last} evaluated rounds, "
        "mean ± std over seeds)\n\n"
        + judged(cells, args.partitions, args.last)
        + f"\n\n## What each row was chosen by (seed 0, last-{args.last} mean on the validation shares, %)\n\n"
        + choices_table(cells, args.partitions, fixed)
        + "\n\n# The protocol tables (test accuracy of each method's global model on the test set)"
    )
    stem = args.results / "personalised_fmnist"
    text = write_tables(cells, protocol, targets, stem, header)
    print(text)
    print(f"wrote {stem}.{{md,csv,json,png}}; runs under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
