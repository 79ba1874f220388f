"""Where a fused eNTK batch spends its time, kernel by kernel: the measurement a per-layer cost model
(gather kernels vs materialised per-sample gradients) is fitted from.

For each ``--models``: a warm-up, then ``torch.profiler`` over ``--batches`` fused batches (and, beside
them, the same number of plain forward+backward steps); writes ``entk_profile_<device>.csv`` (one
row per model × kernel: calls, total and mean device time) and ``.json`` with the top kernels, and
prints the top ``--top`` of each model with the share of the batch's device time.

    python benchmarks/entk_profile.py --device cuda --models simplecnn resnet8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hpcfl.bench.machine import with_machine, with_machine_columns
from hpcfl.files import write_csv

SHAPES = {"simplecnn": (1, 28, 28), "mlp": (1, 28, 28), "resnet8": (3, 32, 32), "resnet18": (3, 32, 32),
          "vgg11": (3, 32, 32)}  # fmt: skip
OPTIONS = {"resnet8": {"norm": "gn"}, "resnet18": {"norm": "gn"}, "vgg11": {"batch_norm": False}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--models", nargs="+", choices=list(SHAPES), default=["simplecnn", "resnet8"])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--p", type=int, default=100_000, help="kept eNTK coordinates")
    p.add_argument("--batches", type=int, default=5, help="profiled batches per model")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/entk_profile"))
    args = p.parse_args(argv)
    if min(args.batch, args.p, args.batches, args.top) < 1:
        p.error("--batch, --p, --batches and --top must be >= 1")
    return args


def profile_model(name: str, args: argparse.Namespace) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from hpcfl.entk import entk_features, num_params
    from hpcfl.models import build_model

    torch.manual_seed(0)
    model = build_model(name, SHAPES[name], 10, **OPTIONS.get(name, {})).to(args.device)
    x = torch.randn(args.batch, *SHAPES[name], device=args.device)
    y = torch.randint(0, 10, (args.batch,), device=args.device)
    p = min(args.p, num_params(model))

    def fused() -> None:
        entk_features(model, x, p=p, seed=0, method="fused")

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()

    on_gpu = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    rows = []
    for label, fn in (("fused", fused), ("plain", plain)):
        for _ in range(3):
            fn()
        if on_gpu:
            torch.cuda.synchronize()
        try:  # PyTorch 2.11 warned that it clears events at the end of a cycle: keep them
            prof_ctx = profile(activities=activities, acc_events=True)
        except TypeError:
            prof_ctx = profile(activities=activities)
        with prof_ctx as prof:
            for _ in range(args.batches):
                fn()
            if on_gpu:
                torch.cuda.synchronize()
        events = prof.key_averages()
        keys = ("self_device_time_total", "self_cuda_time_total", "device_time_total") if on_gpu else ()
        key = next((k for k in keys if sum(getattr(e, k, 0) or 0 for e in events) > 0), "self_cpu_time_total")
        print(f"  ({label}: {len(events)} event kinds, timed by {key})")
        total = sum(getattr(e, key) for e in events if e.key and not e.key.startswith("ProfilerStep")) or 1.0
        for e in sorted(events, key=lambda e: getattr(e, key), reverse=True):
            us = getattr(e, key)
            if us <= 0:
                continue
            rows.append({"model": name, "path": label, "kernel": e.key[:120], "calls": e.count,
                         "total_us_per_batch": us / args.batches, "share": us / total})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models:
        got = profile_model(name, args)
        rows += got
        for path in ("fused", "plain"):
            mine = [r for r in got if r["path"] == path]
            print(f"\n{name} {path}: top {args.top} by device time per batch of {args.batch}")
            for r in mine[: args.top]:
                print(
                    f"  {r['total_us_per_batch']:9.1f} us  {100 * r['share']:5.1f} %  x{r['calls']:<5d} {r['kernel']}"
                )
    tag = args.device.replace(":", "")
    rows = with_machine_columns(rows)
    write_csv(args.out / f"entk_profile_{tag}.csv", rows)
    top = [r for r in rows if r["share"] >= 0.01]
    (args.out / f"entk_profile_{tag}.json").write_text(
        json.dumps(with_machine({"batch": args.batch, "p": args.p, "rows": top}), indent=2)
    )
    print(f"\nwritten: {args.out}/entk_profile_{tag}.csv, .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
