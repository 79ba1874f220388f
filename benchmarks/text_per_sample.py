"""Per-sample work on the text models (issue 53, item 4): hpcfl's eNTK features and DP-SGD step on
``char-transformer`` and ``char-lstm`` against ``torch.func`` and Opacus, in ONE run.

    python benchmarks/text_per_sample.py [--device cuda] [--out DIR]   # alone: it is a timing
    python benchmarks/text_per_sample.py --tiny --out /tmp/tps          # end-to-end check, < 1 min

Both parts run LEAF's batch size 10 and a larger one (``--batches``, default 10 64) of Shakespeare-
shaped input: symbol codes (B, L = 80) over its 80-symbol vocabulary, random (seed 0), the models at
their defaults (char-lstm 819,920 parameters, char-transformer 115,536).

1. ``entk`` — eNTK features (the gradient of logit 0 at the p = ``--p`` coordinates of
   :func:`hpcfl.entk.coords.coordinate_set`, the model in eval mode), samples/s of
   - ``hpcfl``: ``entk_features(method="fused")``. char-transformer: the fused path (one batched
     forward + backward; Embedding, LayerNorm, attention's and the MLP's Linears on sequences).
     char-lstm: the fused path does not cover LSTM and falls back to its per-sample loop (one line);
   - ``torch.func``: ``entk_features(method="vmap")``, hpcfl's reference: ``vmap(grad(f))`` over
     ``functional_call`` in chunks, then the same coordinates indexed per parameter into the same
     (B, p) output, so it is the same work. On ``nn.LSTM`` vmap has no batching rule for the RNN
     kernel (``aten::mkldnn_rnn_layer`` on the CPU) and PyTorch loops over the samples inside vmap;
   - ``plain``: one batched forward + backward of Σ_b logit 0 (parameter gradients only): the limit.
   Each method is timed as ``hpcfl bench entk`` times its own (:func:`hpcfl.bench.entk.time_method`:
   a fresh process per method and round, or ``--in-process``; a warm-up, then ``--repeats`` runs),
   the methods interleaved in ``--rounds`` rounds; per method the median over rounds of each round's
   median, and the ratio hpcfl/torch.func also per round (its median given).
2. ``dp`` — one full sample-level DP-SGD step (per-sample gradients, clip C = 1, sum, noise σ = 1,
   SGD update) timed by ``benchmarks/privacy.py``'s machinery (:func:`privacy.throughput`: one worker
   process per mode, the modes' steps interleaved in 10 rounds, ``--sessions`` sets of fresh workers,
   the median over all rounds) for ``nonprivate`` (hpcfl's plain step), ``hpcfl`` (book-keeping
   clipping for char-transformer; char-lstm: a per-sample loop, vmap cannot batch the LSTM),
   ``opacus_hooks`` (``GradSampleModule`` + ``DPOptimizer``) and ``opacus_ghost`` (ghost clipping:
   ``GradSampleModuleFastGradientClipping(use_ghost_clipping=True)`` +
   ``DPOptimizerFastGradientClipping`` + ``DPLossFastGradientClipping``, its fastest documented
   mode), with the ratios hpcfl/Opacus (each mode, and the faster one, named) and hpcfl/non-private.

What Opacus needs (:func:`opacus_model`, applied in both Opacus modes): char-transformer as it is —
its attention is two ``nn.Linear`` layers (``qkv``, ``proj``) and a written-out softmax, no
``nn.MultiheadAttention``, so no ``opacus.layers.DPMultiheadAttention`` — except that ghost
clipping's Embedding norm sampler ``view``s its index input and fails on the position embedding's
expanded (stride-0) index: a forward pre-hook hands every Embedding a contiguous copy (same values).
char-lstm: Opacus has no per-sample gradient for ``nn.LSTM``; ``opacus.layers.DPLSTM`` (its cells
made of ``RNNLinear`` layers, nn.LSTM's parameter names) takes its place with the weights copied.

Same work: before any timing, per model, on one batch of the largest size: hpcfl's per-sample
gradient norms equal those of Opacus's per-sample gradients (hooks), hpcfl's clipped per-sample
gradient sum (at C = the median norm, so some samples are clipped) equals each Opacus mode's (σ = 0:
the optimiser's clipped sum), and hpcfl's eNTK features equal torch.func's (4 samples); otherwise
one line and exit 1.

Load: the figures are only as good as the host was quiet; the load average at the start and the
end is printed beside them and recorded (run it alone). Results: ``<out>/text_per_sample_<device>.
{json,csv,md,png}`` (default ``--out benchmarks/results``); the CSV has a row per part, model,
batch and method with its samples/s and hpcfl's samples/s over it.
"""

from __future__ import annotations

import argparse
import copy
import csv
import io
import json
import os
import re
import statistics
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import privacy  # benchmarks/privacy.py: the DP-SGD throughput machinery (workers, interleaving, medians)
import torch
from torch import nn

from hpcfl.bench.entk import model_and_batch, time_method
from hpcfl.bench.machine import csv_with_machine, with_machine
from hpcfl.data.shakespeare import SEQ_LEN, VOCAB

MODELS = ("char-transformer", "char-lstm")
PARTS = ("entk", "dp")
ENTK_METHODS = {"plain": "plain", "fused": "hpcfl", "vmap": "torch.func"}
"""hpcfl.bench.entk's method → its name here."""
DP_MODES = {"nonprivate": "non-private", "hpcfl": "hpcfl", "opacus_hooks": "Opacus hooks",
            "opacus_ghost": "Opacus ghost"}  # fmt: skip
TINY_OPTIONS = {
    "char-lstm": {"embed": 4, "hidden": 16, "layers": 2},
    "char-transformer": {"d_model": 16, "layers": 1, "heads": 2},
}
"""``--tiny``'s model sizes (the same layer types, a few thousand parameters)."""
CLOSE = 1e-4
"""Largest |difference| / max |reference| accepted as the same result (float32)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out",
        type=Path,
        help="output directory (default benchmarks/results; with --tiny bench-out/text_per_sample_tiny, "
        "so a check never overwrites the committed figures)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU, timed to a sync")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--batches", nargs="+", type=int, default=[10, 64], help="LEAF's 10 and a larger one")
    p.add_argument("--seq-len", type=int, default=SEQ_LEN, help=f"symbols per sample (LEAF's {SEQ_LEN})")
    p.add_argument("--p", type=int, default=100_000, help="eNTK coordinates kept (at most the model's P)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="entk: interleaved rounds over the methods")
    p.add_argument("--repeats", type=int, default=5, help="entk: timed runs per method and round")
    p.add_argument("--steps", type=int, default=20, help="dp: timed steps per mode, in 10 interleaved rounds")
    p.add_argument("--sessions", type=int, default=2, help="dp: sets of fresh worker processes")
    p.add_argument(
        "--allocator",
        choices=privacy.ALLOCATORS,
        default="default",
        help="glibc malloc of every timed process: as processes get it, or keeping freed memory "
        "(hpcfl.bench.entk.KEEP_FREED_MEMORY; see benchmarks/privacy.py)",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="entk: time the methods in this process (on a GPU it saves a CUDA start-up per method and "
        "round; not with --allocator keep-freed, which sets a fresh process's environment)",
    )
    p.add_argument(
        "--tiny", action="store_true", help="an end-to-end check in < 1 minute (meaningless numbers)"
    )
    args = p.parse_args(argv)
    for name in ("seq_len", "p", "threads", "rounds", "repeats", "steps", "sessions"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.batches) < 1:
        p.error(f"--batches must be >= 1, got {min(args.batches)}")
    if args.in_process and args.allocator != "default":
        p.error("--in-process times in this process, whose malloc is set: not with --allocator keep-freed")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no CUDA device here; use --device cpu")
    args.options = {}
    if args.tiny:
        args.seq_len, args.batches, args.p, args.rounds, args.repeats = 12, [4], 200, 1, 2
        args.steps, args.sessions, args.in_process = 2, 1, args.allocator == "default"
        args.options = TINY_OPTIONS
    if args.out is None:
        args.out = Path("bench-out/text_per_sample_tiny" if args.tiny else "benchmarks/results")
    return args


# -- the models ------------------------------------------------------------------------------------


def opacus_model(model: nn.Module) -> nn.Module:
    """A copy of ``model`` that Opacus can take (see the module docstring): every ``nn.LSTM`` replaced
    by an ``opacus.layers.DPLSTM`` with its weights, every Embedding's index made contiguous."""
    from opacus.layers import DPLSTM

    model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.LSTM):
                if child.bidirectional or child.proj_size or not child.batch_first:
                    raise NotImplementedError(f"{name}: only a batch-first, one-way LSTM is copied")
                dp = DPLSTM(child.input_size, child.hidden_size, num_layers=child.num_layers,
                            bias=child.bias, batch_first=True, dropout=child.dropout)  # fmt: skip
                dp.load_state_dict(child.state_dict())  # DPLSTM keeps nn.LSTM's parameter names
                setattr(parent, name, dp.to(next(child.parameters()).device))
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            module.register_forward_pre_hook(lambda _, args: (args[0].contiguous(), *args[1:]))
    return model


@dataclass(frozen=True)
class TextWorkload:
    """:data:`privacy.Workload` of the text models: model ``name`` (seed 0, train mode; for Opacus its
    :func:`opacus_model` copy), a batch of random symbol codes (B, ``seq_len``) and next-symbol
    targets (seed 1). Picklable: ``spawn`` sends it to the workers."""

    seq_len: int
    options: dict[str, dict[str, int]] = field(default_factory=dict)

    def spec(self, name: str, batch: int, device: str) -> dict[str, Any]:
        """The :mod:`hpcfl.bench.entk` spec of this model and batch (``model_and_batch`` builds it)."""
        return {"model": name, "input_shape": [1, 1, self.seq_len], "seed": 0, "device": device,
                "batch": batch, "model_options": self.options.get(name, {})}  # fmt: skip

    def __call__(
        self, name: str, batch: int, device: str, for_opacus: bool
    ) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
        model, x = model_and_batch(self.spec(name, batch, device))
        model.train()  # a training step (no dropout nor BatchNorm: the same function as eval mode)
        torch.manual_seed(1)
        y = torch.randint(0, len(VOCAB), (batch,)).to(device)
        return (opacus_model(model) if for_opacus else model), x, y


# -- same work -------------------------------------------------------------------------------------


def _differs(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max |got − expected| / max |expected|."""
    return float((got - expected).abs().max() / expected.abs().max().clamp(min=1e-30))


def _logged_fused(model: nn.Module, x: torch.Tensor, p: int) -> tuple[torch.Tensor, str]:
    """hpcfl's eNTK features of ``x`` (``method="fused"``) and the path they took: ``fused``, or the
    fallback that the ``hpcfl.entk`` logger named."""
    import logging

    from hpcfl.entk import entk_features

    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("hpcfl.entk")
    logger.addHandler(handler)
    try:
        features = entk_features(model, x, p=p, seed=0, method="fused")
    finally:
        logger.removeHandler(handler)
    if not lines:
        return features, "fused"
    found = re.search(r"does not support (.+?) layers .*; computing with (an? )?(.+?) \(", lines[0])
    return features, f"{found[3]}: no fused {found[1]}" if found else lines[0][:120]


def check_same_work(
    workload: TextWorkload, name: str, batch: int, device: str, parts: list[str]
) -> dict[str, Any]:
    """``differences``: per baseline, the largest relative difference between hpcfl's result and its
    own on one batch (see the module docstring), and ``entk_path``: the path hpcfl's eNTK features
    took (:func:`_logged_fused`). Raises SystemExit (one line) above :data:`CLOSE`."""
    from opacus import GradSampleModule
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    from hpcfl.entk import entk_features, num_params
    from hpcfl.privacy.sgd import clipped_grad_sum
    from hpcfl.training.sgd import cross_entropy_loss

    found: dict[str, float] = {}
    path = ""
    if "dp" in parts:
        model, x, y = workload(name, batch, device, False)
        out = torch.empty(sum(t.numel() for t in model.parameters()), device=device)
        _, norms = clipped_grad_sum(model, cross_entropy_loss, x, y, 1.0, out)
        clip = float(norms.median())  # some samples clipped, some not
        _, norms = clipped_grad_sum(model, cross_entropy_loss, x, y, clip, out)
        ours = dict(zip([n for n, _ in model.named_parameters()],
                        out.split([t.numel() for t in model.parameters()]), strict=True))  # fmt: skip
        for mode in ("opacus_hooks", "opacus_ghost"):
            theirs, _, _ = workload(name, batch, device, True)
            sgd = torch.optim.SGD(theirs.parameters(), lr=0.0)
            if mode == "opacus_hooks":
                hooked = GradSampleModule(theirs)
                opt = DPOptimizer(sgd, noise_multiplier=0.0, max_grad_norm=clip, expected_batch_size=batch)
                opt.zero_grad()
                nn.functional.cross_entropy(hooked(x), y).backward()
                # grad_sample: each sample's gradient of its own loss (Opacus undoes the mean)
                each = torch.stack([t.grad_sample.flatten(1).norm(dim=1) for t in theirs.parameters()])
                found["dp_opacus_hooks_norms"] = _differs(norms, each.norm(dim=0))
            else:
                ghost = GradSampleModuleFastGradientClipping(
                    theirs, max_grad_norm=clip, use_ghost_clipping=True
                )
                opt = DPOptimizerFastGradientClipping(
                    sgd, noise_multiplier=0.0, max_grad_norm=clip, expected_batch_size=batch
                )
                opt.zero_grad()
                DPLossFastGradientClipping(ghost, opt, nn.CrossEntropyLoss())(ghost(x), y).backward()
            opt.pre_step()  # clip, sum, noise (σ = 0), ÷ expected batch size: the step's gradient
            grads = {n: t.grad.flatten() * batch for n, t in theirs.named_parameters()}
            found[f"dp_{mode}"] = max(_differs(ours[n], grads[n]) for n in ours)
    if "entk" in parts:
        model, x = model_and_batch(workload.spec(name, min(batch, 4), device))
        p = min(1000, num_params(model))
        try:
            fused, path = _logged_fused(model, x, p)
            found["entk_torch.func"] = _differs(fused, entk_features(model, x, p=p, seed=0, method="vmap"))
        except RuntimeError as err:  # e.g. cuDNN's LSTM backward refuses eval mode: the timing rows say so
            path = f"failed: {err}".splitlines()[0][:160]
    for what, diff in found.items():
        if not diff <= CLOSE:
            raise SystemExit(f"{name}: hpcfl and {what.split('_', 1)[1]} do not do the same work "
                             f"({what}: max difference {diff:.2e} of the largest value, above {CLOSE:g})")  # fmt: skip
    return {"differences": found, "entk_path": path}


# -- 1. eNTK features ------------------------------------------------------------------------------


def entk_part(
    args: argparse.Namespace, workload: TextWorkload, name: str, batch: int, path: str
) -> dict[str, Any]:
    """Samples/s of each of :data:`ENTK_METHODS` (median over rounds of each round's median), hpcfl's
    ``path`` (:func:`check_same_work`'s), and hpcfl/torch.func and hpcfl/plain (of the medians;
    hpcfl/torch.func also per round)."""
    from hpcfl.entk import num_params

    spec = workload.spec(name, batch, args.device)
    model, _ = model_and_batch({**spec, "device": "cpu", "batch": 1})
    total = num_params(model)
    p = min(args.p, total)
    spec.update(p=p, repeats=args.repeats, loop_samples=batch, threads=args.threads,
                omp_wait_policy="default", keep_freed_memory=args.allocator == "keep-freed")  # fmt: skip
    per_round: dict[str, list[float]] = {m: [] for m in ENTK_METHODS}
    notes: dict[str, str] = {}
    for _ in range(args.rounds):
        for method in ENTK_METHODS:
            row = time_method({**spec, "method": method}, in_process=args.in_process)
            if row.get("status") != "ok":
                notes[method] = f"{row.get('status')}: {row.get('note', '')}"
                continue
            per_round[method].append(row["samples"] / row["seconds_median"])
            notes.setdefault(method, row.get("note", ""))
            print(f"  entk {name} B={batch} {ENTK_METHODS[method]}: {per_round[method][-1]:.1f} samples/s",
                  flush=True)  # fmt: skip
    rates = {ENTK_METHODS[m]: statistics.median(v) for m, v in per_round.items() if v}
    result: dict[str, Any] = {"params": total, "p": p, "hpcfl_path": path, "samples_per_s": rates,
                              "notes": {ENTK_METHODS[m]: n for m, n in notes.items() if n}}  # fmt: skip
    if "hpcfl" in rates and "torch.func" in rates:
        ratios = [a / b for a, b in zip(per_round["fused"], per_round["vmap"], strict=False)]
        result["hpcfl_vs_torch_func"] = rates["hpcfl"] / rates["torch.func"]
        result["hpcfl_vs_torch_func_per_round"] = ratios
        result["hpcfl_vs_torch_func_median_of_rounds"] = statistics.median(ratios)
    if "hpcfl" in rates and "plain" in rates:
        result["hpcfl_vs_plain"] = rates["hpcfl"] / rates["plain"]
    return result


# -- 2. DP-SGD step --------------------------------------------------------------------------------


def dp_part(args: argparse.Namespace, workload: TextWorkload, name: str, batch: int) -> dict[str, Any]:
    """:func:`privacy.throughput` on the text workload, with hpcfl's per-sample path named."""
    from hpcfl.privacy import ghost

    model, _, _ = workload(name, 1, "cpu", False)
    uncovered = ghost.unsupported_layers(model)
    path = (
        f"per-sample loop (book-keeping does not cover {', '.join(uncovered)})"
        if uncovered
        else "book-keeping"
    )
    try:
        row = privacy.throughput(name, batch, args.steps, args.threads, sessions=args.sessions,
                                 allocator=args.allocator, device=args.device, workload=workload)  # fmt: skip
    except Exception as err:  # noqa: BLE001 - a mode failing in its worker is a result, not a crash
        return {"hpcfl_path": path, "status": "failed", "note": f"{type(err).__name__}: {err}"[:200]}
    return {"hpcfl_path": path, "status": "ok", **row}


# -- report ----------------------------------------------------------------------------------------


def _load() -> float:
    return os.getloadavg()[0]


def _rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The CSV's rows: one per part, model, batch and method (samples/s; hpcfl's over it)."""
    rows = []
    for key, r in results.get("entk", {}).items():
        name, batch = key.rsplit("@", 1)
        for method, rate in r["samples_per_s"].items():
            hpcfl = r["samples_per_s"].get("hpcfl")
            rows.append({"part": "entk", "model": name, "batch": int(batch), "method": method,
                         "samples_per_s": rate, "hpcfl_over_this": hpcfl / rate if hpcfl else "",
                         "note": r["hpcfl_path"] if method == "hpcfl" else r["notes"].get(method, "")})  # fmt: skip
    for key, r in results.get("dp", {}).items():
        name, batch = key.rsplit("@", 1)
        if r["status"] != "ok":
            rows.append({"part": "dp", "model": name, "batch": int(batch), "method": "all",
                         "samples_per_s": "", "hpcfl_over_this": "", "note": r["note"]})  # fmt: skip
            continue
        for mode, label in DP_MODES.items():
            rate = r[f"{mode}_samples_per_s"]
            note = (
                r["hpcfl_path"]
                if mode == "hpcfl"
                else ("faster Opacus mode" if mode == r["opacus_fastest"] else "")
            )
            rows.append({"part": "dp", "model": name, "batch": int(batch), "method": label, "samples_per_s": rate,
                         "hpcfl_over_this": r["hpcfl_samples_per_s"] / rate, "note": note})  # fmt: skip
    return rows


def _table(results: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines = []
    if results.get("entk"):
        lines += [f"## eNTK features, samples/s ({args.device}, {args.threads} threads, median of {args.rounds} "
                  f"rounds × {args.repeats} runs)", "",
                  "| model | batch | p of P | hpcfl's path | hpcfl | torch.func (vmap) | plain fwd+bwd | "
                  "hpcfl/torch.func (median of rounds) | hpcfl/plain |",
                  "|---|---:|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for key, r in results["entk"].items():
            name, batch = key.rsplit("@", 1)
            s = r["samples_per_s"]

            def f(m: str, s: dict = s) -> str:
                return f"{s[m]:.1f}" if m in s else "failed"

            ratio = (f"**{r['hpcfl_vs_torch_func']:.2f}×** ({r['hpcfl_vs_torch_func_median_of_rounds']:.2f}×)"
                     if "hpcfl_vs_torch_func" in r else "—")  # fmt: skip
            plain = f"{r['hpcfl_vs_plain']:.2f}×" if "hpcfl_vs_plain" in r else "—"
            lines.append(f"| {name} | {batch} | {r['p']:,} of {r['params']:,} | {r['hpcfl_path']} | {f('hpcfl')} "
                         f"| {f('torch.func')} | {f('plain')} | {ratio} | {plain} |")  # fmt: skip
        lines += [f"- {k} {m}: {n}" for k, r in results["entk"].items() for m, n in r["notes"].items()]
        lines.append("")
    if results.get("dp"):
        lines += [f"## DP-SGD step, samples/s ({args.device}, {args.threads} threads, {args.allocator} malloc, "
                  f"{args.sessions} sessions × {args.steps} steps)", "",
                  "| model | batch | hpcfl's path | non-private | hpcfl DP-SGD | Opacus hooks | Opacus ghost "
                  "| hpcfl/hooks | hpcfl/ghost | hpcfl/faster Opacus | hpcfl/non-private |",
                  "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for key, r in results["dp"].items():
            name, batch = key.rsplit("@", 1)
            if r["status"] != "ok":
                lines.append(f"| {name} | {batch} | {r['hpcfl_path']} | failed: {r['note']} |")
                continue
            rates = " | ".join(f"{r[f'{m}_samples_per_s']:.1f}" for m in DP_MODES)
            fastest = DP_MODES[r["opacus_fastest"]]
            lines.append(f"| {name} | {batch} | {r['hpcfl_path']} | {rates} | {r['hpcfl_vs_opacus_hooks']:.2f}× "
                         f"| {r['hpcfl_vs_opacus_ghost']:.2f}× | **{r['hpcfl_vs_opacus_fastest']:.2f}×** ({fastest}) "
                         f"| {r['hpcfl_vs_nonprivate']:.2f}× |")  # fmt: skip
        lines.append("")
    return lines


def _plot(results: dict[str, Any], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hpcfl.files import save_figure

    parts = [p for p in PARTS if results.get(p)]
    fig, axes = plt.subplots(1, len(parts), figsize=(6.5 * len(parts), 4.2), squeeze=False)
    for ax, part in zip(axes[0], parts, strict=True):
        groups = list(results[part])
        methods = list(ENTK_METHODS.values()) if part == "entk" else list(DP_MODES)
        width = 0.8 / len(methods)
        for i, method in enumerate(methods):
            if part == "entk":
                ys = [results[part][g]["samples_per_s"].get(method, 0.0) for g in groups]
                label = method
            else:
                ys = [results[part][g].get(f"{method}_samples_per_s", 0.0) for g in groups]
                label = DP_MODES[method]
            ax.bar(
                [k + (i - (len(methods) - 1) / 2) * width for k in range(len(groups))], ys, width, label=label
            )
        ax.set_xticks(range(len(groups)), [g.replace("@", "\nB=") for g in groups])
        ax.set_yscale("log")
        ax.set_ylabel("samples / s (log)")
        ax.set_title("eNTK features" if part == "entk" else "DP-SGD step (σ = 1, C = 1)")
        ax.legend(fontsize=8)
    fig.suptitle(f"text models, L = {args.seq_len}, {args.device}, {args.threads} threads"
                 + (" — TINY: meaningless numbers" if args.tiny else ""), fontsize=9)  # fmt: skip
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    from hpcfl.files import atomic_write_text

    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="There is a performance drop")  # vmap's LSTM loop (docstring)
    warnings.filterwarnings("ignore", message="Full backward hook")
    torch.set_num_threads(args.threads)
    workload = TextWorkload(args.seq_len, args.options)
    load_start = _load()
    print(f"load average {load_start:.2f} on {os.cpu_count()} cores at the start", flush=True)
    checks = {name: check_same_work(workload, name, max(args.batches), args.device, args.parts)
              for name in args.models}  # fmt: skip
    for name, found in checks.items():
        differences = ", ".join(f"{k} {v:.1e}" for k, v in found["differences"].items())
        print(f"same work, {name} (max relative difference): {differences}", flush=True)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "same_work": checks}
    cases = [(name, batch) for name in args.models for batch in args.batches]
    if "entk" in args.parts:
        results["entk"] = {f"{name}@{batch}": entk_part(args, workload, name, batch, checks[name]["entk_path"])
                           for name, batch in cases}  # fmt: skip
    if "dp" in args.parts:
        results["dp"] = {f"{name}@{batch}": dp_part(args, workload, name, batch) for name, batch in cases}
    load_end = _load()
    results["load"] = {"start": load_start, "end": load_end, "cores": os.cpu_count()}
    caveat = (f"Load average {load_start:.2f} at the start, {load_end:.2f} at the end, on {os.cpu_count()} cores: "
              "these figures hold only if nothing else ran (run it alone; a load above the cores used "
              "means other processes shared them, and the ratios then compare busy spells).")  # fmt: skip
    if args.tiny:
        caveat += " TINY run: sizes shrunk, numbers meaningless."
    text = "\n".join(["# Per-sample work on the text models", "", caveat, "", *_table(results, args)])
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"text_per_sample_{args.device}"
    atomic_write_text(stem.with_suffix(".json"), json.dumps(with_machine(results), indent=1))
    buf = io.StringIO()
    writer = csv.DictWriter(
        buf, ["part", "model", "batch", "method", "samples_per_s", "hpcfl_over_this", "note"]
    )
    writer.writeheader()
    writer.writerows(_rows(results))
    atomic_write_text(stem.with_suffix(".csv"), csv_with_machine(buf.getvalue()))
    atomic_write_text(stem.with_suffix(".md"), text)
    _plot(results, args, stem.with_suffix(".png"))
    print(text)
    print(f"wrote {stem}.{{json,csv,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
