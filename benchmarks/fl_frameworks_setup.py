"""FedAvg throughput in the setup BlazeFL and Flower publish, on one device, beside plain training.

BlazeFL's README compares itself with Flower in this setup: CIFAR-10, 100 clients × 500 samples,
5 local epochs at batch 50, FedAvg, a small CNN and ResNet-18. Its current plots (replaced on
2026-04-25, BlazeFL's PR #137; its paper is arXiv:2604.03606), read off by eye (samples/s): BlazeFL
≈ 43k (CNN) and ≈ 11.0k (ResNet-18), Flower ≈ 13.6k and ≈ 7.9k; the hardware is not stated (the
plots they replaced, on 4 × Quadro RTX 6000: BlazeFL ≈ 50k and ≈ 9.8k, Flower ≈ 19k and ≈ 8.5k).
Their harness also evaluates the server model every round; this one times training only. This
script runs the same work through hpcfl (``hpcfl run``'s in-process API, one rank, the default
``client_batch: auto``, and ``client_batch: 1`` beside it) and, as the yardstick of what the device
can do, a plain PyTorch training loop of the same model at the same batch (forward, backward,
``torch.optim.SGD`` step; no federation). CIFAR-10 is used where ``--data-root`` holds it,
otherwise synthetic data of its shape (3 × 32 × 32, 10 classes; the throughput does not depend on
the pixel values), which the output states.

Samples/s = training samples of one round (100 × 500 × 5 = 250,000) / the round's local-compute
plus allreduce time from metrics.jsonl (the first round is a warm-up: ``--rounds`` ≥ 2, the last
one timed). Writes fl_frameworks_setup_<device>.{csv,json,md}.

    python benchmarks/fl_frameworks_setup.py --device cuda --models simplecnn resnet18
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from hpcfl.bench.machine import with_machine, with_machine_columns
from hpcfl.files import write_csv

PUBLISHED = {  # samples/s read off BlazeFL's README plots of 2026-04-25 (PR #137); hardware not stated
    "simplecnn": {"blazefl": 43_000, "flower": 13_600},
    "resnet18": {"blazefl": 11_000, "flower": 7_900},
}
PUBLISHED_ON = "BlazeFL README plots of 2026-04-25 (PR #137), hardware not stated"
CLIENTS, PER_CLIENT, EPOCHS, BATCH = 100, 500, 5, 50


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (one GPU) | cpu (a check only: slow)")
    p.add_argument("--models", nargs="+", choices=list(PUBLISHED), default=list(PUBLISHED))
    p.add_argument("--rounds", type=int, default=2, help="rounds per run (>= 2: the first is a warm-up)")
    p.add_argument("--batches", nargs="+", default=["auto", "1"], help="client_batch settings to run")
    p.add_argument("--clients", type=int, default=CLIENTS, help="clients (default the published 100)")
    p.add_argument("--plain-steps", type=int, default=50, help="timed steps of the plain loop")
    p.add_argument("--data-root", default=os.environ.get("HPCFL_DATA"))
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/fl_frameworks_setup"))
    args = p.parse_args(argv)
    if args.rounds < 2 or args.clients < 1 or args.plain_steps < 1:
        p.error("--rounds must be >= 2, --clients and --plain-steps >= 1")
    return args


def dataset_keys(data_root: str | None, clients: int) -> tuple[dict, str]:
    """The run's dataset keys: CIFAR-10 where its archive is there, else synthetic of its shape."""
    root = Path(data_root) if data_root else None
    if root is not None and any((root / name).exists() for name in ("cifar-10-batches-py", "cifar10")):
        return {"dataset": "cifar10", "data_root": str(root), "download": False}, "CIFAR-10"
    options = {"n_train": clients * PER_CLIENT, "n_test": 1000, "seed": 0, "input_shape": [3, 32, 32]}
    return {"dataset": "synthetic", "dataset_options": options}, "synthetic, CIFAR-10's shape"


def hpcfl_round(model: str, device: str, client_batch: str, args: argparse.Namespace, work: Path) -> dict:
    """One hpcfl FedAvg run in this process; the last round's training samples/s and time split."""
    from hpcfl.config import load_config
    from hpcfl.runner import run_experiment

    data, _ = dataset_keys(args.data_root, args.clients)
    cfg = dict(
        name=f"{model}_{client_batch}",
        **data,
        device=device,
        client_batch=client_batch,
        partition="iid",
        num_clients=args.clients,
        model=model,
        algorithm="fedavg",
        rounds=args.rounds,
        local_epochs=EPOCHS,
        lr=0.01,
        momentum=0.0,
        batch_size=BATCH,
        eval_every=args.rounds,
        checkpoint_every=args.rounds,
        progress=False,
    )
    path = work / f"{cfg['name']}.json"
    path.write_text(json.dumps(cfg))
    run_dir = work / cfg["name"]
    run_experiment(load_config(path), run_dir)
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line][-1]
    train_s = last["compute_s"] + last["allreduce_s"]
    det = json.loads((run_dir / "determinism.json").read_text())
    samples = args.clients * PER_CLIENT * EPOCHS
    return {
        "samples_per_s": samples / train_s,
        "round_train_s": train_s,
        "group": det.get("client_batch_used"),
    }


def plain_training(model: str, device: str, steps: int) -> float:
    """Samples/s of plain training of ``model`` at batch 50 on ``device`` (random CIFAR-shaped data)."""
    import torch
    import torch.nn.functional as F

    from hpcfl.models import build_model

    torch.manual_seed(0)
    net = build_model(model, (3, 32, 32), 10).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(BATCH, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (BATCH,), device=device)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(5):
        step()
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return steps * BATCH / (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    _, data_name = dataset_keys(args.data_root, args.clients)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            plain = plain_training(model, args.device, args.plain_steps)
            print(f"{model}: plain training at batch {BATCH}: {plain:,.0f} samples/s", flush=True)
            for batch in args.batches:
                r = hpcfl_round(model, args.device, batch, args, Path(tmp))
                row = {
                    "model": model,
                    "client_batch": batch,
                    **r,
                    "plain_samples_per_s": plain,
                    "vs_plain": r["samples_per_s"] / plain,
                    **{f"vs_{k}_published": r["samples_per_s"] / v for k, v in PUBLISHED[model].items()},
                }
                rows.append(row)
                print(
                    f"{model} client_batch {batch} (groups of {r['group']}): {r['samples_per_s']:,.0f} samples/s, "
                    f"{row['vs_plain']:.2f}x plain training; BlazeFL published {PUBLISHED[model]['blazefl']:,}, "
                    f"Flower {PUBLISHED[model]['flower']:,} ({PUBLISHED_ON})",
                    flush=True,
                )
    import torch

    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    tag = args.device.replace(":", "")
    rows = with_machine_columns(rows)
    write_csv(args.out / f"fl_frameworks_setup_{tag}.csv", rows)
    meta = {"device": device_name, "data": data_name, "clients": args.clients, "per_client": PER_CLIENT,
            "epochs": EPOCHS, "batch": BATCH, "published": PUBLISHED, "published_on": PUBLISHED_ON}  # fmt: skip
    (args.out / f"fl_frameworks_setup_{tag}.json").write_text(
        json.dumps(with_machine({**meta, "rows": rows}), indent=2)
    )
    lines = [
        f"FedAvg, {args.clients} clients x {PER_CLIENT} samples, {EPOCHS} local epochs at batch {BATCH}, "
        f"{data_name}, one {device_name}. Published: {PUBLISHED_ON}.",
        "",
        "| model | client_batch (group) | hpcfl samples/s | plain training | hpcfl / plain | BlazeFL (pub.) | Flower (pub.) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        pub = PUBLISHED[r["model"]]
        lines.append(
            f"| {r['model']} | {r['client_batch']} ({r['group']}) | {r['samples_per_s']:,.0f} | "
            f"{r['plain_samples_per_s']:,.0f} | {r['vs_plain']:.2f} | {pub['blazefl']:,} | {pub['flower']:,} |"
        )
    (args.out / f"fl_frameworks_setup_{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
