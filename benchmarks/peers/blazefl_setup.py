"""BlazeFL's published setup run through BlazeFL itself and through hpcfl, on this machine's CPU.

BlazeFL's benchmark (README plots; ``benchmarks/blazefl-case/main.py``): FedAvg on CIFAR-10, 100
clients × 500 samples, every client every round, 5 local epochs at batch 50, SGD lr 0.1, its ``CNN``
and torchvision's ResNet-18. Here both frameworks train the same two modules
(:mod:`blazefl_models`), on CIFAR-10-shaped synthetic data (3×32×32, 10 classes; CIFAR-10 is not on
this machine, and throughput does not depend on the pixel values), with a reduced budget that is
the same for both: ``--clients`` per model (the published 100 would take hours per ResNet-18 round on
two cores) and ``--rounds`` (the first a warm-up; the median of the others timed). Timed: the round's local
training and aggregation (BlazeFL: ``local_process`` + uplink + ``load``; hpcfl: ``compute_s`` +
``allreduce_s`` of its metrics row). No evaluation is timed on either side. BlazeFL's own harness
also applies per-sample augmentation (random crop and flip of PIL images) in its data loader; here
neither side augments (both gather batches by indexing tensors).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/peers/blazefl_setup.py            # writes benchmarks/results/
    ... blazefl_setup.py --clients cnn=2 resnet18=1 --out bench-out/blazefl_setup  # a smoke run

BlazeFL runs in its own venv (``bash benchmarks/peers/setup.sh blazefl``), as a subprocess of this
script (``--peer-side``); hpcfl runs in this process through ``hpcfl run``'s API. Writes
``blazefl_setup_cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

PER_CLIENT, EPOCHS, BATCH, LR = 500, 5, 50, 0.1  # BlazeFL's benchmark defaults
DEFAULT_CLIENTS = {"cnn": 10, "resnet18": 2}
HPCFL_NAMES = {"cnn": "blazefl-cnn", "resnet18": "tv-resnet18"}
PUBLISHED = {"cnn": {"blazefl": 43_000, "flower": 13_600}, "resnet18": {"blazefl": 11_000, "flower": 7_900}}
PUBLISHED_ON = "BlazeFL README plots of 2026-04-25 (PR #137), samples/s read by eye, hardware not stated"
BLAZEFL_MODES = ("single-threaded", "multi-process-2")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=list(DEFAULT_CLIENTS), default=list(DEFAULT_CLIENTS))
    p.add_argument(
        "--clients", nargs="+", default=[], metavar="MODEL=N", help="clients per model (same for both)"
    )
    p.add_argument("--rounds", type=int, default=4, help="rounds per run (>= 2: the first is a warm-up)")
    p.add_argument("--blazefl-modes", nargs="+", choices=BLAZEFL_MODES, default=["single-threaded"])
    p.add_argument("--blazefl-python", default=str(REPO / ".peers/blazefl/bin/python"))
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results")
    p.add_argument("--peer-side", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="single-threaded", help=argparse.SUPPRESS)
    p.add_argument("--num-clients", type=int, help=argparse.SUPPRESS)
    p.add_argument("--record", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error("--rounds must be >= 2 (the first round is a warm-up)")
    clients = dict(DEFAULT_CLIENTS)
    for item in args.clients:
        name, _, n = item.partition("=")
        if name not in clients or not n.isdigit() or int(n) < 1:
            p.error(f"--clients takes MODEL=N with MODEL in {sorted(clients)} and N >= 1, got {item!r}")
        clients[name] = int(n)
    args.clients = clients
    return args


# ------------------------------------------------------------------------------- BlazeFL's side
def blazefl_side(args: argparse.Namespace) -> None:
    """Runs in BlazeFL's venv: FedAvg through BlazeFL's contrib handler and trainer; writes a record."""
    import torch
    from blazefl.contrib import (
        FedAvgBaseClientTrainer,
        FedAvgBaseServerHandler,
        FedAvgProcessPoolClientTrainer,
    )

    n = args.num_clients
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n * PER_CLIENT, 3, 32, 32, generator=g)  # (N, 3, 32, 32)
    y = torch.randint(0, 10, (n * PER_CLIENT,), generator=g)

    if args.mode != "single-threaded":
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    selector = _Selector(args.model)
    dataset = _SyntheticPartition(x, y, n)
    common = dict(model_selector=selector, model_name=args.model, dataset=dataset, device="cpu", seed=0)
    handler = FedAvgBaseServerHandler(
        **common, global_round=args.rounds, num_clients=n, sample_ratio=1.0, batch_size=BATCH
    )
    train = dict(**common, num_clients=n, epochs=EPOCHS, batch_size=BATCH, lr=LR)
    if args.mode == "single-threaded":
        trainer = FedAvgBaseClientTrainer(**train)
    else:
        import torch.multiprocessing as mp

        mp.set_start_method("spawn", force=True)
        state = Path(tempfile.mkdtemp(prefix="blazefl-state-"))
        trainer = FedAvgProcessPoolClientTrainer(**train, state_dir=state, num_parallels=2)
    trainer.progress_fn = lambda it: it
    round_s, samples = [], []
    while not handler.if_stop():
        t = time.perf_counter()
        trainer.local_process(handler.downlink_package(), handler.sample_clients())
        uploads = trainer.uplink_package()
        for pack in uploads:
            handler.load(pack)
        round_s.append(time.perf_counter() - t)
        samples.append(sum(p.data_size for p in uploads))
    from importlib.metadata import version

    Path(args.record).write_text(json.dumps({
        "framework": "blazefl", "version": version("blazefl"), "mode": args.mode, "round_s": round_s,
        "samples_per_round": samples, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version(), "num_params": sum(p.numel() for p in handler.model.parameters()),
    }))  # fmt: skip


class _Selector:
    """BlazeFL's ``ModelSelector`` for :mod:`blazefl_models` (a fixed seed, the global RNG untouched)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def select_model(self, model_name: str):
        import blazefl_models
        import torch

        with torch.random.fork_rng([]):
            torch.manual_seed(0)
            return blazefl_models.build(self.name)


class _SyntheticPartition:
    """BlazeFL's ``PartitionedDataset``: client k holds samples [500k, 500k + 500); shuffled batches
    gathered by indexing (no augmentation)."""

    def __init__(self, x, y, n: int) -> None:
        self.x, self.y, self.n = x, y, n

    def get_dataset(self, type_, cid):
        from torch.utils.data import TensorDataset

        lo = 0 if cid is None else cid * PER_CLIENT
        return TensorDataset(self.x[lo : lo + PER_CLIENT], self.y[lo : lo + PER_CLIENT])

    def set_dataset(self, type_, cid, dataset) -> None:
        """The data never change."""

    def get_dataloader(self, type_, cid, batch_size, generator):
        from torch.utils.data import BatchSampler, DataLoader, RandomSampler

        data = self.get_dataset(type_, cid)
        order = RandomSampler(range(len(data)), generator=generator)
        return DataLoader(data, sampler=BatchSampler(order, batch_size, drop_last=False), batch_size=None)


# --------------------------------------------------------------------------------- hpcfl's side
def hpcfl_side(model: str, clients: int, rounds: int, work: Path) -> dict:
    """FedAvg through ``hpcfl run``'s API in this process, on hpcfl's synthetic data of CIFAR's shape."""
    import blazefl_models
    import torch

    from hpcfl.config import load_config
    from hpcfl.registry import MODEL_SPECS, register_model
    from hpcfl.runner import run_experiment

    name = HPCFL_NAMES[model]
    if name not in MODEL_SPECS:
        register_model(name, lambda input_shape, num_classes, _m=model: blazefl_models.build(_m, num_classes))
    cfg = {
        "name": f"{name}-{clients}",
        "dataset": "synthetic",
        "dataset_options": {
            "n_train": clients * PER_CLIENT,
            "n_test": 1000,
            "seed": 0,
            "input_shape": [3, 32, 32],
        },
        "device": "cpu",
        "client_batch": "1",
        "partition": "iid",
        "num_clients": clients,
        "model": name,
        "algorithm": "fedavg",
        "rounds": rounds,
        "local_epochs": EPOCHS,
        "lr": LR,
        "momentum": 0.0,
        "weight_decay": 0.0,  # BlazeFL's trainers: torch.optim.SGD(lr) (hpcfl's default is 1e-5)
        "batch_size": BATCH,
        "eval_every": 1,  # hpcfl writes a metrics row on evaluated rounds; its eval_s is not timed here
        "checkpoint_every": rounds,
        "progress": False,
    }
    path = work / f"{cfg['name']}.json"
    path.write_text(json.dumps(cfg))
    run_dir = work / cfg["name"]
    run_experiment(load_config(path), run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    round_s = [r["compute_s"] + r["allreduce_s"] for r in rows]
    from importlib.metadata import version

    return {
        "framework": "hpcfl", "version": version("hpcfl"), "mode": "hpcfl run, 1 process, client_batch 1",
        "round_s": round_s, "samples_per_round": [clients * PER_CLIENT * EPOCHS] * len(round_s),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
        "num_params": sum(p.numel() for p in blazefl_models.build(model).parameters()),
    }  # fmt: skip


def blazefl_run(args: argparse.Namespace, model: str, mode: str, work: Path) -> dict:
    record = work / f"blazefl-{model}-{mode}.json"
    cmd = [args.blazefl_python, str(Path(__file__).resolve()), "--peer-side", "--model", model, "--mode", mode,
           "--num-clients", str(args.clients[model]), "--rounds", str(args.rounds), "--record", str(record)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE)
    if proc.returncode != 0 or not record.exists():
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        return {
            "framework": "blazefl",
            "mode": mode,
            "status": "failed",
            "error": lines[-1] if lines else "no output",
        }
    return {**json.loads(record.read_text()), "status": "ok"}


def summarise(row: dict, model: str, clients: int) -> dict:
    row = {"model": model, "clients": clients, **row}
    if row.get("status", "ok") == "ok":
        row["status"] = "ok"
        timed = row["round_s"][1:]  # the first round is a warm-up
        row["seconds_per_round"] = statistics.median(timed)
        row["samples_per_s"] = row["samples_per_round"][-1] / row["seconds_per_round"]
    return row


def write_outputs(out: Path, meta: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    from hpcfl.bench.machine import with_machine  # this part runs in hpcfl's venv

    (out / "blazefl_setup_cpu.json").write_text(
        json.dumps(with_machine({**meta, "rows": rows}), indent=1) + "\n"
    )
    lines = [
        f"BlazeFL's published setup on this CPU ({meta['cpu']}, {meta['cores']} cores, OMP_NUM_THREADS "
        f"{meta.get('omp_num_threads', 'unset')}; load before/after "
        f"{meta['load_before']} / {meta['load_after']}): FedAvg, every client every round, {PER_CLIENT} samples "
        f"per client, {EPOCHS} local epochs at batch {BATCH}, lr {LR}; synthetic CIFAR-10-shaped data; "
        f"{meta['rounds']} rounds, the median of rounds 2.. timed (training + aggregation). Reduced budget, the same for both: "
        + ", ".join(f"{m} {c} clients" for m, c in meta["clients"].items())
        + f" (published: 100). Published figures: {PUBLISHED_ON}.",
        "",
        "| model | framework | version | mode | clients | s / round | samples/s | hpcfl / this | published samples/s |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(
                f"| {r['model']} | {r['framework']} | | {r['mode']} | {r['clients']} | failed: {r['error']} | | | |"
            )
            continue
        ref = next(
            (
                h
                for h in rows
                if h["model"] == r["model"] and h["framework"] == "hpcfl" and h["status"] == "ok"
            ),
            None,
        )
        ratio = f"{ref['samples_per_s'] / r['samples_per_s']:.2f}" if ref else ""
        pub = PUBLISHED[r["model"]].get(r["framework"])
        lines.append(
            f"| {r['model']} | {r['framework']} | {r['version']} | {r['mode']} | {r['clients']} | "
            f"{r['seconds_per_round']:.1f} | {r['samples_per_s']:,.0f} | {ratio} | {f'{pub:,}' if pub else ''} |"
        )
    (out / "blazefl_setup_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.peer_side:
        blazefl_side(args)
        return 0
    if not Path(args.blazefl_python).exists():
        print(
            "peer 'blazefl' has no environment: run `bash benchmarks/peers/setup.sh blazefl`",
            file=sys.stderr,
        )
        return 2
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"
    )
    meta = {"cpu": cpu, "cores": os.cpu_count(), "rounds": args.rounds, "clients": {m: args.clients[m] for m in args.models},
            "per_client": PER_CLIENT, "epochs": EPOCHS, "batch": BATCH, "lr": LR, "published": PUBLISHED,
            "published_on": PUBLISHED_ON, "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"), "load_before": open("/proc/loadavg").read().split()[0]}  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            n = args.clients[model]
            for mode in args.blazefl_modes:  # BlazeFL, then hpcfl, per model: interleaved
                rows.append(summarise(blazefl_run(args, model, mode, Path(tmp)), model, n))
                print(
                    json.dumps(
                        {k: rows[-1].get(k) for k in ("model", "framework", "mode", "samples_per_s", "error")}
                    ),
                    flush=True,
                )
            rows.append(summarise({**hpcfl_side(model, n, args.rounds, Path(tmp)), "status": "ok"}, model, n))
            print(
                json.dumps({k: rows[-1].get(k) for k in ("model", "framework", "mode", "samples_per_s")}),
                flush=True,
            )
    meta["load_after"] = open("/proc/loadavg").read().split()[0]
    write_outputs(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
