"""FedAvg round throughput: hpcfl against a hand-written PyTorch loop, and strong scaling over ranks.

Fashion-MNIST, simplecnn, 10 clients (IID), one local epoch, batch 64, plain SGD. Measured in one
invocation so the ratios compare like with like:

- ``plain``: a hand-written loop doing the same local work (per client: load the global weights,
  one epoch of torch.optim.SGD over a fresh permutation, then the n_k-weighted average), 1 thread;
- ``hpcfl R×T``: ``mpiexec -n R hpcfl run`` with T torch threads per rank; the round time comes
  from metrics.jsonl (local compute + allreduce, evaluation excluded), so start-up and data
  loading do not count.

Samples/s = training samples processed per round / training time per round (the first round is
a warm-up and is dropped). Prints a table and writes CSV + JSON (+ PNG) to --out.

    python benchmarks/round_throughput.py --rounds 3 --out benchmarks/out/round_throughput
    python benchmarks/round_throughput.py --device cuda --clients 10 100   # one GPU (issue 13)
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from hpcfl.bench.machine import stamp_csv, with_machine
from hpcfl.files import write_csv

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def plain_loop(data_root: str, rounds: int, threads: int, device: str = "cpu", clients: int = 10) -> float:
    """Samples/s of a plain PyTorch FedAvg loop over ``clients`` IID clients (runs in this process;
    on a GPU the data, model and averaging live there and each round ends with a device sync)."""
    import torch
    import torch.nn.functional as F

    from hpcfl.data import load_dataset, partition
    from hpcfl.models import build_model

    torch.set_num_threads(threads)
    ds = load_dataset("fashion-mnist", data_root)
    parts = partition(ds.train.y, "iid", clients, seed=0, num_classes=10)
    torch.manual_seed(0)
    dev = torch.device(device)
    model = build_model("simplecnn", ds.input_shape, 10).to(dev)
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    data = [(ds.train.x[p].to(dev), ds.train.y[p].to(dev)) for p in parts]
    times = []
    for rnd in range(rounds):
        t0 = time.perf_counter()
        total = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in global_state.items()}
        n_all = 0
        for k, (x, y) in enumerate(data):
            model.load_state_dict(global_state)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, weight_decay=1e-5)
            g = torch.Generator().manual_seed(1000 * rnd + k)
            perm = torch.randperm(x.shape[0], generator=g).to(dev)
            model.train()
            for s in range(0, x.shape[0], 64):
                idx = perm[s : s + 64]
                opt.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
            for key, v in model.state_dict().items():
                if v.is_floating_point():
                    total[key] += v * x.shape[0]
            n_all += x.shape[0]
        global_state = {
            key: (total[key] / n_all if v.is_floating_point() else v) for key, v in model.state_dict().items()
        }
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    steady = times[1:] or times
    return n_all / (sum(steady) / len(steady))


ALLREDUCE_PROGRAM = """
import sys, time, torch
from hpcfl.comm import get_comm
comm = get_comm("mpi")
n, reps = int(sys.argv[1]), int(sys.argv[2])
out = {}
for dtype in (torch.float32, torch.float64):
    buf = torch.ones(n, dtype=dtype)
    for _ in range(10):
        comm.allreduce(buf)
    comm.barrier()
    t = time.perf_counter()
    for _ in range(reps):
        comm.allreduce(buf)
    out[str(dtype).split(".")[1]] = (time.perf_counter() - t) / reps
if comm.rank == 0:
    print(out)
"""


def child_env(threads: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a benchmark subprocess: ``environ`` (default this process's) with
    ``OMP_NUM_THREADS`` set and the repository PREPENDED to ``PYTHONPATH``, so this checkout's hpcfl
    is imported and a dependency installed through ``PYTHONPATH`` (the GPU image's /tmp/site) stays
    importable (replacing ``PYTHONPATH`` crashed the first GPU run, issue 39)."""
    env = dict(os.environ if environ is None else environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def allreduce_cost(floats: int, ranks: int = 2, reps: int = 300) -> dict:
    """Seconds per allreduce of the round buffer in float32 and float64 (``reduction``) at 2 ranks."""
    cmd = [
        str(BIN / "mpiexec"),
        "-n",
        str(ranks),
        sys.executable,
        "-c",
        ALLREDUCE_PROGRAM,
        str(floats),
        str(reps),
    ]
    proc = subprocess.run(cmd, check=True, env=child_env(1), capture_output=True, text=True)
    return ast.literal_eval(proc.stdout.strip().splitlines()[-1])  # {"float32": s, "float64": s}


def hpcfl_run(
    data_root: str,
    rounds: int,
    ranks: int,
    threads: int,
    workdir: Path,
    reduction: str = "float64",
    *,
    device: str = "cpu",
    clients: int = 10,
    client_batch: int | str = 1,
) -> dict:
    """Samples/s and the time split of ``mpiexec -n ranks hpcfl run`` (threads per rank)."""
    cfg = dict(
        name=f"r{ranks}t{threads}{reduction}{device}k{clients}n{client_batch}",
        reduction=reduction,
        device=device,
        client_batch=client_batch,
        dataset="fashion-mnist",
        data_root=data_root,
        partition="iid",
        num_clients=clients,
        model="simplecnn",
        algorithm="fedavg",
        rounds=rounds,
        local_epochs=1,
        lr=0.05,
        batch_size=64,
        eval_every=rounds,
        threads=threads,
        progress=False,
        checkpoint_every=rounds,
    )
    path = workdir / f"{cfg['name']}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_dir = workdir / cfg["name"]
    cmd = [sys.executable, "-m", "hpcfl", "run", str(path), "--run-dir", str(run_dir), "--overwrite"]
    if ranks > 1:
        cmd = [str(BIN / "mpiexec"), "-n", str(ranks), *cmd]
    subprocess.run(cmd, check=True, env=child_env(threads), capture_output=True, text=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]  # eval_every = rounds: one row, the last (steady-state) round's time split
    train_s = last["compute_s"] + last["allreduce_s"]
    return {
        "samples_per_s": 60000 / train_s,
        "compute_s": last["compute_s"],
        "allreduce_s": last["allreduce_s"],
        "eval_s": last["eval_s"],
        "allreduce_share": last["allreduce_s"] / (last["seconds"] - last["eval_s"]),
        "allreduce_share_with_eval": last["allreduce_s"] / last["seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data-root", default=os.environ.get("HPCFL_DATA"), help="dataset dir (default $HPCFL_DATA)"
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds per configuration (the last one is timed)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/out/round_throughput")
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu (the default grid above) | cuda: plain loop vs hpcfl (client_batch 1 and auto) on one "
        "GPU, one rank, for each --clients",
    )
    parser.add_argument("--clients", nargs="+", type=int, default=[10, 100], help="client counts (cuda grid)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.device != "cpu":
        gpu_grid(args)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        plain = plain_loop(args.data_root, args.rounds, threads=1)
        rows.append({"config": "plain 1x1", "ranks": 1, "threads": 1, "samples_per_s": plain})
        print(f"plain loop 1 rank x 1 thread: {plain:,.0f} samples/s", flush=True)
        for ranks, threads, reduction in (
            (1, 1, "float64"),
            (2, 1, "float64"),
            (1, 2, "float64"),
            (2, 1, "float32"),
        ):
            r = hpcfl_run(args.data_root, args.rounds, ranks, threads, work, reduction)
            tag = "" if reduction == "float64" else f" {reduction}"
            rows.append(
                {
                    "config": f"hpcfl {ranks}x{threads}{tag}",
                    "ranks": ranks,
                    "threads": threads,
                    "reduction": reduction,
                    **r,
                }
            )
            print(
                f"hpcfl {ranks} rank(s) x {threads} thread(s): {r['samples_per_s']:,.0f} samples/s, "
                f"allreduce {100 * r['allreduce_share']:.3f}% of round",
                flush=True,
            )
    by = {r["config"]: r for r in rows}
    summary = {
        "hpcfl_vs_plain_1x1": by["hpcfl 1x1"]["samples_per_s"] / by["plain 1x1"]["samples_per_s"],
        "speedup_2x1_vs_1x1": by["hpcfl 2x1"]["samples_per_s"] / by["hpcfl 1x1"]["samples_per_s"],
        "speedup_1x2_vs_1x1": by["hpcfl 1x2"]["samples_per_s"] / by["hpcfl 1x1"]["samples_per_s"],
        "allreduce_share_2x1": by["hpcfl 2x1"]["allreduce_share"],
    }
    cost = allreduce_cost(356_234 + 20)  # simplecnn's state + the runner's channels
    summary["allreduce_float32_s"] = cost["float32"]
    summary["allreduce_float64_s"] = cost["float64"]
    summary["allreduce_float64_over_float32"] = cost["float64"] / cost["float32"]
    print("\n| configuration | samples/s | ratio to hpcfl 1x1 |\n|---|---:|---:|")
    for r in rows:
        print(
            f"| {r['config']} | {r['samples_per_s']:,.0f} | {r['samples_per_s'] / by['hpcfl 1x1']['samples_per_s']:.3f} |"
        )
    print(
        f"\nhpcfl / plain loop (1 rank x 1 thread): {summary['hpcfl_vs_plain_1x1']:.3f}  (required >= 0.95)"
    )
    print(
        f"strong scaling 2 ranks x 1 thread vs 1x1: {summary['speedup_2x1_vs_1x1']:.3f}x  (required >= 1.8)"
    )
    print(f"1 rank x 2 threads vs 1x1: {summary['speedup_1x2_vs_1x1']:.3f}x")
    print(f"allreduce share of the round at 2 ranks: {100 * summary['allreduce_share_2x1']:.3f}%")
    print(
        f"one allreduce of the round buffer at 2 ranks: float32 {1e3 * cost['float32']:.3f} ms, "
        f"float64 {1e3 * cost['float64']:.3f} ms ({summary['allreduce_float64_over_float32']:.2f}x; "
        f"reduction: float64 makes the sum placement-independent)"
    )
    write_csv(args.out / "round_throughput.csv", rows, sorted({k for r in rows for k in r}))
    stamp_csv(args.out / "round_throughput.csv")
    (args.out / "round_throughput.json").write_text(
        json.dumps(with_machine({"rows": rows, "summary": summary}), indent=2)
    )
    print(f"written: {args.out}/round_throughput.csv, .json")


def gpu_grid(args: argparse.Namespace) -> None:
    """Issue 13's GPU figure: FedAvg round throughput on one GPU, hpcfl (clients one by one, and
    ``client_batch: auto``) against the plain loop doing the same work on the same GPU, for each
    client count; writes round_throughput_<device>.{csv,json}."""
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for clients in args.clients:
            plain = plain_loop(args.data_root, args.rounds, 1, device=args.device, clients=clients)
            rows.append({"clients": clients, "config": "plain", "samples_per_s": plain, "vs_plain": 1.0})
            print(f"K={clients} plain loop: {plain:,.0f} samples/s", flush=True)
            for batch in (1, "auto"):
                r = hpcfl_run(
                    args.data_root,
                    args.rounds,
                    1,
                    1,
                    Path(tmp),
                    device=args.device,
                    clients=clients,
                    client_batch=batch,
                )
                config = f"hpcfl client_batch {batch}"
                rows.append(
                    {"clients": clients, "config": config, **r, "vs_plain": r["samples_per_s"] / plain}
                )
                print(
                    f"K={clients} {config}: {r['samples_per_s']:,.0f} samples/s, "
                    f"{r['samples_per_s'] / plain:.3f}x the plain loop (required >= 0.95)",
                    flush=True,
                )
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    tag = args.device.replace(":", "")
    write_csv(args.out / f"round_throughput_{tag}.csv", rows, sorted({k for r in rows for k in r}))
    stamp_csv(args.out / f"round_throughput_{tag}.csv")
    (args.out / f"round_throughput_{tag}.json").write_text(
        json.dumps(with_machine({"device": name, "rows": rows}), indent=2)
    )
    print(f"written: {args.out}/round_throughput_{tag}.csv, .json ({name})")


if __name__ == "__main__":
    main()
