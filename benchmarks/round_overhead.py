"""What hpcfl's FedAvg round costs above the floor: a bare PyTorch loop doing the same work.

The experiment of issue 60 (the peers harness): Fashion-MNIST, ``simplecnn``, ``dir:0.5`` over 100
clients, 10 clients per round (hpcfl's own draw), 1 local epoch, batch 32 (last partial batch kept),
SGD lr 0.05, no momentum, no weight decay, sample-weighted averaging, the full test set evaluated
every 5 rounds. No framework can be faster than the bare loop, so hpcfl / bare is the overhead any
peer could in principle remove. Configurations, each in its own process, run interleaved
(bare, hpcfl 1, hpcfl auto, mpi 2, bare, ...):

- ``bare``: tensors sliced once per client, ``torch.optim.SGD``, the n_k-weighted mean of the
  state dicts; every round timed by ``perf_counter`` around training + averaging, and the
  evaluation timed separately;
- ``hpcfl`` / ``hpcfl-auto``: ``hpcfl run`` in one process (``client_batch: 1`` / ``auto``), all
  defaults but the experiment's (checkpoints every round, metrics.jsonl, progress off);
- ``mpi2``: ``mpiexec -n 2 hpcfl run`` (1 torch thread per rank).

For hpcfl, the per-round training + aggregation time is ``compute_s + allreduce_s`` of the metrics
rows (written every 5 rounds: rounds 5, 10, ..., R), and the time per round with everything else
(evaluation, server step, metrics, checkpoints) is the ``wall_s`` difference between the first and
last row over the rounds between them; the bare loop's are computed the same way from its own
per-round times, so both columns compare like with like.

    python benchmarks/round_overhead.py                        # 50 rounds, 2 repeats, bench-out/
    python benchmarks/round_overhead.py --rounds 10 --repeats 1 --configs bare hpcfl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hpcfl.bench.machine import with_machine, with_machine_columns
from hpcfl.files import write_csv

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CONFIGS = ("bare", "hpcfl", "hpcfl-auto", "mpi2", "hpcfl-baseline")

EXPERIMENT: dict[str, Any] = dict(
    dataset="fashion-mnist",
    partition="dir:0.5",
    num_clients=100,
    clients_per_round=10,
    model="simplecnn",
    algorithm="fedavg",
    local_epochs=1,
    batch_size=32,
    lr=0.05,
    momentum=0.0,
    weight_decay=0.0,
    eval_every=5,
)


def bare_loop(data_root: str, rounds: int, seed: int) -> dict[str, Any]:
    """The floor: the experiment as a plain PyTorch script (same data, partition, draws, initial
    model and per-client shuffles as hpcfl, so the accuracy is comparable); per-round seconds of
    training + averaging, and of the evaluations."""
    started = time.perf_counter()
    import torch
    import torch.nn.functional as F

    from hpcfl.algorithms.participation import Participation, Population
    from hpcfl.data import load_dataset, partition
    from hpcfl.models import build_model
    from hpcfl.runner.federation import client_generator
    from hpcfl.runner.rounds import round_generator

    e = EXPERIMENT
    ds = load_dataset(e["dataset"], data_root)
    parts = partition(ds.train.y, e["partition"], e["num_clients"], seed=seed, num_classes=10)
    population = Population(tuple(int(p.numel()) for p in parts))
    draw = Participation(e["clients_per_round"])
    torch.manual_seed(seed)
    model = build_model(e["model"], ds.input_shape, ds.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=e["lr"])
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    stamps, evals = [], []
    startup = time.perf_counter() - started
    first_round = time.time()  # epoch seconds: the parent measures start-up from its launch
    for rnd in range(rounds):
        who = draw.sample(population, round_generator(seed, 0, rnd))
        total = {k: torch.zeros_like(v) for k, v in global_state.items() if v.is_floating_point()}
        n_all = 0
        for k in who:
            x, y = ds.train.x[parts[k]], ds.train.y[parts[k]]
            model.load_state_dict(global_state)
            model.train()
            perm = torch.randperm(x.shape[0], generator=client_generator(seed, rnd, k))
            for s in range(0, x.shape[0], e["batch_size"]):
                idx = perm[s : s + e["batch_size"]]
                opt.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
            for key, v in model.state_dict().items():
                if key in total:
                    total[key].add_(v, alpha=x.shape[0])
            n_all += x.shape[0]
        global_state = {k: (total[k] / n_all if k in total else v) for k, v in model.state_dict().items()}
        if (rnd + 1) % e["eval_every"] == 0 or rnd + 1 == rounds:
            model.load_state_dict(global_state)
            model.eval()
            correct, loss = 0, 0.0
            with torch.no_grad():
                for s in range(0, ds.test.x.shape[0], 1000):
                    out, y = model(ds.test.x[s : s + 1000]), ds.test.y[s : s + 1000]
                    correct += int((out.argmax(1) == y).sum())
                    loss += float(F.cross_entropy(out, y, reduction="sum"))
            evals.append({"round": rnd + 1, "accuracy": correct / ds.test.x.shape[0]})
        stamps.append([rnd + 1, time.perf_counter(), time.process_time()])
    return {"startup_s": startup, "first_round": first_round, "stamps": stamps, "eval": evals}


def hpcfl_run(
    config: str, data_root: str, rounds: int, seed: int, threads: int, work: Path, repo: Path = REPO
) -> dict[str, Any]:
    """``[mpiexec -n 2] hpcfl run`` of the experiment through this script's ``--child hpcfl`` (the
    ``hpcfl`` command's own entry point, with a stamp taken after each round's bookkeeping), with the
    hpcfl of ``repo`` (``hpcfl-baseline``: another checkout, e.g. before a change)."""
    import yaml

    cfg = dict(
        EXPERIMENT,
        name=config,
        data_root=data_root,
        rounds=rounds,
        seed=seed,
        threads=threads,
        progress=False,
        client_batch="auto" if config == "hpcfl-auto" else 1,
    )
    path = work / f"{config}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_dir, stamps = work / config, work / f"{config}.stamps.json"
    cmd = [sys.executable, __file__, "--child", "hpcfl", "--child-args", str(path), str(run_dir), str(stamps)]
    if config == "mpi2":
        cmd = [str(BIN / "mpiexec"), "-n", "2", *cmd]
    t, launched = time.perf_counter(), time.time()
    subprocess.run(cmd, check=True, env=child_env(threads, repo), capture_output=True, text=True)
    total = time.perf_counter() - t
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    taken = json.loads(stamps.read_text())
    return {
        "process_s": total,
        "startup_s": taken["first_round"] - launched,
        "stamps": taken["stamps"],
        "rows": [{k: r[k] for k in ("round", "compute_s", "allreduce_s", "eval_s", "seconds")} for r in rows],
        "eval": [{"round": r["round"], "accuracy": r["test_accuracy"]} for r in rows],
    }


def hpcfl_child(config: str, run_dir: str, stamps: str) -> int:
    """Run ``hpcfl run CONFIG --run-dir RUN_DIR --overwrite`` as the ``hpcfl`` command does (under
    MPI: its rank guard too), with rank 0 stamping (round, wall, CPU seconds) after each round's
    bookkeeping; the stamps are written to ``stamps``."""
    from hpcfl.cli.main import main as hpcfl_main
    from hpcfl.runner import experiment

    taken: list[list[float]] = []
    first_round: list[float] = []
    original = experiment._Bookkeeper.hook

    def hook(self: Any, stage: str, offset: int, last: int) -> Any:
        inner = original(self, stage, offset, last)
        first_round.append(time.time())  # the hook is made right before the stage's first round

        def after_round(done: int, *rest: Any) -> bool:
            halt = inner(done, *rest)
            taken.append([done + offset, time.perf_counter(), time.process_time()])
            return halt

        return after_round

    experiment._Bookkeeper.hook = hook  # type: ignore[method-assign]
    sys.argv = ["hpcfl", "run", config, "--run-dir", run_dir, "--overwrite"]
    code = hpcfl_main()
    if taken and int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))) == 0:
        Path(stamps).write_text(json.dumps({"stamps": taken, "first_round": first_round[0]}))
    return code


def child_env(threads: int, repo: Path = REPO) -> dict[str, str]:
    """This environment with ``repo`` first on ``PYTHONPATH`` (its hpcfl is imported), ``threads``
    OpenMP threads, and this process's autogroup nice value for the children to take (see
    :func:`same_priority`)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = str(threads)
    try:
        env[NICE_ENV] = Path("/proc/self/autogroup").read_text().split()[-1]
    except (OSError, IndexError):
        pass
    return env


NICE_ENV = "ROUND_OVERHEAD_AUTOGROUP_NICE"


def same_priority() -> None:
    """Put this process back at the benchmark's scheduling priority: MPICH's ``hydra_pmi_proxy``
    starts every rank in a new session, hence a new autogroup at nice 0, so on a shared node the
    ranks of ``mpiexec`` would outrun the other configurations' processes (measured: 0.9 s wall for
    a round whose one-process run took 5-7 s at load 17, for half the CPU seconds)."""
    nice = os.environ.get(NICE_ENV)
    if nice is None:
        return
    try:
        Path("/proc/self/autogroup").write_text(nice)
    except OSError:
        print("round_overhead: could not set this rank's autogroup nice value", file=sys.stderr)


def intervals(stamps: list[list[float]], rounds: int) -> tuple[list[float], list[float], list[bool]]:
    """Per round 2..R: wall seconds, CPU seconds (this process), and whether it evaluated."""
    wall, cpu, evaluated = [], [], []
    for (_, w0, c0), (r, w1, c1) in zip(stamps, stamps[1:], strict=False):
        wall.append(w1 - w0)
        cpu.append(c1 - c0)
        evaluated.append(int(r) % EXPERIMENT["eval_every"] == 0 or int(r) == rounds)
    return wall, cpu, evaluated


def summarise(config: str, rec: dict[str, Any], rounds: int) -> dict[str, Any]:
    """One run's figures over rounds 2..R: the median seconds of a round without evaluation
    (training, aggregation and the per-round bookkeeping), and the mean seconds of a round with
    everything (evaluation every 5 rounds included); wall and CPU seconds (rank 0's process)."""
    wall, cpu, evaluated = intervals(rec["stamps"], rounds)
    plain = [i for i, e in enumerate(evaluated) if not e]
    acc = [e["accuracy"] for e in rec["eval"]]
    return {
        "config": config,
        "round_s": statistics.median(wall[i] for i in plain),
        "round_eval_s": statistics.mean(wall),
        "round_cpu_s": statistics.median(cpu[i] for i in plain),
        "round_eval_cpu_s": statistics.mean(cpu),
        "final_accuracy": statistics.mean(acc[-3:]),
    }


FIGURES = ("round_s", "round_eval_s", "round_cpu_s", "round_eval_cpu_s", "final_accuracy")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data-root", default=os.environ.get("HPCFL_DATA"), help="default $HPCFL_DATA")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved passes over the configs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (1: a loaded node)")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=REPO / "bench-out/round_overhead")
    parser.add_argument("--tag", default="", help="suffix of the output files (e.g. before / after)")
    parser.add_argument(
        "--baseline-repo", type=Path, help="a checkout whose hpcfl the hpcfl-baseline config runs"
    )
    parser.add_argument("--child", choices=["bare", "hpcfl"], help=argparse.SUPPRESS)
    parser.add_argument("--child-args", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "hpcfl":
        same_priority()
        sys.exit(hpcfl_child(*args.child_args))
    if not args.data_root:
        sys.exit("round_overhead: no dataset directory: pass --data-root or set HPCFL_DATA")
    if args.rounds < 2 * EXPERIMENT["eval_every"]:
        sys.exit(f"round_overhead: --rounds must be at least {2 * EXPERIMENT['eval_every']}")
    if args.child == "bare":
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(bare_loop(args.data_root, args.rounds, args.seed)))
        return
    if "hpcfl-baseline" in args.configs and (args.baseline_repo is None or not args.baseline_repo.is_dir()):
        sys.exit("round_overhead: the hpcfl-baseline config needs --baseline-repo DIR (a checkout)")
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for config in args.configs:
                if config == "bare":
                    cmd = [sys.executable, __file__, "--child", "bare", "--rounds", str(args.rounds)]
                    cmd += [
                        "--seed",
                        str(args.seed),
                        "--data-root",
                        args.data_root,
                        "--threads",
                        str(args.threads),
                    ]
                    t, launched = time.perf_counter(), time.time()
                    proc = subprocess.run(
                        cmd, check=True, env=child_env(args.threads), capture_output=True, text=True
                    )
                    rec = {
                        "process_s": time.perf_counter() - t,
                        **json.loads(proc.stdout.strip().splitlines()[-1]),
                    }
                    rec["startup_s"] = rec.pop("first_round") - launched
                else:
                    repo = args.baseline_repo if config == "hpcfl-baseline" else REPO
                    rec = hpcfl_run(
                        config, args.data_root, args.rounds, args.seed, args.threads, Path(tmp), repo
                    )
                row = {"repeat": rep, **summarise(config, rec, args.rounds)}
                row.update(startup_s=rec["startup_s"], process_s=rec["process_s"])
                runs.append({**row, "record": rec})
                print(
                    f"{config:>10} rep {rep}: {row['round_s']:.3f} s/round ({row['round_cpu_s']:.3f} CPU), "
                    f"with eval {row['round_eval_s']:.3f} ({row['round_eval_cpu_s']:.3f} CPU), "
                    f"start-up {row['startup_s']:.1f} s, process {row['process_s']:.1f} s, "
                    f"acc {row['final_accuracy']:.4f}",
                    flush=True,
                )
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    table = summary_table(runs, args.configs)
    write_outputs(args, runs, table, load_before, load_after)


def summary_table(runs: list[dict[str, Any]], configs: list[str]) -> list[dict[str, Any]]:
    """Per config: the median over repeats of each figure, and the ratio to the bare loop."""
    out = []
    for config in configs:
        mine = [r for r in runs if r["config"] == config]
        out.append(
            {
                "config": config,
                **{k: statistics.median(r[k] for r in mine) for k in (*FIGURES, "startup_s", "process_s")},
            }
        )
    bare = next((r for r in out if r["config"] == "bare"), None)
    for r in out:
        for k in FIGURES[:4]:
            r[f"{k}_vs_bare"] = r[k] / bare[k] if bare else float("nan")
    return out


def write_outputs(
    args: argparse.Namespace,
    runs: list[dict[str, Any]],
    table: list[dict[str, Any]],
    load_before: list[str],
    load_after: list[str],
) -> None:
    """JSON (everything), CSV (one row per run), MD (the summary) and a PNG bar chart."""
    stem = args.out / f"round_overhead{'_' + args.tag if args.tag else ''}"
    meta = {
        "experiment": EXPERIMENT,
        "rounds": args.rounds,
        "seed": args.seed,
        "repeats": args.repeats,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "cpus": os.cpu_count(),
        "threads": args.threads,
    }
    stem.with_suffix(".json").write_text(
        json.dumps(
            with_machine({"meta": meta, "summary": table, "runs": runs}, threads=args.threads), indent=1
        )
    )
    flat = with_machine_columns([{k: v for k, v in r.items() if k != "record"} for r in runs], args.threads)
    write_csv(stem.with_suffix(".csv"), flat)
    lines = [
        f"FedAvg round overhead, {args.rounds} rounds, seed {args.seed}, {args.threads} torch thread(s) per "
        f"process, median of {args.repeats} interleaved repeats; load average before {' '.join(load_before)}, "
        f"after {' '.join(load_after)} ({os.cpu_count()} CPUs). Rounds 2..R; 'round': median of the rounds "
        "without evaluation (training, aggregation, bookkeeping); 'with eval': mean of all of them; CPU: "
        "rank 0's process.",
        "",
        "| config | round s | vs bare | with eval s | vs bare | round CPU s | vs bare | with eval CPU s | vs bare "
        "| start-up s | process s | accuracy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        cells = " | ".join(f"{r[k]:.3f} | {r[k + '_vs_bare']:.2f}" for k in FIGURES[:4])
        lines.append(
            f"| {r['config']} | {cells} | {r['startup_s']:.1f} | {r['process_s']:.1f} | {r['final_accuracy']:.4f} |"
        )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("round_overhead: matplotlib missing, no PNG", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = [r["config"] for r in table]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [r["round_s"] for r in table], 0.4, label="round (no evaluation)")
    ax.bar(
        [x + 0.2 for x in xs],
        [r["round_eval_s"] for r in table],
        0.4,
        label="mean round, evaluation included",
    )
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("seconds per round")
    ax.set_title(f"FedAvg round, FMNIST dir:0.5, 10 of 100 clients (load {load_before[0]})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    print(f"written: {stem}.{{json,csv,md,png}}")


if __name__ == "__main__":
    main()
