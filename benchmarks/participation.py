"""Partial participation at scale: round time, strong scaling, load imbalance, client-state I/O and
peak memory per rank, for SCAFFOLD with 10 and 100 participants per round.

Three measurements, each a set of real ``hpcfl run`` processes (``mpiexec -n R`` for R > 1) whose
``metrics.jsonl`` rows carry the figures (the runner measures them in every round without extra
communication: per-rank compute, client-state read/write time and peak RSS travel in the round's
one allreduced buffer):

1. **scaling**: synthetic data, 1,000 clients (iid, 50 samples each), mlp, SCAFFOLD with 10 and
   100 participants per round, client states on disk, 1 and 2 ranks: round time (median of the
   timed rounds, first round excluded), strong scaling = t(1 rank) / t(2 ranks), load imbalance
   (max / mean of the ranks' compute time), share of the round spent reading and writing client
   states;
2. **femnist**: FEMNIST natural (every writer of the sample is a client), the same at 10 and at all
   writers per round;
3. **memory**: peak RSS per rank against K = 100, 1,000, 10,000 clients (a fixed 100,000-sample
   training set, 100 participants per round), with states in memory and on disk.

    python benchmarks/participation.py --out benchmarks/out/participation   # ~10 min on 2 cores

Writes ``participation.json``, ``participation.csv`` and ``participation.png``. Run it alone on the
machine; the figures are ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from hpcfl.bench.machine import stamp_csv, with_machine
from hpcfl.files import write_csv

REPO = Path(__file__).resolve().parents[1]


def _run(cfg: dict[str, Any], run_dir: Path, ranks: int) -> list[dict[str, Any]]:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    cmd = [sys.executable, "-m", "hpcfl", "run", str(path), "--run-dir", str(run_dir), "--overwrite"]
    if ranks > 1:
        launcher = Path(sys.executable).parent / "mpiexec"
        cmd = [str(launcher), "-n", str(ranks), *cmd]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark run failed ({' '.join(cmd)}): {proc.stderr.strip()[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print(f"  {run_dir.name}: {len(rows)} rounds in {time.perf_counter() - t0:.1f} s", flush=True)
    return rows


def _summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    timed = rows[1:] or rows  # the first round pays for start-up (store creation, caches)
    med = lambda key: statistics.median(r[key] for r in timed)  # noqa: E731
    round_s = med("seconds") - med("eval_s")
    return {
        "round_s": round_s,
        "compute_s": med("compute_s"),
        "allreduce_s": med("allreduce_s"),
        "imbalance": med("imbalance"),
        "state_io_s": med("state_io_s"),
        "state_io_share": med("state_io_s") / round_s if round_s > 0 else 0.0,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in rows),
        "bytes_up": timed[-1]["bytes_up"],
        "test_accuracy": rows[-1]["test_accuracy"],
    }


def _base(threads: int) -> dict[str, Any]:
    return dict(
        algorithm="scaffold",
        model="mlp",
        lr=0.05,
        batch_size=10,
        local_steps=5,
        eval_every=1,
        seed=0,
        threads=threads,
        progress=False,
    )


def scaling(out: Path, rounds: int) -> list[dict[str, Any]]:
    results = []
    for dataset, clients, per_round in (
        ("synthetic", 1000, (10, 100)),
        ("femnist", 16, (10, 16)),
    ):
        for m in per_round:
            for ranks in (1, 2):
                cfg = _base(threads=1)
                # one checkpoint at the end: its syncfs of the store would add disk writeback to the
                # rounds being timed (the checkpoint's cost is not what this measures)
                cfg.update(
                    name=f"{dataset}_m{m}_r{ranks}",
                    rounds=rounds,
                    clients_per_round=m,
                    checkpoint_every=rounds,
                )
                if dataset == "synthetic":
                    cfg.update(
                        dataset="synthetic",
                        dataset_options={"n_train": 50 * clients, "n_test": 1000, "seed": 0},
                        partition="iid",
                        num_clients=clients,
                    )
                else:
                    cfg.update(dataset="femnist", partition="natural", num_clients=clients)
                cfg["client_state_memory"] = "disk"
                rows = _run(cfg, out / "runs" / cfg["name"], ranks)
                results.append(
                    {
                        "study": "scaling",
                        "dataset": dataset,
                        "clients": clients,
                        "participants": m,
                        "ranks": ranks,
                        "states": "disk",
                        **_summary(rows),
                    }
                )
    for r in results:
        base = next(
            b
            for b in results
            if b["dataset"] == r["dataset"] and b["participants"] == r["participants"] and b["ranks"] == 1
        )
        r["strong_scaling"] = base["round_s"] / r["round_s"]
    return results


def memory(out: Path, rounds: int) -> list[dict[str, Any]]:
    results = []
    for states in ("memory", "disk"):
        for clients in (100, 1000, 10_000):
            cfg = _base(threads=2)
            cfg.update(
                name=f"mem_{states}_k{clients}",
                dataset="synthetic",
                dataset_options={"n_train": 100_000, "n_test": 1000, "seed": 0},
                partition="iid",
                num_clients=clients,
                clients_per_round=100,
                rounds=rounds,
                client_state_memory=states,
                eval_every=rounds,
                checkpoint_every=rounds,
            )
            rows = _run(cfg, out / "runs" / cfg["name"], 1)
            results.append(
                {
                    "study": "memory",
                    "dataset": "synthetic",
                    "clients": clients,
                    "participants": 100,
                    "ranks": 1,
                    "states": states,
                    **_summary(rows),
                }
            )
    return results


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hpcfl.files import save_figure

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    sc = [r for r in results if r["study"] == "scaling"]
    labels = [f"{r['dataset'][:5]}\nm={r['participants']}\n{r['ranks']}R" for r in sc]
    a.bar(range(len(sc)), [r["round_s"] for r in sc], color=["C0" if r["ranks"] == 1 else "C1" for r in sc])
    a.bar(range(len(sc)), [r["state_io_s"] for r in sc], color="C3", label="client-state I/O")
    a.set_xticks(range(len(sc)), labels, fontsize=7)
    a.set_ylabel("seconds per round (median)")
    a.set_title("SCAFFOLD round time, states on disk")
    a.legend()
    for states, style in (("memory", "o-"), ("disk", "s--")):
        mem = [r for r in results if r["study"] == "memory" and r["states"] == states]
        b.plot(
            [r["clients"] for r in mem],
            [r["peak_rss_mb"] for r in mem],
            style,
            label="states in memory" if states == "memory" else "states on disk",
        )
    b.set_xscale("log")
    b.set_xlabel("clients K")
    b.set_ylabel("peak RSS per rank (MiB)")
    b.set_title("memory vs population (100 participants/round)")
    b.legend()
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "participation")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per scaling run (first one untimed)")
    ap.add_argument("--memory-rounds", type=int, default=20, help="rounds per memory run")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--replot", type=Path, help="only redraw the PNG from a participation.json")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        plot(json.loads(args.replot.read_text())["results"], args.out / "participation.png")
        return 0
    os.environ.setdefault("HPCFL_DATA", str((REPO.parent / "shared" / "datasets").resolve()))
    print("scaling (1 thread per rank):", flush=True)
    results = scaling(args.out, args.rounds)
    if not args.skip_memory:
        print("memory:", flush=True)
        results += memory(args.out, args.memory_rounds)
    meta = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_avg_start": os.getloadavg(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (args.out / "participation.json").write_text(
        json.dumps(with_machine({"meta": meta, "results": results}), indent=1) + "\n"
    )
    write_csv(args.out / "participation.csv", results, sorted({k for r in results for k in r}))
    stamp_csv(args.out / "participation.csv")
    plot(results, args.out / "participation.png")
    print(
        f"\n{'study':8} {'dataset':9} {'K':>6} {'m':>4} {'R':>2} {'states':6} {'round s':>8} {'scale':>6} "
        f"{'imbal':>6} {'I/O %':>6} {'RSS MiB':>8}"
    )
    for r in results:
        print(
            f"{r['study']:8} {r['dataset']:9} {r['clients']:>6} {r['participants']:>4} {r['ranks']:>2} "
            f"{r['states']:6} {r['round_s']:8.3f} {r.get('strong_scaling', float('nan')):6.2f} "
            f"{r['imbalance']:6.3f} {100 * r['state_io_share']:6.1f} {r['peak_rss_mb']:8.0f}"
        )
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
