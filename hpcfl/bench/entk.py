"""``hpcfl bench entk``: eNTK feature throughput of every method against one training step.

For one model and batch, each method computes the (B, p) features of the same random batch
(dataset-shaped: 1×28×28 for simplecnn/mlp, 3×32×32 for the CIFAR models, 10 classes; symbol codes
of Shakespeare's 80-symbol vocabulary, L = 80, for the ``char-`` text models) in a fresh
subprocess, so one method's allocations never colour another's memory figure (``--in-process``
runs them all in this process instead: on a GPU each fresh process pays a CUDA start-up of ~4 s,
which is most of a lent GPU session's eNTK step; CUDA peak memory is still reset per method):

- ``loop`` / ``vmap`` / ``fused``: :func:`hpcfl.entk.entk_features` with that method;
- ``fused-graph`` (``--device cuda`` only): ``fused`` with ``cuda_graph=True``, full batches
  replayed as one CUDA graph (:mod:`hpcfl.entk.cuda_graph`). Its set-up runs two batches (the eager
  one that compiles the kernels, then the capture, checked against the eager batch), so every timed
  batch is a replay; its note says whether the graph is in use or why it fell back to eager. On
  the CPU it is refused (one line, exit 2): there it is ``fused``;
- ``opacus`` / ``opacus-functorch``: ``GradSampleModule(loss_reduction="sum")`` per-sample
  gradients in Opacus's two modes that form them — its per-layer hooks (the default) and
  ``force_functorch`` (``vmap`` per layer) — then the same coordinate gather (Opacus only records
  activations in train mode, so it runs in train mode, which is the same function for models
  without BatchNorm/dropout; BN models are skipped). Opacus's ghost clipping computes per-sample
  gradient norms without ever forming the gradients, so it cannot give eNTK coordinates and is not
  a method here (``benchmarks/privacy.py`` times it for the DP step, where it applies);
- ``backpack``: ``extend(model)`` + ``BatchGrad``, then the same gather;
- ``plain``: one batched forward + backward of Σ_b f_logit(x_b) (parameter gradients only) —
  the practical limit every method is compared with.

Timing: one warm-up, then ``--repeats`` timed runs; the best (minimum) time is reported together
with the median. All methods are run ``--rounds`` times, interleaved, and each keeps its best round
(peak memory: the largest of its rounds): the dev machine's cores are shared, so a busy spell
must not land on one method only, and the minimum is the stable figure. Each acceptance ratio is
also given per round (methods of one round run back to back, so they share the machine's state)
and as the median over rounds: on a host whose speed drifts by ±20% over minutes, the ratio of
two best-of-all-rounds figures taken at different times is the noisier statistic. ``loop``
runs ``--loop-samples`` samples and is reported per sample. Features are written into one
preallocated (B, p) buffer (the streaming use: batches go to the feature store one at a time).

OpenMP: ``--omp-wait-policy passive|active`` sets ``OMP_WAIT_POLICY`` for the timed processes
(default: the environment's; recorded in the JSON). It matters on cores shared with other
processes and it does not shift all methods alike, so compare only runs with the same policy:
measured on the 2-core dev box, passive waiting cut the fused Linear gather under heavy load
(load 12) from 2,184 to 107 ms but slowed plain training at light load (4,710 → 2,834 samples/s)
while speeding up vmap (189 → 521 samples/s).

Allocator: ``--keep-freed-memory`` runs every timed process with glibc's ``MALLOC_MMAP_THRESHOLD_``
and ``MALLOC_TRIM_THRESHOLD_`` raised (256 MiB / 1 GiB), so freed activations and per-sample
gradients stay in the heap instead of going back to the kernel and being page-faulted in again on
the next batch. It does not shift all methods alike. Measured on the 2-core dev box (simplecnn,
p = 1e5, batch 256, 2 threads, best of 3-5 rounds): in session 3 it took vmap from 829 to 1,934
samples/s (its chunks then held 350 MB of per-sample gradients, mostly page faults), BackPACK
from 505 to 1,025 and Opacus from 620 to 859, with fused unchanged within noise. Since vmap's
chunks stay below glibc's reused-heap bound (``hpcfl.entk.reference.VMAP_BLOCK_BYTES``) it
barely moves vmap (session 4: 2,217 → 2,246); BackPACK 667 → 1,725, Opacus 797 → 1,097, fused
5,260 → 6,026, plain 9,308 → 11,125. Default: the environment's allocator settings (recorded in
the JSON).

Peak memory: CUDA ``torch.cuda.max_memory_allocated`` above the steady state; CPU the process's
peak resident set (``VmHWM`` of ``/proc/self/status``, reset through ``/proc/self/clear_refs``
after set-up and warm-up) minus the resident set at that point — i.e. the extra memory the
method needs on top of model, inputs and output. (``tracemalloc`` does not see torch's
allocations.) Where the reset is not permitted the figure is the peak minus the pre-run RSS.

``vmap`` runs in chunks of :func:`hpcfl.entk.reference.vmap_chunk`: cache-sized on the CPU (as
measured above), on a GPU the largest chunk that fits the stated budget (half the free memory);
its row notes the chunk. The "best other" method that fused is compared with is chosen per device
(:data:`BEST_OTHER`): on the CPU the fastest of vmap, Opacus and BackPACK; on a GPU the fastest
Opacus mode, named (issue 39: the fair GPU baseline; vmap's figure is still in the table).

Writes ``entk_bench.csv``, ``entk_bench.json`` and ``entk_bench.png`` into ``--out`` and prints a
table plus the acceptance ratios of issue #3.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HELP = "eNTK feature throughput: loop / vmap / fused / Opacus / BackPACK vs one training step"
MODELS = ("simplecnn", "mlp", "resnet18", "resnet8", "vgg11", "char-transformer", "char-lstm")
KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(256 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
"""glibc allocator settings of ``--keep-freed-memory``."""
METHODS = ("loop", "vmap", "fused", "fused-graph", "opacus", "opacus-functorch", "backpack")
DEFAULT_METHODS = {
    "cpu": "loop,vmap,fused,opacus,backpack",
    "cuda": "loop,vmap,fused,opacus,opacus-functorch,backpack",
}
"""``--methods`` when not given, per ``--device`` (the CPU's list as before issue 39)."""
FUSED_METHODS = {"fused": "fused", "fused-graph": "fused_graph"}
"""The fused methods an acceptance ratio is given for, and the prefix of their ratios' names."""
BEST_OTHER = {
    "cpu": ("vmap", "opacus", "opacus-functorch", "backpack"),
    "cuda": ("opacus", "opacus-functorch"),
}
"""Per device, the methods whose fastest is the "best other" that fused is compared with."""
OPACUS_MODES = {"opacus": "hooks", "opacus-functorch": "functorch"}
INPUT_SHAPES = {"simplecnn": (1, 28, 28), "mlp": (1, 28, 28)}
CIFAR_SHAPE = (3, 32, 32)


def input_shape(model: str) -> tuple[int, int, int]:
    """The input shape a model is timed on: Fashion-MNIST's, CIFAR's, or for a text model (``char-``)
    Shakespeare's ``(1, 1, L)`` with LEAF's sequence length L = 80."""
    from hpcfl.models import TEXT_MODELS

    if model in TEXT_MODELS:
        from hpcfl.data.shakespeare import SEQ_LEN

        return (1, 1, SEQ_LEN)
    return INPUT_SHAPES.get(model, CIFAR_SHAPE)


def bench_model(name: str, shape: tuple[int, ...], options: dict[str, Any]) -> Any:
    """Model ``name`` for inputs of ``shape``: 10 classes for images; a text model (``char-``) reads
    symbol codes of Shakespeare's 80-symbol vocabulary and gives logits over it."""
    from hpcfl.models import TEXT_MODELS, build_model

    if name in TEXT_MODELS:
        from hpcfl.data.shakespeare import VOCAB

        return build_model(name, shape, len(VOCAB), vocab_size=len(VOCAB), **options)
    return build_model(name, shape, 10, **options)


def model_and_batch(spec: dict[str, Any]) -> tuple[Any, Any]:
    """A spec's model (:func:`bench_model`, seeded with ``spec["seed"]``, on its device, eval mode) and
    a random batch of ``spec["batch"]`` inputs of ``spec["input_shape"]``: images, or for a text model
    symbol codes ``(B, L)`` (uint8, as the text datasets keep them)."""
    import torch

    from hpcfl.models import TEXT_MODELS

    torch.manual_seed(spec["seed"])
    shape = tuple(spec["input_shape"])
    device = torch.device(spec["device"])
    model = bench_model(spec["model"], shape, _model_options(spec)).to(device).eval()
    if spec["model"] in TEXT_MODELS:
        vocab = model.classifier.out_features
        return model, torch.randint(0, vocab, (spec["batch"], shape[-1]), dtype=torch.uint8, device=device)
    return model, torch.randn(spec["batch"], *shape, device=device)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hpcfl bench entk``."""
    parser.add_argument("--model", default="simplecnn", choices=MODELS)
    parser.add_argument("--p", type=int, default=100_000, help="kept eNTK coordinates (default 100000)")
    parser.add_argument("--batch", type=int, default=256, help="samples per batch (default 256)")
    parser.add_argument(
        "--methods",
        default=None,
        help="comma-separated subset of "
        + ",".join(METHODS)
        + " (default: cpu "
        + DEFAULT_METHODS["cpu"]
        + "; cuda "
        + DEFAULT_METHODS["cuda"]
        + ")",
    )
    parser.add_argument(
        "--norm",
        default=None,
        choices=("bn", "gn"),
        help="normalisation of resnet8/resnet18 (default: the model's, resnet8 bn, resnet18 gn; "
        "Opacus needs gn: it refuses BatchNorm)",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per method (default 5)")
    parser.add_argument("--loop-samples", type=int, default=16, help="samples timed for loop (default 16)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/entk"), help="output directory")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per method (0: torch default)")
    parser.add_argument("--seed", type=int, default=0, help="model / coordinate seed (default 0)")
    parser.add_argument(
        "--omp-wait-policy",
        default="default",
        choices=("default", "passive", "active"),
        help="OMP_WAIT_POLICY for the timed processes (default: leave the environment's)",
    )
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="raise glibc's mmap/trim thresholds in the timed processes (see the module docstring)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="time every method in this process instead of a fresh one per method and round: on a "
        "GPU it saves a CUDA start-up (~4 s) each; one method's allocations may then colour the next's",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds over all methods, best kept per method (default 3; evens out shared cores)",
    )


def parse_methods(text: str) -> list[str]:
    """Validate ``--methods``."""
    from hpcfl.errors import unknown

    methods = [m.strip() for m in text.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            raise unknown("benchmark method", m, METHODS)
    return methods


# --------------------------------------------------------------------------- worker side


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _gather_into(out: Any, grads: list[Any], columns: list[Any]) -> None:
    """Index per-parameter per-sample gradients (B, *shape) into the output columns."""
    for g, col in zip(grads, columns, strict=True):
        if col.n:
            out[:, col.col0 : col.col1].copy_(
                g.reshape(g.shape[0], -1).index_select(1, col.local.to(g.device))
            )


def _vmap_note(named: list[tuple[str, Any]], batch: int, device: Any) -> str:
    """The vmap row's note: the chunk :func:`~hpcfl.entk.reference.vmap_chunk` gives here, and why."""
    from hpcfl.entk.reference import vmap_chunk, vmap_memory_budget

    tensors = [t for _, t in named]
    budget = vmap_memory_budget(device)
    chunk = vmap_chunk(
        batch,
        sum(t.numel() for t in tensors),
        max((t.numel() * t.element_size() for t in tensors), default=1),
        max((t.element_size() for t in tensors), default=4),
        memory_budget=budget,
    )
    rule = "cache-sized" if budget is None else f"fits {budget / 2**20:,.0f} MiB, half the free memory"
    return f"chunk {chunk} of {batch} ({rule})"


def _make_runner(spec: dict[str, Any]) -> tuple[Callable[[], None], int, str, Any]:
    """(run once, samples per run, note, the (B, p) features it writes) for one method."""
    import torch

    from hpcfl.entk import entk_features
    from hpcfl.entk.coords import coordinate_set, param_columns, scope_parameters

    model, x = model_and_batch(spec)
    device = x.device
    batch, p, method = spec["batch"], spec["p"], spec["method"]
    named = scope_parameters(model, "all")
    columns = param_columns(named, coordinate_set(sum(t.numel() for _, t in named), p, spec["seed"]))
    out = torch.empty(batch, p, device=device)
    note = ""

    if method in ("vmap", "fused", "fused-graph"):
        if method == "vmap":
            note = _vmap_note(named, batch, device)
        graph = method == "fused-graph"

        def run() -> None:
            entk_features(
                model,
                x,
                p=p,
                seed=spec["seed"],
                method="fused" if graph else method,
                batch_size=batch,
                out=out,
                cuda_graph=graph,
            )

        if graph:
            note = _graph_setup(run, device)
        return run, batch, note, out
    if method == "loop":
        n = min(batch, spec["loop_samples"])
        xl, outl = x[:n], out[:n]

        def run() -> None:
            entk_features(model, xl, p=p, seed=spec["seed"], method="loop", out=outl)

        return run, n, note, outl
    if method == "plain":

        def run() -> None:
            model.zero_grad(set_to_none=True)
            model(x)[:, 0].sum().backward()

        return run, batch, "forward+backward, parameter gradients only", out
    if method in OPACUS_MODES:
        from opacus import GradSampleModule

        if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            raise RuntimeError("Opacus does not compute per-sample gradients through BatchNorm")
        mode = OPACUS_MODES[method]
        gsm = GradSampleModule(
            model, batch_first=True, loss_reduction="sum", force_functorch=mode == "functorch"
        )
        gsm.train()  # Opacus records activations in train mode only (same function: no BN/dropout)
        params = [t for _, t in named]

        def run() -> None:
            for t in params:
                t.grad_sample = None
                t.grad = None
            gsm(x)[:, 0].sum().backward()
            _gather_into(out, [t.grad_sample for t in params], columns)

        return run, batch, f"{mode}, train mode (no BN/dropout: same function)", out
    if method == "backpack":
        from backpack import backpack, extend
        from backpack.extensions import BatchGrad

        ext = extend(model)

        def run() -> None:
            ext.zero_grad(set_to_none=True)
            with backpack(BatchGrad()):
                ext(x)[:, 0].sum().backward()
            missing = [name for name, t in named if getattr(t, "grad_batch", None) is None]
            if missing:
                raise RuntimeError(
                    f"BackPACK BatchGrad gave no per-sample gradient for {len(missing)} parameters "
                    f"(first: {missing[0]}; a layer type it does not extend)"
                )
            _gather_into(out, [t.grad_batch for _, t in named], columns)

        return run, batch, note, out
    raise ValueError(method)


def _graph_setup(run: Callable[[], None], device: Any) -> str:
    """Run ``fused-graph``'s eager batch and its capture, so every timed batch replays → its note:
    the graph in use and the memory set-up reserved (the graph's private pool among it, held from
    then on, so outside the peak the worker measures), or the warning that turned it off."""
    import logging

    import torch

    class Keep(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    keep = Keep()
    logger = logging.getLogger("hpcfl.entk")
    logger.addHandler(keep)
    before = torch.cuda.memory_reserved(device)
    try:
        run()  # eager: compiles (and with HPCFL_TRITON_AUTOTUNE=1 tunes) the gathers for this shape
        run()  # captured, replayed once, checked against its eager result
    finally:
        logger.removeHandler(keep)
    if keep.lines:
        return f"CUDA graph OFF: {keep.lines[0]}"[:200]
    held = (torch.cuda.memory_reserved(device) - before) / 2**20
    return (
        f"CUDA graph replay (captured, checked in set-up; set-up reserved {held:,.0f} MiB, outside the peak)"
    )


def _model_options(spec: dict[str, Any]) -> dict[str, Any]:
    """``build_model`` options of a spec: ``norm`` where ``--norm`` was given, and any ``model_options``
    (a caller's own sizes, e.g. a tiny check's)."""
    return {**({"norm": spec["norm"]} if spec.get("norm") else {}), **spec.get("model_options", {})}


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Time one method in this (fresh) process → result row."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    row: dict[str, Any] = {"method": spec["method"], "threads": torch.get_num_threads()}
    try:
        run, samples, note, _ = _make_runner(spec)
    except (ImportError, RuntimeError, NotImplementedError, ValueError, TypeError) as err:
        row.update(status="skipped", note=f"{type(err).__name__}: {err}".splitlines()[0][:200])
        return row
    cuda = spec["device"] == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    try:
        run()  # warm-up (plans, caches, lazy init)
        sync()
    except Exception as err:  # noqa: BLE001 - a third-party method failing is a result, not a crash
        row.update(status="failed", note=f"{type(err).__name__}: {err}".splitlines()[0][:200])
        return row
    if cuda:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    reset = _reset_peak()
    base_kb = _rss_kb("VmRSS")
    times = []
    for _ in range(spec["repeats"]):
        t0 = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t0)
    if cuda:
        peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak_mb = max(0, _rss_kb("VmHWM") - base_kb) / 1024
    best, median = min(times), statistics.median(times)
    row.update(
        status="ok",
        samples=samples,
        seconds_best=best,
        seconds_median=median,
        samples_per_s=samples / best,
        samples_per_s_median=samples / median,
        peak_mb=peak_mb,
        peak_method="cuda max_memory_allocated" if cuda else ("VmHWM reset" if reset else "VmHWM - RSS"),
        note=note,
    )
    return row


def _run_here(spec: dict[str, Any]) -> dict[str, Any]:
    """:func:`_worker` in this process (``--in-process``); a failure is a row, as from a child, and
    what the method held is freed before the next one."""
    import gc

    import torch

    try:
        return _worker(spec)
    except Exception as err:  # noqa: BLE001 - a method failing is a result, not a crash
        note = f"{type(err).__module__}.{type(err).__name__}: {err}".splitlines()[0][:200]
        return {"method": spec["method"], "status": "failed", "note": note}
    finally:
        gc.collect()
        if spec["device"] == "cuda":
            torch.cuda.empty_cache()


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ)
    if spec["omp_wait_policy"] != "default":
        env["OMP_WAIT_POLICY"] = spec["omp_wait_policy"].upper()
    if spec["threads"]:
        env["OMP_NUM_THREADS"] = str(spec["threads"])
    if spec["keep_freed_memory"]:
        env.update(KEEP_FREED_MEMORY)
    proc = subprocess.run(
        [sys.executable, "-m", "hpcfl.bench.entk", "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"method": spec["method"], "status": "failed", "note": tail[:200]}


def time_method(spec: dict[str, Any], *, in_process: bool = False) -> dict[str, Any]:
    """One method timed as ``hpcfl bench entk`` times it → its result row (a failure is a row too):
    a warm-up, then ``spec["repeats"]`` timed runs (best and median), in a fresh process (its
    ``threads``, ``omp_wait_policy`` and ``keep_freed_memory`` environment) or, ``in_process``, here.
    ``spec`` holds :func:`run_benchmark`'s config keys (model, input_shape, p, batch, device, seed,
    repeats, loop_samples, threads, ...; optionally ``model_options``) and the ``method``."""
    return (_run_here if in_process else _run_child)(spec)


# --------------------------------------------------------------------------- report side


def best_other(rates: dict[str, float], device: str) -> str | None:
    """The fastest of ``device``'s :data:`BEST_OTHER` methods among ``rates`` (samples/s of the
    methods that ran), or None when none of them ran."""
    candidates = [m for m in BEST_OTHER[device] if m in rates]
    return max(candidates, key=lambda m: rates[m]) if candidates else None


def _acceptance(rows: dict[str, dict[str, Any]], device: str) -> dict[str, Any]:
    def rate(m: str) -> float | None:
        r = rows.get(m)
        return r["samples_per_s"] if r and r.get("status") == "ok" else None

    result: dict[str, Any] = {}
    rates = {m: r for m in rows if (r := rate(m))}
    best = best_other(rates, device)
    for method, prefix in FUSED_METHODS.items():
        fused = rate(method)
        if fused is None:
            continue
        if best is not None:
            result[f"{prefix}_vs_best_other"] = {
                "best": best,
                "among": [m for m in BEST_OTHER[device] if m in rates],
                "device": device,
                "ratio": fused / rates[best],
                "required": 5.0,
            }
        if rate("loop"):
            result[f"{prefix}_vs_loop"] = {"ratio": fused / rate("loop"), "required": 100.0}  # type: ignore[operator]
        if rate("plain"):
            result[f"{prefix}_vs_plain"] = {"ratio": fused / rate("plain"), "required": 0.25}  # type: ignore[operator]
    return result


def _best_other_label(item: dict[str, Any], rows: dict[str, dict[str, Any]]) -> str:
    """``best other on cuda: opacus (hooks) of opacus, opacus-functorch``: the named winner, its mode."""
    best = item["best"]
    mode = f" ({OPACUS_MODES[best]})" if best in OPACUS_MODES else ""
    return f"best other on {item['device']}: {best}{mode} of {', '.join(item['among'])}"


def _table(rows: list[dict[str, Any]], plain: float | None) -> str:
    head = f"{'method':<9} {'samples/s':>10} {'median/s':>10} {'ms/batch':>9} {'peak MB':>8} {'x plain':>8}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"{r['method']:<9} {r.get('status', '?'):>10}  {r.get('note', '')}")
            continue
        ratio = f"{r['samples_per_s'] / plain:8.3f}" if plain else f"{'-':>8}"
        ms = 1000 * r["seconds_best"] / r["samples"] * (r["samples"] if r["method"] != "loop" else 1)
        lines.append(
            f"{r['method']:<9} {r['samples_per_s']:10.1f} {r['samples_per_s_median']:10.1f} "
            f"{ms:9.1f} {r['peak_mb']:8.1f} {ratio}  {r.get('note', '')}"
        )
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], config: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hpcfl.files import save_figure

    ok = [r for r in rows if r.get("status") == "ok"]
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r["method"] for r in ok]
    rates = [r["samples_per_s"] for r in ok]
    colors = [
        "tab:green" if n in FUSED_METHODS else ("tab:gray" if n == "plain" else "tab:blue") for n in names
    ]
    bars = ax.bar(names, rates, color=colors)
    ax.set_yscale("log")
    ax.set_ylabel("samples / s (log)")
    ax.set_title(
        f"eNTK features: {config['model']}, p={config['p']:,}, batch {config['batch']}, "
        f"{config['device']}, {config['threads'] or 'default'} threads"
    )
    for bar, r in zip(bars, ok, strict=True):
        ax.annotate(
            f"{r['samples_per_s']:.0f}",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
        )
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run every method (plus ``plain``) in its own subprocess, write CSV/JSON/PNG, print a table."""
    from hpcfl.entk import costs
    from hpcfl.errors import ConfigError
    from hpcfl.files import atomic_write_text

    methods = parse_methods(args.methods or DEFAULT_METHODS[args.device])
    if "fused-graph" in methods and args.device != "cuda":
        raise ConfigError(
            "--methods fused-graph needs --device cuda (a CUDA graph is a no-op on the CPU, where it is fused)"
        )
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda, but torch sees no CUDA device here; use --device cpu")
    if min(args.p, args.batch, args.repeats, args.loop_samples, args.rounds) < 1:
        raise ConfigError("--p, --batch, --repeats, --loop-samples and --rounds must be positive")
    shape = input_shape(args.model)
    if args.norm and args.model not in ("resnet8", "resnet18"):
        raise ConfigError(f"--norm applies to resnet8 and resnet18, not {args.model}")
    from hpcfl.entk import num_params

    total = num_params(bench_model(args.model, shape, {"norm": args.norm} if args.norm else {}))
    if args.in_process and (args.keep_freed_memory or args.omp_wait_policy != "default"):
        raise ConfigError(
            "--keep-freed-memory and --omp-wait-policy set a fresh process's environment: not with --in-process"
        )
    p = min(args.p, total)
    if p < args.p:
        print(
            f"--p {args.p} is more than {args.model}'s {total:,} parameters: every coordinate kept (p = {total:,})"
        )
    config = {
        "model": args.model,
        "norm": args.norm,
        "input_shape": list(shape),
        "p": p,
        "p_requested": args.p,
        "batch": args.batch,
        "device": args.device,
        "repeats": args.repeats,
        "loop_samples": args.loop_samples,
        "threads": args.threads,
        "seed": args.seed,
        "rounds": args.rounds,
        "omp_wait_policy": args.omp_wait_policy
        if args.omp_wait_policy != "default"
        else os.environ.get("OMP_WAIT_POLICY", "default"),
        "keep_freed_memory": bool(args.keep_freed_memory),
        "in_process": bool(args.in_process),
        "malloc_env": {k: os.environ[k] for k in KEEP_FREED_MEMORY if k in os.environ},
        "layer_form_costs": {
            "constants": costs.constants(args.device),
            "from": os.environ.get(costs.COSTS_ENV),
        },
    }
    best: dict[str, dict[str, Any]] = {}
    per_round: list[dict[str, Any]] = []
    for round_ in range(args.rounds):  # interleaved, so a busy spell on shared cores hits all methods
        this_round: dict[str, dict[str, Any]] = {}
        for method in ["plain", *methods]:
            row = (_run_here if args.in_process else _run_child)({**config, "method": method})
            this_round[method] = row
            kept = best.get(method)
            if kept is None or (
                row.get("status") == "ok" and row["samples_per_s"] > kept.get("samples_per_s", 0)
            ):
                if kept is not None and kept.get("status") == "ok":
                    row["peak_mb"] = max(row["peak_mb"], kept["peak_mb"])
                best[method] = row
            elif row.get("status") == "ok":
                kept["peak_mb"] = max(row["peak_mb"], kept["peak_mb"])
            ok = row.get("status") == "ok"
            status = (
                f"{row['samples_per_s']:.1f} samples/s"
                if ok
                else f"{row.get('status')}: {row.get('note', '')}"
            )
            print(f"  round {round_ + 1} {method:<9} {status}", flush=True)
        per_round.append({name: item["ratio"] for name, item in _acceptance(this_round, args.device).items()})
    rows = [best[m] for m in ["plain", *methods]]
    by_method = {r["method"]: r for r in rows}
    plain = by_method["plain"]["samples_per_s"] if by_method["plain"].get("status") == "ok" else None
    acceptance = _acceptance(by_method, args.device)
    for name, item in acceptance.items():
        item["per_round"] = [r[name] for r in per_round if name in r]
        item["median_of_rounds"] = statistics.median(item["per_round"])
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"config": config, "command": " ".join(sys.argv), "results": rows, "acceptance": acceptance}
    atomic_write_text(args.out / "entk_bench.json", json.dumps(report, indent=2))
    fields = [
        "method",
        "status",
        "samples",
        "samples_per_s",
        "samples_per_s_median",
        "seconds_best",
        "peak_mb",
        "threads",
        "note",
    ]
    table = io.StringIO()
    writer = csv.DictWriter(table, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(args.out / "entk_bench.csv", table.getvalue())
    _plot(rows, config, args.out / "entk_bench.png")
    print(_table(rows, plain))
    for name, item in acceptance.items():
        extra = f" ({_best_other_label(item, by_method)})" if "best" in item else ""
        verdict = "ok" if item["ratio"] >= item["required"] else "BELOW"
        rounds = ", ".join(f"{r:.2f}" for r in item["per_round"])
        print(
            f"{name}: {item['ratio']:.2f}x, required >= {item['required']}x{extra} [{verdict}]; "
            f"per round {rounds} (median {item['median_of_rounds']:.2f}x)"
        )
    print(f"wrote {args.out}/entk_bench.{{csv,json,png}}")
    return report


def run_cli(args: argparse.Namespace) -> int:
    """``hpcfl bench entk`` entry point."""
    run_benchmark(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m hpcfl.bench.entk`` / ``benchmarks/entk_throughput.py``)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        print(json.dumps(_worker(json.loads(argv[1]))), flush=True)
        return 0
    parser = argparse.ArgumentParser(prog="entk_throughput", description=HELP)
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
