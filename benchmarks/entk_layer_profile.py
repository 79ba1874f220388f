"""Where the fused eNTK extractor's time goes on this CPU, layer by layer, beside plain training (issue 66, item 1).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/entk_layer_profile.py   # -> benchmarks/results/entk_layer_profile_cpu.{json,csv,md}

One batch of ``hpcfl bench entk``'s work (its model, batch and coordinate draw: simplecnn, B = 256,
p = 100,000, 2 threads), timed in parts, interleaved with plain training of the same batch (forward
and backward, parameter gradients only: the ratio's denominator) over ``--rounds`` rounds, the first
dropped:

- ``forward`` and ``grad`` (the batched ``autograd.grad`` to every planned layer's output) of the
  fused batch: wall seconds;
- each layer's gather tasks (``LinearPlan``/``ConvPlan``... ``tasks``, run by ``run_tasks`` on the
  2 threads): the CPU seconds of its tasks (``time.thread_time``, summed over the threads) and
  the wall seconds of the whole gather phase;
- plain training's forward and backward: wall seconds.

Medians over rounds. The instrumentation wraps the extractor's own functions from outside (nothing
in ``hpcfl`` changes), so the fused batch costs what it costs in ``hpcfl bench entk`` plus a few
microseconds per task.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import hpcfl.entk.fused as fused  # noqa: E402
import hpcfl.entk.layers as layers  # noqa: E402
from hpcfl.bench.entk.runners import input_shape, make_runner, model_and_batch  # noqa: E402
from hpcfl.bench.machine import with_machine, with_machine_columns  # noqa: E402
from hpcfl.files import write_csv  # noqa: E402

PLANS = (layers.LinearPlan, layers.ConvPlan, layers.NormPlan, layers.EmbeddingPlan, layers.LayerNormPlan)


def _shape(module: torch.nn.Module) -> str:
    weight = getattr(module, "weight", None)
    return "" if weight is None else "x".join(map(str, weight.shape))


class Probe:
    """Wraps the fused batch's parts; ``parts`` collects one round's seconds by name."""

    def __init__(self, model: torch.nn.Module) -> None:
        #: (kind, weight shape) -> the layer's name in ``model`` (the runner builds its own copy of the
        #: model, so its modules are named by matching their kind and shape)
        self.by_shape = {(type(m), _shape(m)): n for n, m in reversed(list(model.named_modules()))}
        self.parts: dict[str, float] = defaultdict(float)
        self._forward, self._grad, self._run_tasks = fused._forward, torch.autograd.grad, fused.run_tasks
        self._tasks = {cls: cls.tasks for cls in PLANS}

    def label(self, module: torch.nn.Module) -> str:
        """The module's name in the model, else its kind and weight shape."""
        key = (type(module), _shape(module))
        return self.by_shape.get(key, f"{type(module).__name__} {key[1]}")

    def install(self) -> None:
        probe = self

        def forward(*args, **kwargs):
            t = time.perf_counter()
            out = probe._forward(*args, **kwargs)
            probe.parts["forward"] += time.perf_counter() - t
            return out

        def grad(*args, **kwargs):
            t = time.perf_counter()
            out = probe._grad(*args, **kwargs)
            probe.parts["grad"] += time.perf_counter() - t
            return out

        def run_tasks(tasks, workers):
            t = time.perf_counter()
            probe._run_tasks(tasks, workers)
            probe.parts["gathers (wall)"] += time.perf_counter() - t

        def tasks_of(cls):
            original = probe._tasks[cls]

            def tasks(self, module, *args, **kwargs):
                label = f"{probe.label(module)} ({cls.__name__}) CPU"
                out = original(self, module, *args, **kwargs)

                def timed(task):
                    def run() -> None:
                        t = time.thread_time()
                        task()
                        probe.parts[label] += time.thread_time() - t

                    return run

                return [timed(task) for task in out]

            return tasks

        fused._forward, torch.autograd.grad, fused.run_tasks = forward, grad, run_tasks
        for cls in PLANS:
            cls.tasks = tasks_of(cls)

    def remove(self) -> None:
        fused._forward, torch.autograd.grad, fused.run_tasks = self._forward, self._grad, self._run_tasks
        for cls, original in self._tasks.items():
            cls.tasks = original


def plain_parts(model: torch.nn.Module, x: torch.Tensor) -> dict[str, float]:
    model.zero_grad(set_to_none=True)
    t = time.perf_counter()
    score = model(x)[:, 0].sum()
    t1 = time.perf_counter()
    score.backward()
    t2 = time.perf_counter()
    return {"plain forward": t1 - t, "plain backward": t2 - t1, "plain total": t2 - t}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="simplecnn")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--p", type=int, default=100_000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8, help="interleaved rounds (the first dropped)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = {
        "model": args.model,
        "batch": args.batch,
        "p": args.p,
        "seed": 0,
        "device": "cpu",
        "method": "fused",
        "threads": args.threads,
        "input_shape": list(input_shape(args.model)),
        "loop_samples": 8,
    }
    run, _, _, _ = make_runner(spec)
    model, x = model_and_batch({**spec, "method": "plain"})
    load_before = open("/proc/loadavg").read().split()[:3]
    rounds: list[dict[str, float]] = []
    probe = Probe(model)
    run()  # warm-up (plan, workspace)
    plain_parts(model, x)
    for r in range(args.rounds):
        row: dict[str, float] = {}
        for side in ("fused", "plain") if r % 2 == 0 else ("plain", "fused"):
            if side == "plain":
                row.update(plain_parts(model, x))
                continue
            probe.parts.clear()
            probe.install()
            try:
                t = time.perf_counter()
                run()
                row["fused total"] = time.perf_counter() - t
            finally:
                probe.remove()
            row.update(probe.parts)
        rounds.append(row)
    kept = rounds[1:]
    keys = list(dict.fromkeys(k for row in kept for k in row))
    med = {k: statistics.median(row.get(k, 0.0) for row in kept) for k in keys}
    ratio = med["plain total"] / med["fused total"]
    print(
        f"{args.model} B={args.batch} p={args.p} threads={args.threads}: fused {med['fused total'] * 1e3:.1f} ms, "
        f"plain {med['plain total'] * 1e3:.1f} ms -> fused/plain throughput {ratio:.2f}x "
        f"(median of {len(kept)} interleaved rounds; the probe's own cost is in fused)"
    )
    for k in keys:
        print(f"  {k:32s} {med[k] * 1e3:8.1f} ms")
    args.out.mkdir(parents=True, exist_ok=True)
    conditions = {
        "model": args.model,
        "batch": args.batch,
        "p": args.p,
        "threads": args.threads,
        "rounds": args.rounds,
        "load_before": load_before,
        "load_after": open("/proc/loadavg").read().split()[:3],
        "throughput_ratio_fused_over_plain": ratio,
    }
    payload = with_machine(
        {"conditions": conditions, "median_s": med, "rounds": rounds}, threads=args.threads
    )
    (args.out / "entk_layer_profile_cpu.json").write_text(json.dumps(payload, indent=2) + "\n")
    rows = with_machine_columns([{"part": k, "median_ms": med[k] * 1e3} for k in keys], threads=args.threads)
    write_csv(args.out / "entk_layer_profile_cpu.csv", rows)
    md = [
        f"# Fused eNTK extractor, part by part, beside plain training ({args.model}, B = {args.batch}, "
        f"p = {args.p:,}, {args.threads} threads, CPU)\n",
        f"Median of {len(kept)} interleaved rounds (the first dropped); load {load_before} before. Fused "
        f"throughput / plain: {ratio:.2f}x. Layer rows are the CPU seconds of that layer's gather tasks "
        "summed over the threads; `gathers (wall)` is the phase's wall time.\n",
        "| part | median ms |",
        "|---|---:|",
        *[f"| {k} | {med[k] * 1e3:.1f} |" for k in keys],
    ]
    (args.out / "entk_layer_profile_cpu.md").write_text("\n".join(md) + "\n")
    print(f"entk_layer_profile: -> {args.out}/entk_layer_profile_cpu.{{json,csv,md}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
