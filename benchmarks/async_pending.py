"""The asynchronous server step's bookkeeping of updates in flight, against its former way (issue 63).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/async_pending.py   # -> benchmarks/results/async_pending_cpu.{json,csv}

FedAsync and FedBuff keep every update in flight in the server state (``pending``, one row each) so
that a checkpoint holds them. The step used to rebuild that matrix twice a step: the new rows
concatenated to it, then the applied rows indexed out. It now keeps the rows in slots and fills the
freed ones in place (:class:`hpcfl.algorithms.asynchronous.AsyncServerState`). This times the server
step alone (``server_update``, with the algorithm's own ``kept`` and ``apply``) in the steady state of
a run at a given concurrency: ``concurrency`` updates in flight, each step adding the updates trained
from its model and applying as many of the oldest (FedAsync 1 a step, FedBuff its K = 10), on the
MLP's 79,510-entry state, against the former way reimplemented here (``rebuilt``). Interleaved, the
first repeat dropped; prints and writes the median milliseconds a step and the ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from hpcfl.algorithms import Aggregate, Arrival, Population, ServerContext
from hpcfl.algorithms.asynchronous import AsyncAlgorithm, AsyncServerState
from hpcfl.algorithms.fedasync import FedAsync, FedAsyncParams
from hpcfl.algorithms.fedbuff import FedBuff, FedBuffParams
from hpcfl.bench.machine import with_machine, with_machine_columns
from hpcfl.files import write_csv
from hpcfl.models.mlp import MLP
from hpcfl.training.layout import StateLayout

RESULTS = Path(__file__).resolve().parent / "results"


def rebuilt_update(
    algo: AsyncAlgorithm, server: AsyncServerState, aggregate: Aggregate, ctx: ServerContext
) -> AsyncServerState:
    """The former server step: concatenate the new rows, index the applied ones out."""
    trained = aggregate.gathered.get("y", [])
    pending, keys = server.pending, server.pending_keys
    if trained:
        rows = torch.stack([algo.kept(y, server.x) for y in trained])
        new_keys = torch.tensor([[ctx.round, k] for k in ctx.participants], dtype=torch.int64)
        pending, keys = torch.cat([pending, rows]), torch.cat([keys, new_keys])
    index = {(int(v), int(k)): i for i, (v, k) in enumerate(keys.tolist())}
    chosen = [index[(a.version, a.client)] for a in ctx.arrivals]
    x, _ = algo.apply(server.x, [pending[i] for i in chosen], ctx.arrivals)
    keep = [i for i in range(keys.shape[0]) if i not in set(chosen)]
    return dataclasses.replace(server, x=x, pending=pending[keep], pending_keys=keys[keep])


def measure(name: str, concurrency: int, steps: int, repeats: int) -> dict[str, object]:
    """Median seconds a step of both ways, each run from the same steady state."""
    model = MLP((1, 28, 28), 10)
    layout = StateLayout.of_model(model)
    size = layout.size
    pop = Population(tuple([100] * (2 * concurrency)))
    per_step = 1 if name == "fedasync" else 10
    algo: AsyncAlgorithm
    if name == "fedasync":
        algo = FedAsync(FedAsyncParams(alpha=0.6, concurrency=concurrency), layout=layout)
    else:
        algo = FedBuff(FedBuffParams(buffer_size=per_step, concurrency=concurrency), layout=layout)
    algo.resolved(pop, None)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(0)  # host: synthetic updates
    x0 = torch.randn(size, generator=g)
    updates = [x0 + 0.01 * torch.randn(size, generator=g) for _ in range(per_step)]

    def fill() -> tuple[AsyncServerState, list[tuple[int, int]]]:
        """``concurrency`` updates in flight, trained from steps 0 .. concurrency/per_step - 1."""
        state = algo.init_server(x0.clone())
        flight: list[tuple[int, int]] = []
        client = 0
        for v in range(concurrency // per_step):
            who = tuple(range(client, client + per_step))
            client += per_step
            state, _ = algo.server_update(
                state,
                Aggregate({}, float(per_step), per_step, {"y": updates}),
                ServerContext(v, who, pop, _same),
            )
            flight += [(v, k) for k in who]
        return state, flight

    def run(way: str) -> float:
        state, flight = fill()
        version = concurrency // per_step
        client = concurrency
        t = time.perf_counter()
        for s in range(steps):
            rnd = version + s
            who = tuple((client + i) % len(pop.sizes) for i in range(per_step))
            client += per_step
            arrived = tuple(Arrival(k, v, float(rnd), rnd - v) for v, k in flight[:per_step])
            flight = flight[per_step:] + [(rnd, k) for k in who]
            agg = Aggregate({}, float(per_step), per_step, {"y": updates})
            ctx = ServerContext(rnd, who, pop, _same, arrivals=arrived)
            if way == "slots":
                state, _ = algo.server_update(state, agg, ctx)
            else:
                state = rebuilt_update(algo, state, agg, ctx)
        return (time.perf_counter() - t) / steps

    times: dict[str, list[float]] = {"slots": [], "rebuilt": []}
    for r in range(repeats):
        for way in ("slots", "rebuilt") if r % 2 == 0 else ("rebuilt", "slots"):
            times[way].append(run(way))
    med = {way: statistics.median(ts[1:]) for way, ts in times.items()}
    return {
        "algorithm": name,
        "concurrency": concurrency,
        "updates_per_step": per_step,
        "state_entries": size,
        "steps": steps,
        "slots_ms_per_step": med["slots"] * 1e3,
        "rebuilt_ms_per_step": med["rebuilt"] * 1e3,
        "speedup": med["rebuilt"] / med["slots"],
    }


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[100, 500])
    p.add_argument("--steps", type=int, default=50, help="server steps timed per repeat")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats (the first dropped)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.repeats < 2 or args.steps < 1 or min(args.concurrency) < 10:
        p.error("--repeats >= 2, --steps >= 1 and every --concurrency >= 10 (FedBuff's K)")
    load_before = open("/proc/loadavg").read().split()[:3]
    rows = []
    for concurrency in args.concurrency:
        for name in ("fedasync", "fedbuff"):
            row = measure(name, concurrency, args.steps, args.repeats)
            rows.append(row)
            print(
                f"{name} at concurrency {concurrency}: slots {row['slots_ms_per_step']:.2f} ms a step, "
                f"rebuilt {row['rebuilt_ms_per_step']:.2f} ms ({row['speedup']:.1f}x)",
                flush=True,
            )
    conditions = {
        "threads": torch.get_num_threads(),
        "load_before": load_before,
        "load_after": open("/proc/loadavg").read().split()[:3],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    payload = with_machine({"conditions": conditions, "rows": rows}, threads=torch.get_num_threads())
    (args.out / "async_pending_cpu.json").write_text(json.dumps(payload, indent=2) + "\n")
    flat = with_machine_columns(rows, threads=torch.get_num_threads())
    write_csv(args.out / "async_pending_cpu.csv", flat)
    print(
        f"async_pending: -> {args.out}/async_pending_cpu.{{json,csv}}; load {load_before} -> {conditions['load_after']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
