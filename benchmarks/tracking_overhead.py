"""Issue 28's measurements: logger overhead, per-client evaluation cost, and the client-accuracy table.

    HPCFL_DATA=/path/to/datasets python benchmarks/tracking_overhead.py                # all three
    HPCFL_DATA=... python benchmarks/tracking_overhead.py --parts loggers client-eval    # no table

1. **loggers**: FedAvg on Fashion-MNIST (SimpleCNN, 10 clients, ``dir:0.1``), ``--rounds`` rounds once
   per logger (none, tensorboard, mlflow, wandb offline), in this process. Per round, the seconds
   the loggers spent writing the round's row (:meth:`hpcfl.runner.loggers.Loggers.flush`, timed
   around the call) against the round's own seconds (``seconds`` of its metrics row); opening and
   closing (one-off: MLflow creates its SQLite store, W&B starts its service) are reported apart.
   Issue 28's bar: ≤ 2 % of a round.
2. **client-eval**: the cost of one evaluated round's per-client evaluation
   (:class:`hpcfl.runner.client_eval.ClientEval`) against the test-set evaluation of the same model,
   on synthetic data (``--synthetic-train`` samples, iid) with K = 10 clients (all evaluated) and
   K = 1,000 (M = ``--sample`` = 100 sampled per round), each with ``client_eval`` = 0.1; with
   ``--finetune-steps`` S > 0 also the fine-tuning evaluation. Median of ``--repeats`` calls after
   one warm-up, on an untrained model (the cost does not depend on the weights).
3. **table**: Fashion-MNIST ``dir:0.1``, ``--seeds`` seeds, FedAvg, SCAFFOLD, FedProx (μ = 0.01) and
   TCT, the sweep's budget (configs/fmnist_sweep.yaml: 10 clients, 10 rounds of one local epoch; TCT
   5 + 5) with ``client_eval: 0.1`` and ``finetune_eval: {steps: 20, lr: 0.01, rounds: last}``,
   through ``benchmarks/_runs.py`` (the protocol's tables, now with ``client_acc_p10`` beside test
   accuracy) plus one table of the final round: test accuracy, client p10 / mean / p90 and the
   fine-tuned mean, mean ± std over seeds. TCT's final per-client numbers are those of its stage-2
   linear model on each client's held-out eNTK features; its fine-tuning takes the 20 local steps
   of the client's stage-2 solver at stage 2's own η2, not at lr 0.01
   (:func:`hpcfl.tct.pipeline.prepare_stage2`). Runs are cached in ``--out``/table (a finished run
   is not re-run): to re-run one method alone, delete its runs there (``method=TCT``) and run
   ``--parts table`` again.

Budget (estimated, not timed end to end here): part 1 ≈ 4 × (rounds × ~10 s + start-up) ≈ 4 min at 5
rounds on 2 cores; part 2 ≈ 1 min; part 3 = 12 runs of 10 rounds ≈ 20–25 min two at a time. Run it
alone on the machine: the figures are ratios within one run. Writes ``--out``/tracking_overhead.{json,
md} (and the table's ``tracking_table.{md,csv,json,png}``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from hpcfl.bench.machine import with_machine

LOGGERS = ("none", "tensorboard", "mlflow", "wandb")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", default=["loggers", "client-eval", "table"],
                   choices=["loggers", "client-eval", "table"])  # fmt: skip
    p.add_argument("--data-root", help="datasets directory (default: $HPCFL_DATA)")
    p.add_argument("--rounds", type=int, default=5, help="rounds per logger run (part 1)")
    p.add_argument("--loggers", nargs="+", default=list(LOGGERS), choices=list(LOGGERS))
    p.add_argument("--clients", nargs="+", type=int, default=[10, 1000], help="K of part 2")
    p.add_argument("--sample", type=int, default=100, help="M clients evaluated per round when K > M")
    p.add_argument("--synthetic-train", type=int, default=100_000)
    p.add_argument("--synthetic-test", type=int, default=10_000)
    p.add_argument("--finetune-steps", type=int, default=0, help="part 2: also time fine-tuning (S steps)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seeds", type=int, default=3, help="part 3")
    p.add_argument("--table-rounds", type=int, default=10, help="part 3 (TCT: half and half)")
    p.add_argument("--jobs", type=int, default=2, help="part 3: runs at a time")
    p.add_argument("--tct-p", type=int, default=2000, help="part 3: TCT's eNTK feature count")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/tracking_overhead"))
    return p.parse_args(argv)


def fmnist_config(args: argparse.Namespace, **keys: Any) -> dict[str, Any]:
    """The sweep's base (configs/fmnist_sweep.yaml) on ``dir:0.1``."""
    return {
        "name": "tracking",
        "dataset": "fashion-mnist",
        "data_root": args.data_root,
        "partition": "dir:0.1",
        "num_clients": 10,
        "model": "simplecnn",
        "algorithm": "fedavg",
        "rounds": args.rounds,
        "local_epochs": 1,
        "lr": 0.01,
        "batch_size": 64,
        "threads": args.threads,
        "progress": False,
        **keys,
    }


def measure_loggers(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Part 1: per logger, the seconds its flush took per round against the round's seconds."""
    from hpcfl.config import config_from_dict
    from hpcfl.runner import run_experiment
    from hpcfl.runner.loggers import Loggers

    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    flushes: list[float] = []
    original = Loggers.flush

    def timed(self: Loggers, rows: Any) -> None:
        t = time.perf_counter()
        original(self, rows)
        flushes.append(time.perf_counter() - t)

    Loggers.flush = timed  # type: ignore[method-assign]
    out = []
    try:
        for name in args.loggers:
            flushes.clear()
            cfg = config_from_dict(fmnist_config(args, loggers=[] if name == "none" else [name]))
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                result = run_experiment(cfg, Path(tmp) / "run")
                wall = time.perf_counter() - t0
            rounds = [float(r["seconds"]) for r in result.metrics]
            per_round = flushes[1:]  # the first flush is the catch-up at opening (nothing to write)
            entry = {
                "logger": name,
                "rounds": len(rounds),
                "round_s_median": statistics.median(rounds),
                "flush_s_median": statistics.median(per_round) if per_round else 0.0,
                "flush_s_max": max(per_round, default=0.0),
                "wall_s": wall,
                "outside_rounds_s": wall - sum(rounds) - sum(flushes),  # data, model, open/close, ...
            }
            entry["overhead_pct"] = 100 * entry["flush_s_median"] / entry["round_s_median"]
            print(
                f"{name:12s} round {entry['round_s_median']:.3f} s  flush {entry['flush_s_median'] * 1e3:.2f} ms "
                f"({entry['overhead_pct']:.2f} %)  wall {wall:.1f} s",
                flush=True,
            )
            out.append(entry)
    finally:
        Loggers.flush = original  # type: ignore[method-assign]
    return out


def measure_client_eval(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Part 2: one evaluated round's per-client evaluation against the test evaluation, per K."""
    import torch

    torch.set_num_threads(args.threads)
    return [_client_eval_at(args, K) for K in args.clients]


def _client_eval_at(args: argparse.Namespace, K: int) -> dict[str, Any]:
    import torch

    from hpcfl.algorithms.participation import Population
    from hpcfl.algorithms.stage_types import EVAL_SLOT
    from hpcfl.comm import LocalComm
    from hpcfl.config import config_from_dict
    from hpcfl.runner.client_eval import ClientEval, EvalSettings
    from hpcfl.runner.federation import build_federation
    from hpcfl.runner.observers import LocalWork, RoundEnd, RoundStart
    from hpcfl.training.evaluate import JointCounts

    sampled = K > args.sample
    cfg = config_from_dict(
        {
            "name": f"clients{K}",
            "dataset": "synthetic",
            "dataset_options": {"n_train": args.synthetic_train, "n_test": args.synthetic_test, "seed": 0},
            "partition": "iid",
            "num_clients": K,
            "model": "simplecnn",
            "client_eval": 0.1,
            "client_eval_clients": args.sample if sampled else None,
            "finetune_eval": {"steps": args.finetune_steps, "lr": 0.01},
            "threads": args.threads,
            "progress": False,
        }
    )
    fed = build_federation(cfg, LocalComm())
    server = fed.algorithm.init_server(fed.flat.vector.clone())
    observer = ClientEval.for_federation(fed, EvalSettings.of(fed.cfg, 0, 1), fed.validation_parts)
    evaluate = fed.model_plan().evaluate

    def client_round(rnd: int) -> float:
        """The per-client table's own work: its counts, their (one-rank) reduce, its row."""
        start = RoundStart(rnd, (), Population((1,) * K), server, 0.0, True, final=False)
        end = RoundEnd(LocalWork(start, 0.0, 0.0), server, {}, None, {}, 0, 0, 0, 0.0)  # type: ignore[arg-type]
        t = time.perf_counter()
        counts = observer.eval_counts(end)
        joint = JointCounts([counts.reshape(-1).to(torch.float64)])
        joint.settle(fed.comm)
        observer.row(end, {EVAL_SLOT: joint.parts[0]})
        return time.perf_counter() - t

    def test_eval() -> float:
        t = time.perf_counter()
        evaluate(server, JointCounts())
        return time.perf_counter() - t

    client_round(0), test_eval()  # warm-up
    clients = statistics.median(client_round(r + 1) for r in range(args.repeats))
    test = statistics.median(test_eval() for _ in range(args.repeats))
    entry = {
        "clients": K,
        "evaluated": args.sample if sampled else K,
        "held_out_per_client": statistics.mean(int(s.numel()) for s in fed.client_eval or []),
        "finetune_steps": args.finetune_steps,
        "client_eval_s": clients,
        "test_eval_s": test,
        "test_samples": args.synthetic_test,
        "ratio": clients / test,
    }
    print(
        f"K={K:5d} M={entry['evaluated']:4d}  per-client {clients * 1e3:.1f} ms  test {test * 1e3:.1f} ms  "
        f"ratio {entry['ratio']:.2f}",
        flush=True,
    )
    return entry


def client_table(args: argparse.Namespace) -> str:
    """Part 3: the protocol's tables through benchmarks/_runs.py, plus the final-round client table."""
    from _runs import Setting, run_protocol, write_tables

    from hpcfl.report.protocol import Protocol, fmt_mean_std
    from hpcfl.report.targets import default_target

    half = args.table_rounds // 2
    evaluation = {"client_eval": 0.1, "finetune_eval": {"steps": 20, "lr": 0.01, "rounds": "last"}}
    rows = {
        "FedAvg": {"algorithm": "fedavg"},
        "SCAFFOLD": {"algorithm": "scaffold"},
        "FedProx": {"algorithm": "fedprox", "params": {"mu": 0.01}},
        "TCT": {
            "algorithm": "tct",
            "params": {
                "stage1": {"rounds": half},
                "stage2": {
                    "p": args.tct_p,
                    "rounds": args.table_rounds - half,
                    "local_steps": 500,
                    "auto_lr": True,
                },
            },
        },
    }
    settings = [
        Setting(row, "dir:0.1", fmnist_config(args, rounds=args.table_rounds, **keys, **evaluation), (0.01,))
        for row, keys in rows.items()
    ]
    protocol = Protocol()
    cells = run_protocol(
        settings, seeds=list(range(args.seeds)), out=args.out / "table", jobs=args.jobs, protocol=protocol
    )
    runs = [r for c in cells for r in c.runs]
    target = default_target(runs, window=protocol.window) if runs else 0.5
    text = write_tables(
        cells,
        protocol,
        {"dir:0.1": target},
        args.out / "tracking_table",
        "# Client accuracy, Fashion-MNIST dir:0.1",
    )

    def last(run: Any, key: str) -> float | None:
        return next((float(r[key]) for r in reversed(run.rows) if key in r), None)

    md = [
        "",
        "Final round, mean ± std over seeds (%; client columns: the global model on each client's held-out "
        "10 %, every client counted once; TCT's: its stage-2 linear model on the shares' eNTK features, "
        "fine-tuned with stage 2's own η2):",
        "",
        "| method | test | client p10 | client mean | client p90 | fine-tuned mean |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        cols = ["test_accuracy", "client_acc_p10", "client_acc_mean", "client_acc_p90", "finetune_acc_mean"]
        vals = [fmt_mean_std([v for r in c.runs if (v := last(r, k)) is not None]) for k in cols]
        md.append(f"| {c.row} | " + " | ".join(vals) + " |")
    return text + "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    if "loggers" in args.parts:
        results["loggers"] = measure_loggers(args)
    if "client-eval" in args.parts:
        results["client_eval"] = measure_client_eval(args)
    if "table" in args.parts:
        results["table"] = client_table(args)
        print(results["table"])
    (args.out / "tracking_overhead.json").write_text(json.dumps(with_machine(results), indent=1) + "\n")
    lines = []
    for entry in results.get("loggers", []):
        lines.append(
            f"| {entry['logger']} | {entry['round_s_median']:.3f} | {1e3 * entry['flush_s_median']:.2f} "
            f"| {entry['overhead_pct']:.2f} % |"
        )
    md = ["| logger | round (s, median) | flush (ms, median) | overhead |", "|---|---:|---:|---:|", *lines]
    for entry in results.get("client_eval", []):
        md.append(
            f"\nK = {entry['clients']}, M = {entry['evaluated']}: per-client evaluation "
            f"{1e3 * entry['client_eval_s']:.1f} ms vs test evaluation {1e3 * entry['test_eval_s']:.1f} ms "
            f"({entry['test_samples']} samples): × {entry['ratio']:.2f}"
        )
    (args.out / "tracking_overhead.md").write_text("\n".join(md) + "\n")
    print(f"wrote {args.out}/tracking_overhead.{{json,md}}")


if __name__ == "__main__":
    main()
