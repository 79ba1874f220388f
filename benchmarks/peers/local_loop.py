"""hpcfl's local step against a plain PyTorch loop, on the same data, model and batches (issue 60, item 4).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/peers/local_loop.py      # -> benchmarks/results/peers_local_loop_cpu.*

Every one-process framework in the peers table spends its round in the same PyTorch kernels: a
client's epoch of forward, backward and SGD steps. What a framework adds is its loop around them.
This measures hpcfl's loop alone (:func:`hpcfl.training.sgd.descend` over a client's
:class:`~hpcfl.training.sgd.LocalSteps` on a :class:`~hpcfl.training.flat.FlatModel`, what ``hpcfl
run`` trains with) against the loop every peer runner uses (``peer_common.train_one_epoch``:
``torch.optim.SGD`` on the module, batches gathered by indexing), interleaved (A B, B A, ...) in one
process with the same torch threads:

- ``simplecnn``: one round of the peers experiment (its first draw's 10 clients, 1 epoch at batch
  32, lr 0.05, no weight decay) — the table's work;
- ``resnet18``: BlazeFL's ResNet-18 on one CIFAR-shaped client of 500 samples, 1 epoch at batch 50,
  lr 0.1, with weight decay 1e-5 (hpcfl's default: the step whose direction buffer this measured).

Prints and writes the median seconds of each side over ``--repeats`` (the first of each dropped as a
warm-up) and their ratio (hpcfl / plain: < 1 is hpcfl faster), with the machine record.

``--threads 1`` measures both loops on one torch thread (``peers_local_loop_cpu_1thread.*``): the
plain loop's samples/s there, times the cores, is what no framework running clients in parallel
one thread each can beat on this host (the parallel modes' ceiling in the peers table).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

import blazefl_models  # noqa: E402
import peer_common as pc  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hpcfl.bench.machine import with_machine, with_machine_columns  # noqa: E402
from hpcfl.training.flat import FlatModel  # noqa: E402
from hpcfl.training.sgd import LocalSchedule, LocalSteps, descend, read_result  # noqa: E402


def _sides(
    model_fn: Callable[[], torch.nn.Module],
    clients: list[tuple[torch.Tensor, torch.Tensor]],
    batch: int,
    lr: float,
    weight_decay: float,
) -> dict[str, Callable[[], None]]:
    """The two loops over ``clients`` from the same initial model, each reloading it per client."""
    torch.manual_seed(0)
    plain_model = model_fn()
    torch.manual_seed(0)
    flat = FlatModel(model_fn())
    init_plain = {k: v.clone() for k, v in plain_model.state_dict().items()}
    init_flat = flat.vector.clone()
    schedule = LocalSchedule(lr=lr, batch_size=batch, weight_decay=weight_decay)

    def plain() -> None:
        for i, (x, y) in enumerate(clients):
            plain_model.load_state_dict(init_plain)
            gen = pc.client_generator(0, 0, i)
            if weight_decay:  # train_one_epoch is the peers' loop without weight decay
                opt = torch.optim.SGD(plain_model.parameters(), lr=lr, weight_decay=weight_decay)
                perm = torch.randperm(x.shape[0], generator=gen)
                for s in range(0, x.shape[0], batch):
                    idx = perm[s : s + batch]
                    loss = F.cross_entropy(plain_model(x[idx]), y[idx])
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    float(loss.detach())
            else:
                pc.train_one_epoch(plain_model, x, y, batch, lr, gen)

    def hpcfl() -> None:
        for i, (x, y) in enumerate(clients):
            flat.load(init_flat)
            read_result(*descend(flat, LocalSteps(flat, x, y, schedule, pc.client_generator(0, 0, i))))

    return {"plain": plain, "hpcfl": hpcfl}


def measure(sides: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(repeats):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            t = time.perf_counter()
            sides[name]()
            times[name].append(time.perf_counter() - t)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7, help="interleaved repeats per side (the first dropped)")
    p.add_argument(
        "--models", nargs="+", choices=("simplecnn", "resnet18"), default=["simplecnn", "resnet18"]
    )
    p.add_argument("--experiment", type=Path, default=REPO / "bench-out/peers/experiment")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results")
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's; 1 -> *_1thread.*)"
    )
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.repeats < 2:
        p.error("--repeats must be >= 2 (the first is a warm-up)")
    load_before = open("/proc/loadavg").read().split()[:3]
    rows = []
    for model in args.models:
        if model == "simplecnn":
            if not (args.experiment / "spec.json").exists():
                print(
                    f"local_loop: no peers bundle at {args.experiment}; build it with benchmarks/peers/experiment.py"
                )
                return 2
            exp = pc.load_experiment(args.experiment)
            clients = [exp.client_data(k) for k in exp.draw(0, 0)]
            sides = _sides(lambda exp=exp: pc.initial_model(0, exp), clients, 32, 0.05, 0.0)
        else:
            g = torch.Generator().manual_seed(0)  # host: synthetic data
            clients = [(torch.randn(500, 3, 32, 32, generator=g), torch.randint(0, 10, (500,), generator=g))]
            sides = _sides(lambda: blazefl_models.build("resnet18"), clients, 50, 0.1, 1e-5)
        times = measure(sides, args.repeats)
        med = {name: statistics.median(ts[1:]) for name, ts in times.items()}
        samples = sum(int(x.shape[0]) for x, _ in clients)
        row = {
            "model": model,
            "clients": len(clients),
            "samples": samples,
            "plain_s": med["plain"],
            "plain_samples_per_s": samples / med["plain"],
            "hpcfl_s": med["hpcfl"],
            "ratio_hpcfl_over_plain": med["hpcfl"] / med["plain"],
            "plain_runs": times["plain"],
            "hpcfl_runs": times["hpcfl"],
        }
        rows.append(row)
        print(
            f"{model}: {len(clients)} client(s), {samples} samples: plain {med['plain']:.3f} s, "
            f"hpcfl {med['hpcfl']:.3f} s, hpcfl/plain {row['ratio_hpcfl_over_plain']:.3f}, plain "
            f"{row['plain_samples_per_s']:.0f} samples/s on {torch.get_num_threads()} thread(s) "
            f"(median of {args.repeats - 1} interleaved repeats)"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    conditions = {
        "torch_threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "load_before": load_before,
        "load_after": open("/proc/loadavg").read().split()[:3],
    }
    payload = with_machine({"conditions": conditions, "rows": rows}, threads=torch.get_num_threads())
    stem = "peers_local_loop_cpu" + ("_1thread" if args.threads == 1 else "")
    (args.out / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")
    flat_rows = with_machine_columns(
        [{k: v for k, v in r.items() if not k.endswith("_runs")} for r in rows],
        threads=torch.get_num_threads(),
    )
    with open(args.out / f"{stem}.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(flat_rows[0]))
        w.writeheader()
        w.writerows(flat_rows)
    print(
        f"local_loop: -> {args.out}/{stem}.{{json,csv}}; load {conditions['load_before']} -> {conditions['load_after']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
