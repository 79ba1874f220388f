"""Differential privacy in hpcfl: DP-SGD throughput against Opacus and non-private training, the
client-level round overhead, and accuracy against ε (issue 29).

    HPCFL_DATA=/path/to/datasets python benchmarks/privacy.py --out bench-out/privacy [--tiny]

1. ``throughput`` — sample-level DP-SGD samples/s on one fixed batch (default 256 of Fashion-MNIST's
   shape 1×28×28, ``--threads`` 2 on the CPU) for simplecnn and resnet8-GN, every step a full
   private step (per-sample gradients, clip, sum, noise, SGD update), beside:
   - ``nonprivate``: hpcfl's plain local step (forward, mean loss, backward, ``sgd_step``);
   - ``opacus_hooks``: Opacus's ``GradSampleModule`` (per-sample gradient hooks) + ``DPOptimizer``;
   - ``opacus_ghost``: Opacus's ghost clipping (``GradSampleModuleFastGradientClipping`` with
     ``use_ghost_clipping=True`` + ``DPOptimizerFastGradientClipping`` + ``DPLossFastGradientClipping``),
     its fastest documented mode (two backward passes, no per-sample gradients held);
   and the ratios hpcfl/Opacus (each mode, and the faster of the two: the target's figure) and
   hpcfl/non-private, in ONE run: one worker process per mode (its own heap), the modes' steps
   interleaved across them (10 rounds), ``--sessions`` such sets of fresh workers, the median over
   all rounds, so the ratios compare like with like; under glibc's default malloc and, in every
   mode alike, one that keeps freed memory (``--allocators``; the default's page faults take
   20-50 % of a step on this machine). Targets (issue 29): ≥ 2× Opacus, ≥ 0.5× non-private.
   ``floor`` — why a ratio stops where it does: per trained layer (each alone, data hot in cache,
   malloc keeping freed memory) the cheapest norm form's DP work less what a plain backward spends
   on the same parameters, summed: a private step is at least a plain step plus this floor. Beside
   ``throughput`` it gives the best ratio against the faster Opacus mode these forms allow,
   Opacus's step / (plain step × (1 + floor share)), and the share of a plain step 2× would leave.
2. ``overhead`` — client-level DP-FedAvg's round time against plain FedAvg on the same federation
   (K = 1000 synthetic-split clients of Fashion-MNIST, M = 100 per round; round seconds at M
   participants, ABBA-ordered pairs of runs), and the work DP adds to a round timed directly (the
   end-to-end pairs swing ±15 % on this host); target ≤ 5 %.
3. ``accuracy`` — test accuracy after ``--rounds`` rounds at ε ∈ {1, 3, 8, ∞} (δ = 1e-5), client
   level (K = 1000, M = 100, σ calibrated by Opacus for the run) and sample level (10 clients),
   one plot ``accuracy_vs_epsilon.png``.

``--tiny`` shrinks everything (synthetic data, 8 steps, few clients and rounds) to check the script
end to end in about a minute; its numbers mean nothing. Results: ``<out>/privacy.json`` and
``<out>/privacy.md`` (printed).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpcfl.bench.machine import with_machine

MODELS = {"simplecnn": {}, "resnet8-gn": {"norm": "gn"}}
PARTS = ("throughput", "floor", "overhead", "accuracy")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--data-root", help="datasets directory (default: $HPCFL_DATA)")
    p.add_argument(
        "--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which parts to run (module docstring)"
    )
    p.add_argument("--batch", type=int, default=256)
    p.add_argument(
        "--steps",
        type=int,
        default=30,
        help="timed steps per mode (after 3 warm-up steps), in 10 interleaved rounds",
    )
    p.add_argument(
        "--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="throughput's models"
    )
    p.add_argument(
        "--allocators",
        nargs="+",
        choices=ALLOCATORS,
        default=list(ALLOCATORS),
        help="throughput's malloc settings",
    )
    p.add_argument("--sessions", type=int, default=3, help="throughput: sets of fresh worker processes")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="throughput's device (cuda: one GPU; timed to a sync)",
    )
    p.add_argument("--rounds", type=int, default=30, help="rounds of every client-level accuracy run")
    p.add_argument(
        "--sample-rounds", type=int, help="rounds of every sample-level accuracy run (default: --rounds)"
    )
    p.add_argument(
        "--sample-lrs",
        type=float,
        nargs="+",
        default=[0.05, 0.5, 2.0],
        help="sample level: each point's lr is chosen from these on a 5 %% validation hold-out "
        "(clipping at C = 1 shrinks DP-SGD's steps, so its lr differs from non-private training's)",
    )
    p.add_argument("--overhead-rounds", type=int, default=5, help="rounds of each overhead run")
    p.add_argument("--overhead-repeats", type=int, default=4, help="alternating FedAvg/DP-FedAvg run pairs")
    p.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 3.0, 8.0, float("inf")])
    p.add_argument("--tiny", action="store_true", help="a one-minute end-to-end check (meaningless numbers)")
    args = p.parse_args(argv)
    for name in ("batch", "steps", "threads", "sessions", "overhead_rounds", "overhead_repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.tiny:
        args.batch, args.steps, args.rounds, args.overhead_rounds, args.sessions = 32, 4, 2, 3, 1
        args.overhead_repeats = 2
        args.sample_rounds = 2
    if args.sample_rounds is None:
        args.sample_rounds = args.rounds
    return args


# -- 1. throughput -----------------------------------------------------------------------------


def _model(name: str, device: str = "cpu") -> nn.Module:
    from hpcfl.models import build_model

    torch.manual_seed(0)
    return build_model(name.split("-")[0], (1, 28, 28), 10, **MODELS[name]).to(device)


MODES = ("nonprivate", "hpcfl", "opacus_hooks", "opacus_ghost")

Workload = Callable[[str, int, str, bool], tuple[nn.Module, torch.Tensor, torch.Tensor]]
"""``(name, batch, device, for_opacus) -> (model, x, y)``: what a throughput worker trains on, built
in the worker. A top-level function or a picklable object: ``spawn`` sends it to the worker."""


def image_workload(
    name: str, batch: int, device: str, for_opacus: bool
) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """Model ``name`` of :data:`MODELS` (seed 0) and one fixed random batch of Fashion-MNIST's shape
    (seed 1); Opacus takes the model as it is."""
    torch.manual_seed(1)
    x, y = torch.randn(batch, 1, 28, 28).to(device), torch.randint(0, 10, (batch,)).to(device)
    return _model(name, device), x, y


def _step(
    mode: str, name: str, batch: int, device: str = "cpu", workload: Workload = image_workload
) -> Callable[[], None]:
    """One full training step of ``mode`` on one fixed batch (see the module docstring), its model,
    optimiser and data built here by ``workload`` (default: Fashion-MNIST's shape)."""
    import torch.nn.functional as F

    from hpcfl.privacy.sgd import clipped_grad_sum, noise_source
    from hpcfl.training.flat import FlatModel
    from hpcfl.training.sgd import LocalSchedule, cross_entropy_loss, sgd_step

    model, x, y = workload(name, batch, device, mode.startswith("opacus"))
    clip, sigma, lr = 1.0, 1.0, 0.05
    schedule = LocalSchedule(lr=lr, batch_size=batch, weight_decay=0.0)
    if mode == "nonprivate":
        flat = FlatModel(model)

        def plain() -> None:
            flat.grad.zero_()
            cross_entropy_loss(flat.model, x, y).backward()
            sgd_step(flat.params, flat.grad, schedule, None, None)

        return plain
    if mode == "hpcfl":
        flat = FlatModel(model)
        total = torch.empty_like(flat.grad)
        gen = noise_source(torch.Generator().manual_seed(0), total)  # dp_local_sgd's: on the device

        def hpcfl_dp() -> None:
            clipped_grad_sum(flat.model, cross_entropy_loss, x, y, clip, total)
            noise = torch.randn(total.shape, generator=gen, device=total.device) * (sigma * clip)
            sgd_step(flat.params, (total + noise) / batch, schedule, None, None)

        return hpcfl_dp
    if mode == "opacus_hooks":
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        hooked = GradSampleModule(model)
        opt = DPOptimizer(
            torch.optim.SGD(hooked.parameters(), lr=lr), noise_multiplier=sigma, max_grad_norm=clip,
            expected_batch_size=batch,
        )  # fmt: skip

        def opacus_hooks() -> None:
            opt.zero_grad()
            F.cross_entropy(hooked(x), y).backward()
            opt.step()

        return opacus_hooks
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    ghost = GradSampleModuleFastGradientClipping(model, max_grad_norm=clip, use_ghost_clipping=True)
    gopt = DPOptimizerFastGradientClipping(
        torch.optim.SGD(ghost.parameters(), lr=lr), noise_multiplier=sigma, max_grad_norm=clip,
        expected_batch_size=batch,
    )  # fmt: skip
    criterion = DPLossFastGradientClipping(ghost, gopt, nn.CrossEntropyLoss())

    def opacus_ghost() -> None:
        gopt.zero_grad()
        criterion(ghost(x), y).backward()
        gopt.step()

    return opacus_ghost


ALLOCATORS = ("default", "keep-freed")
"""``default``: glibc's malloc as every process gets it. ``keep-freed``: in EVERY mode's worker alike,
the environment of ``hpcfl bench entk --keep-freed-memory`` (:data:`hpcfl.bench.entk.KEEP_FREED_MEMORY`:
glibc's mmap and trim thresholds raised), so that freed buffers stay in the heap and the figure
times the computation rather than page faults (what jemalloc/tcmalloc do, as PyTorch's CPU tuning
guide recommends)."""


def _spawn(
    target: Callable[..., None], args: tuple, allocator: str
) -> tuple[mp.process.BaseProcess, Connection]:
    """A fresh ``spawn`` worker running ``target(*args, conn)`` under ``allocator``'s malloc setting
    (glibc reads it when the process starts), and the parent's end of its pipe."""
    from hpcfl.bench.entk import KEEP_FREED_MEMORY

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    saved = dict(os.environ)
    if allocator == "keep-freed":
        os.environ.update(KEEP_FREED_MEMORY)
    try:
        proc = ctx.Process(target=target, args=(*args, child), daemon=True)
        proc.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return proc, parent


def _serve(
    mode: str, name: str, batch: int, threads: int, device: str, workload: Workload, conn: Connection
) -> None:
    """A worker process for one mode: build its step, warm up 3 steps, then on each request of k
    steps run them and answer (seconds, minor page faults, system seconds) per step (None ends it)."""
    import resource
    import warnings

    warnings.filterwarnings("ignore", message="Full backward hook")
    torch.set_num_threads(threads)
    step = _step(mode, name, batch, device, workload)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        step()
    sync()
    conn.send("ready")
    while (k := conn.recv()) is not None:
        r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for _ in range(k):
            step()
        sync()
        seconds, r1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
        conn.send((seconds / k, (r1.ru_minflt - r0.ru_minflt) / k, (r1.ru_stime - r0.ru_stime) / k))


def _session(
    name: str,
    batch: int,
    per: int,
    threads: int,
    allocator: str,
    repeats: int,
    device: str = "cpu",
    workload: Workload = image_workload,
) -> dict[str, list]:
    """One set of fresh worker processes, one per mode, driven round-robin for ``repeats`` rounds of
    ``per`` steps each: every mode's (seconds, faults, system seconds) per step, per round."""
    conns, procs = {}, []
    for mode in MODES:
        proc, conns[mode] = _spawn(_serve, (mode, name, batch, threads, device, workload), allocator)
        procs.append(proc)
    rounds: dict[str, list] = {mode: [] for mode in MODES}
    try:
        for conn in conns.values():
            conn.recv()  # ready
        for _ in range(repeats):
            for mode, conn in conns.items():
                conn.send(per)
                rounds[mode].append(conn.recv())
    finally:
        for conn in conns.values():
            conn.send(None)
        for proc in procs:
            proc.join(timeout=30)
    return rounds


def throughput(
    name: str,
    batch: int,
    steps: int,
    threads: int,
    *,
    sessions: int,
    allocator: str,
    repeats: int = 10,
    device: str = "cpu",
    workload: Workload = image_workload,
) -> dict[str, Any]:
    """Samples/s of each mode (see the module docstring) and the ratios, the faster Opacus mode named
    (``opacus_fastest``), on ``workload``'s model and batch: ``sessions`` sets of fresh
    worker processes, one per mode, each set driven INTERLEAVED (``repeats`` rounds in which each
    mode in turn runs ``max(1, steps // repeats)`` steps while the others wait); per mode the median
    over all rounds of all sessions, with its page faults and system time per step.

    Why workers: under glibc's default malloc a step's time swung with its process's heap history
    (the same code in two fresh processes side by side: 22k against 43k page faults and 28 against
    69 ms of system time a step), so modes sharing one process timed each other's heap, and one
    process per mode times its luck: hence several sessions. Why interleaved: the host's drift
    between blocks of one mode then the next was up to 2× as well."""
    per = max(1, steps // repeats)
    rounds: dict[str, list] = {mode: [] for mode in MODES}
    for _ in range(sessions):
        for mode, values in _session(name, batch, per, threads, allocator, repeats, device, workload).items():
            rounds[mode] += values
    seconds = {mode: statistics.median(r[0] for r in v) for mode, v in rounds.items()}
    row: dict[str, Any] = {f"{mode}_samples_per_s": batch / s for mode, s in seconds.items()}
    row.update({f"{mode}_faults_per_step": statistics.median(r[1] for r in v) for mode, v in rounds.items()})
    row.update(
        {f"{mode}_system_s_per_step": statistics.median(r[2] for r in v) for mode, v in rounds.items()}
    )
    row["hpcfl_vs_opacus_hooks"] = seconds["opacus_hooks"] / seconds["hpcfl"]
    row["hpcfl_vs_opacus_ghost"] = seconds["opacus_ghost"] / seconds["hpcfl"]
    row["opacus_fastest"] = min(("opacus_hooks", "opacus_ghost"), key=lambda mode: seconds[mode])
    row["hpcfl_vs_opacus_fastest"] = seconds[row["opacus_fastest"]] / seconds["hpcfl"]
    row["hpcfl_vs_nonprivate"] = seconds["nonprivate"] / seconds["hpcfl"]
    return row


def _median_ms(fn: Callable[[], object], n: int = 10) -> float:
    """Median milliseconds of ``fn`` over ``n`` calls after 2 warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def _plain_layer_ms(layer: Any) -> float:
    """What a NON-private backward spends on this layer's parameters: its weight and bias gradients
    (a GroupNorm's: its native backward with them less without them, at least 0)."""
    from hpcfl.privacy import ghost

    m, a, g = layer.module, layer.input, layer.grad
    if isinstance(m, nn.Conv2d):
        ap, pad = ghost._padded(m, a)
        bias = m.bias is not None and m.bias.requires_grad
        return _median_ms(
            lambda: (ghost._weight_grad(m, ap, g, pad, per_sample=False), bias and g.sum((0, 2, 3)))
        )
    if isinstance(m, nn.Linear):
        return _median_ms(lambda: (g.T @ a, g.sum(0)))
    mean, rstd = layer.stats
    B, C = g.shape[:2]
    HW, weight = g[0, 0].numel(), m.weight.detach()

    def native(mask: list[bool]) -> Callable[[], object]:
        return lambda: torch.ops.aten.native_group_norm_backward(
            g, a, mean, rstd, weight, B, C, HW, m.num_groups, mask
        )

    return max(0.0, _median_ms(native([True, True, True])) - _median_ms(native([True, False, False])))


def _floor(name: str, batch: int, threads: int, conn: Connection) -> None:
    """Worker: per trained layer of ``name`` on the benchmark's batch, the DP work of every norm form
    whose modelled cost is within 8× the cheapest (:func:`hpcfl.privacy.ghost.conv_form_costs`;
    norms and clipped sums, :func:`~hpcfl.privacy.ghost.layer_part`), the plain backward's work for
    the same parameters, and the whole plain and private steps; sends the result."""
    from hpcfl.privacy import ghost

    torch.set_num_threads(threads)
    torch.manual_seed(1)
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    model = _model(name)
    names = {m: n for n, m in model.named_modules()}
    _, layers = ghost.output_grads(model, x, y)
    c = torch.rand(batch)  # clip factors
    rows = []
    for layer in layers:
        m = layer.module
        forms: list[Any] = [None]
        if isinstance(m, nn.Conv2d):
            cost = ghost.conv_form_costs(m, layer.grad[0, 0].numel(), tuple(layer.grad.shape[2:]))
            forms = [f for f, v in cost.items() if v <= 8 * min(cost.values())]
        dp = {
            f or type(m).__name__: _median_ms(lambda f=f, layer=layer: ghost.layer_part(layer, f)[1](c))
            for f in forms
        }
        plain = _plain_layer_ms(layer)
        rows.append({"layer": names[m], "input": list(layer.input.shape[1:]), "output": list(layer.grad.shape[1:]),
                     "dp_ms": dp, "plain_ms": plain, "extra_ms": max(0.0, min(dp.values()) - plain)})  # fmt: skip
    steps = {mode: _median_ms(_step(mode, name, batch)) for mode in ("nonprivate", "hpcfl")}
    conn.send({"layers": rows, "floor_ms": sum(r["extra_ms"] for r in rows), "step_ms": steps})


def floor(name: str, batch: int, threads: int) -> dict[str, Any]:
    """The least a private step must add to a plain one, measured: per trained layer the cheapest
    form's DP work (norms and clipped sums, each layer alone, its data hot in cache) less what a
    plain backward spends on the same parameters, summed (``floor_ms``), beside the whole plain and
    private steps — in one fresh worker whose malloc keeps freed memory, so that it times the
    computation. A private step is at least a plain step plus this floor: if 2× the faster Opacus
    mode would need less, 2× is out of reach by these forms (Opacus and the book-keeping literature
    have no cheaper per-sample norm)."""
    proc, conn = _spawn(_floor, (name, batch, threads), "keep-freed")
    try:
        return conn.recv()
    finally:
        proc.join(timeout=30)


# -- 2./3. runs --------------------------------------------------------------------------------


def _config(args: argparse.Namespace, level: str, epsilon: float | None, rounds: int) -> dict[str, Any]:
    """The federation of a run: client level K = 1000 iid clients of 60 samples, M = 100, two local
    epochs of batch 16 at lr 0.05 (lr 0.1 diverged at ε = 1; one step of batch 64 per round left
    even the non-private model untrained, ~20 % after 30 rounds, and the noise's growth of the
    weights then read as a gain); sample level 10 dir:0.5 clients, one local epoch of batch 64 at
    lr 0.05."""
    keys: dict[str, Any] = dict(
        name="privacy", dataset="fashion-mnist", partition="dir:0.5", model="simplecnn", algorithm="fedavg",
        rounds=rounds, local_epochs=1, lr=0.05, batch_size=64, seed=0, threads=args.threads, progress=False,
        download=False,
    )  # fmt: skip
    if args.data_root:
        keys["data_root"] = args.data_root
    if level == "client":
        keys.update(
            num_clients=1000, clients_per_round=100, partition="iid", local_epochs=2, batch_size=16, lr=0.05
        )
    else:
        keys.update(num_clients=10)
    if args.tiny:
        keys.update(
            dataset="synthetic", dataset_options={"n_train": 600, "n_test": 100, "seed": 3}, model="mlp"
        )
        keys.update(num_clients=20, clients_per_round=5) if level == "client" else keys.update(num_clients=3)
    if epsilon is not None:
        privacy: dict[str, Any] = {"level": level, "clip": 1.0 if level == "sample" else 0.5}
        if epsilon == float("inf"):
            privacy["noise_multiplier"] = 1e-9  # clipping alone: the ε = ∞ point of the curve
        else:
            privacy["epsilon"] = epsilon
        if level == "client":
            privacy["adaptive_clip"] = {"target_quantile": 0.5, "count_stddev": 5.0}  # M/20 at M = 100
        keys["privacy"] = privacy
    return keys


def _run(args: argparse.Namespace, keys: dict[str, Any], tag: str) -> list[dict[str, Any]]:
    from hpcfl.config import config_from_dict
    from hpcfl.runner import run_experiment

    run_dir = args.out / "runs" / tag
    result = run_experiment(config_from_dict(keys), run_dir, overwrite=True)
    return result.metrics


def _round_at(rows: list[dict[str, Any]], m: int) -> float:
    """A run's round seconds at ``m`` participants: the median of its rounds' part outside local
    training (``seconds - compute_s``: evaluation, aggregation, the server step) plus ``m`` times the
    median local-training seconds per participant (the first round dropped as warm-up)."""
    rows = rows[1:] or rows
    fixed = statistics.median(r["seconds"] - r["compute_s"] for r in rows)
    return fixed + m * statistics.median(r["compute_s"] / max(1, len(r["participants"])) for r in rows)


def _dp_work_s(params: int, m: int, sigma: float, q: float, rounds: int, repeats: int = 5) -> float:
    """Seconds of the work client-level DP adds to one round, timed directly with the wrapper's own
    functions (:mod:`hpcfl.privacy.private`): clipping ``m`` uploads of ``params`` entries (the
    participants' half, each on its rank), then the server's half — the round's noise generator and
    its N(0, (σS)²) draw added to the sum, the noised count and the adaptive clip's step, and the
    accountant's ε twice (the metrics row's and the budget check's), at round ``rounds``. The median
    of ``repeats``."""
    from hpcfl.privacy import accountant
    from hpcfl.privacy.private import adaptive_clip_step, clip_update, noise_generator
    from hpcfl.privacy.section import AdaptiveClipSection

    deltas = torch.randn(m, params)
    summed = torch.zeros(params)
    adaptive = AdaptiveClipSection(target_quantile=0.5, lr=0.2)
    times = []
    for rep in range(repeats):
        t = time.perf_counter()
        below = sum(clip_update(d, 0.5)[1] for d in deltas)
        gen = noise_generator(0, rep)
        noise = torch.randn(params, generator=gen, dtype=torch.float64) * (sigma * 0.5)
        summed.add_(noise.to(summed.dtype))
        count = (below + float(torch.randn(1, generator=gen, dtype=torch.float64)) * 5.0) / m
        adaptive_clip_step(0.5, count, adaptive)
        for _ in range(2):
            accountant.worst_epsilon(sigma, [(q, rounds + rep)], 1e-5, "rdp")
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    """Round seconds of FedAvg and client-level DP-FedAvg (adaptive clipping) alike, in
    ``--overhead-repeats`` pairs of short runs in ABBA order (FedAvg, DP, DP, FedAvg, ...; each run's
    first round dropped as warm-up): the overhead is the median over pairs of the pair's ratio of
    round times at M participants (:func:`_round_at`: DP-FedAvg samples its participants by Poisson,
    so a round's count varies, 83 to 109 where FedAvg takes 100, and with the same seed in every
    pair the raw medians had read that draw as a steady +4-5 %). One FedAvg run then one DP run, as
    before, had measured the host's drift instead: the FedAvg rounds of one run grew from 2.05 to
    2.85 s while nothing else ran."""
    M = _config(args, "client", None, 1)["clients_per_round"]
    ratios, plain_s, private_s = [], [], []
    for rep in range(args.overhead_repeats):
        order = (None, 3.0) if rep % 2 == 0 else (3.0, None)  # ABBA: order effects and linear drift cancel
        runs = {eps: _run(args, _config(args, "client", eps, args.overhead_rounds), f"overhead_{rep}_{eps}")
                for eps in order}  # fmt: skip
        plain, private = runs[None], runs[3.0]
        a, b = _round_at(plain, M), _round_at(private, M)
        plain_s.append(a)
        private_s.append(b)
        ratios.append(b / a)
    from hpcfl.models import build_model

    cfg = _config(args, "client", 3.0, args.overhead_rounds)
    params = sum(p.numel() for p in build_model(cfg["model"], (1, 28, 28), 10).parameters())
    q = M / cfg["num_clients"]
    sigma = float(private[-1]["dp_noise_multiplier"])
    work = _dp_work_s(params, M, sigma, q, args.overhead_rounds)
    return {
        "dp_work_s": work,
        "dp_work_share": work / statistics.median(plain_s),
        "fedavg_round_s": statistics.median(plain_s),
        "dp_fedavg_round_s": statistics.median(private_s),
        "overhead": statistics.median(ratios) - 1.0,
        "pair_overheads": [r - 1.0 for r in ratios],
    }


def accuracy(args: argparse.Namespace) -> dict[str, dict[str, dict[str, float]]]:
    """Per level, per point (``nonprivate`` and each ε): the final test accuracy, the noise multiplier
    σ the run used (calibrated by Opacus's ``get_noise_multiplier`` for the run's rounds, sampling
    rate and steps; ε = ∞ is clipping with σ = 1e-9) and the ε(δ) the accountant reports at the end."""
    out: dict[str, dict[str, dict[str, float]]] = {}

    def final(level: str, eps: float | None, rounds: int, tag: str) -> dict[str, Any]:
        """The last row of the point's run; at sample level, of the run whose lr (from
        ``--sample-lrs``) has the best validation accuracy (its ``lr`` added to the row)."""
        keys = _config(args, level, eps, rounds)
        keys.update(eval_every=rounds, checkpoint_every=rounds)  # only the last round is read
        if level == "client":
            return _run(args, keys, tag)[-1]
        from hpcfl.errors import DivergenceError

        rows = {}
        for lr in args.sample_lrs:
            try:
                rows[lr] = _run(args, {**keys, "lr": lr, "validation": 0.05}, f"{tag}_lr{lr:g}")[-1]
            except DivergenceError:  # a candidate lr that diverges loses the choice
                continue
        best = max(rows, key=lambda lr: rows[lr]["val_accuracy"])
        return {**rows[best], "lr": best}

    for level, rounds in (("client", args.rounds), ("sample", args.sample_rounds)):
        last = final(level, None, rounds, f"{level}_nonprivate")
        out[level] = {
            "nonprivate": {"accuracy": last["test_accuracy"], "rounds": rounds, "lr": last.get("lr")}
        }
        for eps in args.epsilons:
            last = final(level, eps, rounds, f"{level}_eps{eps:g}")
            out[level][f"{eps:g}"] = {
                "accuracy": last["test_accuracy"], "sigma": last["dp_noise_multiplier"],
                "epsilon": last["epsilon"], "rounds": rounds, "lr": last.get("lr"),
            }  # fmt: skip
            (args.out / "accuracy_partial.json").write_text(json.dumps(out, indent=1))  # survives a kill
    return out


def plot(acc: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for level, points in acc.items():
        eps = [k for k in points if k != "nonprivate"]
        xs = [float(k) if k != "inf" else 30.0 for k in eps]
        ys = [100 * points[k]["accuracy"] for k in eps]
        ax.plot(xs, ys, "o-", label=f"{level} level ({points['nonprivate']['rounds']} rounds)")
        ax.axhline(100 * points["nonprivate"]["accuracy"], ls=":", color=ax.lines[-1].get_color())
        for k, x_, y_ in zip(eps, xs, ys, strict=True):
            ax.annotate(f"σ={points[k]['sigma']:.2g}", (x_, y_), textcoords="offset points", xytext=(4, -11),
                        fontsize=7, color=ax.lines[-1].get_color())  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("ε at δ = 1e-5 (∞ drawn at 30; dotted: non-private)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(
        "Fashion-MNIST, simplecnn; each finite ε: σ calibrated by Opacus's\n"
        "get_noise_multiplier (RDP) for the run's rounds, q and steps; ε = ∞: clipping only",
        fontsize=8,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    lines = ["# Differential privacy benchmark", ""]
    if "throughput" in args.parts:
        lines += [f"## DP-SGD samples/s (batch {args.batch}, {args.threads} threads, {args.sessions} sessions)", "",
                  "| model | malloc | non-private | hpcfl DP-SGD | Opacus hooks | Opacus ghost | hpcfl/hooks "
                  "| hpcfl/ghost | hpcfl/fastest Opacus | hpcfl/non-private | page faults per step: non-private, "
                  "hpcfl, hooks, ghost |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
        results["throughput"] = {}
        for allocator in args.allocators:
            results["throughput"][allocator] = {}
            for name in args.models:
                r = throughput(
                    name,
                    args.batch,
                    args.steps,
                    args.threads,
                    sessions=args.sessions,
                    allocator=allocator,
                    device=args.device,
                )
                results["throughput"][allocator][name] = r
                faults = ", ".join(f"{r[f'{mode}_faults_per_step'] / 1000:.0f}k" for mode in MODES)
                lines.append(
                    f"| {name} | {allocator} | {r['nonprivate_samples_per_s']:.0f} | {r['hpcfl_samples_per_s']:.0f} "
                    f"| {r['opacus_hooks_samples_per_s']:.0f} | {r['opacus_ghost_samples_per_s']:.0f} "
                    f"| {r['hpcfl_vs_opacus_hooks']:.2f}× | {r['hpcfl_vs_opacus_ghost']:.2f}× "
                    f"| **{r['hpcfl_vs_opacus_fastest']:.2f}×** | {r['hpcfl_vs_nonprivate']:.2f}× | {faults} |"
                )
                print(lines[-1], flush=True)
        lines.append("")
    if "floor" in args.parts:
        lines += ["## The floor: what a private step adds at least (malloc keeping freed memory)", "",
                  "| model | layer | input → output | DP work by form, ms | plain backward's, ms | extra, ms |",
                  "|---|---|---|---|---:|---:|"]  # fmt: skip
        results["floor"] = {}
        bounds = []
        for name in args.models:
            f = results["floor"][name] = floor(name, args.batch, args.threads)
            for r in f["layers"]:
                forms = ", ".join(f"{k} {v:.2f}" for k, v in r["dp_ms"].items())
                lines.append(f"| {name} | {r['layer']} | {r['input']} → {r['output']} | {forms} "
                             f"| {r['plain_ms']:.2f} | {r['extra_ms']:.2f} |")  # fmt: skip
            plain, private = f["step_ms"]["nonprivate"], f["step_ms"]["hpcfl"]
            f["floor_share"] = f["floor_ms"] / plain
            bounds.append(f"- **{name}**: floor {f['floor_ms']:.1f} ms = **{100 * f['floor_share']:.0f} %** of its "
                          f"plain step ({plain:.1f} ms; the private step {private:.1f} ms, "
                          f"+{100 * (private / plain - 1):.0f} %, same worker).")  # fmt: skip
            for allocator, rows in results.get("throughput", {}).items():
                if name not in rows:
                    continue
                t = rows[name]
                opacus_over_plain = t["nonprivate_samples_per_s"] / max(
                    t["opacus_hooks_samples_per_s"], t["opacus_ghost_samples_per_s"]
                )  # the FASTER Opacus mode's step, in plain steps
                f[f"best_vs_opacus_fastest_{allocator}"] = opacus_over_plain / (1 + f["floor_share"])
                bounds.append(f"  {allocator} malloc: the faster Opacus step is {opacus_over_plain:.2f}× a plain "
                              f"step, so 2× leaves {100 * (opacus_over_plain / 2 - 1):+.0f} % of a plain step; "
                              f"plain + floor reaches at most **{opacus_over_plain / (1 + f['floor_share']):.2f}×** "
                              f"(measured {t['hpcfl_vs_opacus_fastest']:.2f}×).")  # fmt: skip
        lines += ["", *bounds, ""]
        print("\n".join(lines[-len(bounds) - 2 :]), flush=True)
    if "overhead" in args.parts:
        o = results["overhead"] = overhead(args)
        lines += ["## Client-level round overhead", "",
                  f"FedAvg {o['fedavg_round_s']:.3f} s, DP-FedAvg {o['dp_fedavg_round_s']:.3f} s per round at "
                  "M participants "
                  f"(medians over {args.overhead_repeats} ABBA-ordered pairs of {args.overhead_rounds}-round runs): "
                  f"{100 * o['overhead']:+.1f} % (median of the pairs' "
                  + ", ".join(f"{100 * x:+.1f}" for x in o["pair_overheads"]) + ")",
                  "", f"The work DP adds to a round, timed directly (clipping M uploads, the noise, the "
                  f"adaptive clip, the accountant): {1000 * o['dp_work_s']:.1f} ms = "
                  f"{100 * o['dp_work_share']:.2f} % of a FedAvg round.", ""]  # fmt: skip
    if "accuracy" in args.parts:
        acc = results["accuracy"] = accuracy(args)
        plot(acc, args.out / "accuracy_vs_epsilon.png")
        lines += ["## Test accuracy against ε (δ = 1e-5)", "",
                  "Each finite ε: σ calibrated by Opacus's `get_noise_multiplier` (RDP) for the run's rounds, "
                  "sampling rate and steps (client level: q = M/K per round; sample level: q = B/n_k per "
                  "step, the worst client); ε = ∞: clipping with σ = 1e-9. Client level: K = 1000 iid "
                  "clients, M = 100 (Poisson), adaptive clip, lr 0.05 (not tuned); sample level: 10 dir:0.5 "
                  "clients, clip 1, each point's lr chosen from --sample-lrs by its 5 % validation hold-out's "
                  "accuracy (test accuracy of that run reported); one seed.",
                  "", "| level | rounds | point | lr | σ | ε reported | test accuracy |",
                  "|---|---:|---|---:|---:|---:|---:|"]  # fmt: skip
        for level, points in acc.items():
            for k, r in points.items():
                sig = f"{r['sigma']:.4g}" if "sigma" in r else "—"
                rep = ("∞" if r["epsilon"] > 1e6 else f"{r['epsilon']:.3g}") if "epsilon" in r else "—"
                lr = f"{r['lr']:g}" if r.get("lr") is not None else "0.05"
                lines.append(
                    f"| {level} | {r['rounds']} | {k} | {lr} | {sig} | {rep} | {100 * r['accuracy']:.2f}% |"
                )
        lines.append("")
    (args.out / "privacy.json").write_text(json.dumps(with_machine(results), indent=1))
    text = "\n".join(lines)
    (args.out / "privacy.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
