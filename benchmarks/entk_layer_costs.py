"""Time each form of every Linear/Conv2d weight of the fused eNTK path, layer by layer, and fit the
per-layer cost model's constants (hpcfl/entk/costs.py) to the times.

For each ``--models`` (float32, eval mode, ``--batch`` random inputs, ``--p`` kept coordinates):
one forward + backward gives every layer's input and output gradient; then each weight not kept
whole is formed by the ``gather`` kernels and by ``materialise`` (one batched product, then a
pick), each timed alone (``triton.testing.do_bench`` on CUDA, median of its runs; a plain
perf_counter timer with a synchronize elsewhere). Whole fused batches follow with the model's own
choice (``auto``), the fitted constants' choice (``fitted``) and every layer forced to one form,
beside a plain forward+backward. The constants are then fitted by non-negative least squares on
relative error (:func:`hpcfl.entk.costs.fit_constants`) over all measured (layer, form) rows.

Where the native CPU kernel is usable (:mod:`hpcfl.entk.native`), each layer it takes gets a
``native`` row too (timed, outside the fit: the plan uses it wherever it is usable, whatever the
constants say), and the whole batches add a ``native`` policy; ``auto`` is then the plan's default
(native where usable), ``torch`` and ``fitted`` the cost model's choice with the kernel switched off.

Writes ``<out>/entk_layer_costs_<device>.csv`` (one row per layer × form: dims, counts, measured,
predicted by the current and by the fitted constants) and ``.json`` (rows, whole-batch times, the
current and fitted constants, how often each model picks the faster form), after every model so a
run cut short keeps what it measured; prints the fitted constants as the dict to paste into
``CUDA_COSTS``.

    python benchmarks/entk_layer_costs.py --device cuda                  # the GPU fit (batch 256, p = 1e5)
    python benchmarks/entk_layer_costs.py --device cpu --models simplecnn --batch 4 --p 2000 --runs 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

SHAPES = {"simplecnn": (1, 28, 28), "mlp": (1, 28, 28), "resnet8": (3, 32, 32), "resnet18": (3, 32, 32),
          "vgg11": (3, 32, 32)}  # fmt: skip
OPTIONS = {"resnet8": {"norm": "gn"}, "resnet18": {"norm": "gn"}, "vgg11": {"batch_norm": False}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--models", nargs="+", choices=list(SHAPES), default=["simplecnn", "resnet8", "resnet18", "vgg11"]
    )
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--p", type=int, default=100_000, help="kept eNTK coordinates (at most each model's P)")
    p.add_argument("--runs", type=int, default=10, help="timed runs per measurement off CUDA")
    p.add_argument(
        "--rep-ms", type=float, default=40.0, help="do_bench's timing window per measurement (CUDA)"
    )
    p.add_argument("--no-batches", action="store_true", help="skip the whole fused batches")
    p.add_argument(
        "--autotune",
        action="store_true",
        help="launch the Triton gathers through triton.autotune (HPCFL_TRITON_AUTOTUNE); outputs tagged _autotune",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/entk_layer_costs"))
    args = p.parse_args(argv)
    if min(args.batch, args.p, args.runs) < 1 or args.rep_ms <= 0:
        p.error("--batch, --p and --runs must be >= 1 and --rep-ms > 0")
    return args


def timer(device: Any, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """fn -> milliseconds: do_bench's median on CUDA, else the median of ``--runs`` timed runs."""
    import torch

    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            warmup = max(5.0, args.rep_ms / 4)

            def median(fn) -> float:  # type: ignore[no-untyped-def]
                got = do_bench(fn, warmup=warmup, rep=args.rep_ms, quantiles=[0.5])
                return float(got[0] if isinstance(got, list | tuple) else got)

            return median

    def plain(fn) -> float:  # type: ignore[no-untyped-def]
        fn()  # warm-up (allocations, plans)
        times = []
        for _ in range(args.runs):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)

    return plain


def layer_dims(lp: Any, act: Any, delta: Any) -> dict[str, int]:
    """The cost model's dims of one weight (see hpcfl.entk.costs.form_features)."""
    from hpcfl.entk.layers import ConvPlan

    weight = lp.columns[0]
    if isinstance(lp, ConvPlan):
        kh, kw = lp.kernel
        length = delta.shape[2] * delta.shape[3]
        return dict(
            n=weight.n,
            out_channels=lp.out_channels,
            k=lp.k,
            unfold_rows=act.shape[1] * kh * kw,
            length=length,
        )
    out_features, in_features = lp.shape
    return dict(n=weight.n, out_channels=out_features, k=in_features, unfold_rows=0, length=1)


def measure_model(name: str, args: argparse.Namespace, device: Any) -> tuple[list[dict], dict[str, Any]]:
    import torch

    from hpcfl.entk import costs, native
    from hpcfl.entk._common import eval_mode
    from hpcfl.entk.coords import coordinate_set, param_columns, scope_parameters
    from hpcfl.entk.fused import build_plan, layer_inputs_and_deltas
    from hpcfl.entk.layers import ConvPlan, LinearPlan, Workspace
    from hpcfl.models import build_model

    torch.manual_seed(0)
    model = build_model(name, SHAPES[name], 10, **OPTIONS.get(name, {})).to(device)
    x = torch.randn(args.batch, *SHAPES[name], device=device)
    named = scope_parameters(model)
    total = sum(t.numel() for _, t in named)
    p = min(args.p, total)
    columns = param_columns(named, coordinate_set(total, p, 0))
    by_name = {c.name: c for c in columns}
    bench = timer(device, args)
    rows: list[dict] = []
    with eval_mode(model):
        plan = build_plan(model, named, columns, device)
        captured = layer_inputs_and_deltas(model, x, plan=plan)
        modules = dict(model.named_modules())
        out = torch.empty(args.batch, p, device=device)
        for layer, lp in plan.layers.items():
            if not isinstance(lp, LinearPlan | ConvPlan) or layer not in captured:
                continue
            act, delta = captured[layer]
            weight = by_name[f"{layer}.weight" if layer else "weight"]
            if weight.n == 0:
                continue
            dims = layer_dims(lp, act, delta)
            kind = "conv" if isinstance(lp, ConvPlan) else "linear"
            forms = ["full"] if weight.full else list(costs.FORMS)
            if (
                native.usable(device)
                and getattr(modules[layer], "groups", 1) == 1
                and (kind == "conv" or not weight.full)  # a whole Linear weight is one outer product
            ):
                forms.append(costs.NATIVE)  # timed wherever the kernel could run, chosen or not
            chosen = (  # the torch forms' pick (what the fit below scores)
                "full"
                if weight.full
                else costs.choose_layer_form(batch=args.batch, device_type=device.type, **dims)
            )
            planned = (
                lp.form(args.batch, dims["length"], act.shape[1]) if kind == "conv" else lp.form(args.batch)
            )
            for form in forms:
                cls = ConvPlan if kind == "conv" else LinearPlan
                single = cls(modules[layer], weight, None, device, form="gather" if form == "full" else form)  # type: ignore[arg-type]
                ws = Workspace()
                tasks = single.tasks(modules[layer], act, delta, out, ws, pieces=1)

                def run(tasks: list = tasks) -> None:
                    for task in tasks:
                        task()

                run()  # warm-up outside the timer: allocations, Triton compiles, autotuning
                ms = bench(run)
                shape = {key: dims[key] for key in ("out_channels", "k", "unfold_rows", "length")}
                native_counts = (
                    costs.native_features(batch=args.batch, **shape) if form == costs.NATIVE else {}
                )
                feats = (
                    {}
                    if form in ("full", costs.NATIVE)
                    else costs.form_features(form, batch=args.batch, device_type=device.type, **dims)
                )
                predicted = sum(costs.constants(device.type)[k] * v for k, v in feats.items()) + sum(
                    costs.NATIVE_COSTS[k] * v for k, v in native_counts.items()
                )
                rows.append({"model": name, "layer": layer, "kind": kind, "batch": args.batch, "numel": weight.numel,
                             **dims, "form": form, "chosen": chosen, "planned": planned, "ms": ms,
                             "predicted_ms": predicted / 1e6 if feats or native_counts else None,
                             **{f"count_{k}": feats.get(k, 0.0) for k in costs.COST_TERMS},
                             **{f"count_{k}": native_counts.get(k, 0.0) for k in costs.NATIVE_TERMS}})  # fmt: skip
                print(f"  {name:9s} {layer:24s} {kind:6s} n={dims['n']:7d}/{weight.numel:8d} L={dims['length']:4d} "
                      f"{form:11s} {ms:8.3f} ms{'  <- chosen' if form == chosen and len(forms) > 1 else ''}"
                      f"{'  <- planned' if form == planned and len(forms) > 1 else ''}")  # fmt: skip
        del captured
    return rows, {"model": name, "p": p, "P": total}


def whole_batches(
    name: str, args: argparse.Namespace, device: Any, fitted: dict[str, float]
) -> dict[str, float]:
    """ms per fused batch under each policy, and of a plain forward+backward."""
    import torch
    import torch.nn.functional as F

    from hpcfl.entk import costs, native
    from hpcfl.entk._common import eval_mode
    from hpcfl.entk.coords import coordinate_set, param_columns, scope_parameters
    from hpcfl.entk.fused import build_plan, fused_features
    from hpcfl.entk.settings import active, applied
    from hpcfl.models import build_model

    torch.manual_seed(0)
    model = build_model(name, SHAPES[name], 10, **OPTIONS.get(name, {})).to(device)
    x = torch.randn(args.batch, *SHAPES[name], device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    named = scope_parameters(model)
    total = sum(t.numel() for _, t in named)
    p = min(args.p, total)
    columns = param_columns(named, coordinate_set(total, p, 0))
    out = torch.empty(args.batch, p, device=device)
    bench = timer(device, args)
    result: dict[str, float] = {}

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()

    result["plain"] = bench(plain)
    current = costs.constants
    policies = ["auto", "torch", "fitted", *costs.FORMS]
    if native.usable(device):
        policies.append(costs.NATIVE)
    for policy in policies:
        if policy == "fitted":
            costs.constants = lambda device_type: fitted  # this process only: the fitted constants' choice
        kernel_off = replace(active(), native=False, native_from="entk_layer_costs")
        try:
            with applied(kernel_off if policy in ("torch", "fitted") else active()), eval_mode(model):
                plan = build_plan(
                    model,
                    named,
                    columns,
                    device,
                    form=None if policy in ("auto", "torch", "fitted") else policy,
                )
                result[policy] = bench(
                    lambda plan=plan: fused_features(
                        model, x, plan=plan, logit=0, out=out, batch_size=args.batch, progress=False
                    )
                )
        finally:
            costs.constants = current
    print(f"  {name}: ms per batch of {args.batch}: " + ", ".join(f"{k} {v:.2f}" for k, v in result.items()))
    return result


def summarise(rows: list[dict], fitted: dict[str, float]) -> dict[str, Any]:
    """Per model, how often the current and the fitted constants pick the faster form, and the time
    the picks lose against always picking the faster one."""
    from hpcfl.entk import costs

    out: dict[str, Any] = {}
    layers: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        if r["form"] in costs.FORMS:
            layers.setdefault((r["model"], r["layer"]), {})[r["form"]] = r
    for (model, _), forms in layers.items():
        if len(forms) < 2:
            continue
        best = min(forms, key=lambda f: forms[f]["ms"])
        cost_fit = {f: sum(fitted[k] * forms[f][f"count_{k}"] for k in costs.COST_TERMS) for f in forms}
        pick_fit = min(cost_fit, key=cost_fit.__getitem__)
        pick_now = forms[best]["chosen"]
        s = out.setdefault(model, {"layers": 0, "right_now": 0, "right_fitted": 0, "best_ms": 0.0,
                                   "now_ms": 0.0, "fitted_ms": 0.0})  # fmt: skip
        s["layers"] += 1
        s["right_now"] += pick_now == best
        s["right_fitted"] += pick_fit == best
        s["best_ms"] += forms[best]["ms"]
        s["now_ms"] += forms[pick_now]["ms"]
        s["fitted_ms"] += forms[pick_fit]["ms"]
    return out


def write(args: argparse.Namespace, tag: str, rows: list[dict], report: dict[str, Any]) -> None:
    from hpcfl.bench.machine import with_machine, with_machine_columns
    from hpcfl.files import atomic_write_text

    args.out.mkdir(parents=True, exist_ok=True)
    if rows:
        rows = with_machine_columns(rows)
        fields = list(dict.fromkeys(k for r in rows for k in r))
        lines = [",".join(fields)] + [
            ",".join("" if r.get(k) is None else str(r.get(k)) for k in fields) for r in rows
        ]
        atomic_write_text(args.out / f"entk_layer_costs_{tag}.csv", "\n".join(lines) + "\n")
    atomic_write_text(
        args.out / f"entk_layer_costs_{tag}.json",
        json.dumps(with_machine({**report, "rows": rows}), indent=1),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from hpcfl.entk import costs

    device = torch.device(args.device)
    tag = args.device.replace(":", "") + ("_autotune" if args.autotune else "")
    if args.autotune:
        import triton_kernels._triton as tt

        tt.AUTOTUNE = True  # read by the gathers on every launch
    key = "cuda" if device.type == "cuda" else "cpu"
    report: dict[str, Any] = {"device": str(device), "batch": args.batch, "p": args.p, "models": [],
                              "constants_now": dict(costs.constants(key)), "fitted": None, "batches": {},
                              "autotune": args.autotune}  # fmt: skip
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    rows: list[dict] = []
    for name in args.models:
        print(f"{name}: per layer, batch {args.batch}, p = {args.p}, {device}")
        got, info = measure_model(name, args, device)
        rows += got
        report["models"].append(info)
        write(args, tag, rows, report)
    fit_rows = [r for r in rows if r["form"] in costs.FORMS]
    if fit_rows:
        feats = [{k: r[f"count_{k}"] for k in costs.COST_TERMS} for r in fit_rows]
        fitted = costs.fit_constants(feats, [1e6 * r["ms"] for r in fit_rows])
        for r in rows:
            if r["form"] in costs.FORMS:
                r["fitted_ms"] = sum(fitted[k] * r[f"count_{k}"] for k in costs.COST_TERMS) / 1e6
        report["fitted"] = fitted
        report["choices"] = summarise(rows, fitted)
        write(args, tag, rows, report)
        print(f"\nfitted constants (ns per count) on {report.get('gpu', device)} over {len(fit_rows)} rows:")
        print("    " + repr({k: float(f"{v:.4g}") for k, v in fitted.items()}))
        for model, s in report["choices"].items():
            print(f"  {model}: faster form picked by the current constants {s['right_now']}/{s['layers']} "
                  f"({s['now_ms']:.2f} ms), by the fitted {s['right_fitted']}/{s['layers']} ({s['fitted_ms']:.2f} ms), "
                  f"always the faster {s['best_ms']:.2f} ms")  # fmt: skip
    else:
        fitted = dict(costs.constants(key))
        print("\nno layer with both forms (every weight kept whole?): nothing to fit")
    native_rows = [r for r in rows if r["form"] == costs.NATIVE]
    if native_rows:  # the native form's own constants (hpcfl.entk.costs.NATIVE_COSTS), fitted apart
        native_fit = costs.fit_constants(
            [{k: r[f"count_{k}"] for k in costs.NATIVE_TERMS} for r in native_rows],
            [1e6 * r["ms"] for r in native_rows],
            terms=costs.NATIVE_TERMS,
        )
        for r in native_rows:
            r["fitted_ms"] = sum(native_fit[k] * r[f"count_{k}"] for k in costs.NATIVE_TERMS) / 1e6
        report["native_fit"] = native_fit
        write(args, tag, rows, report)
        print(f"native form's constants (ns per count) over {len(native_rows)} rows:")
        print("    " + repr({k: float(f"{v:.4g}") for k, v in native_fit.items()}))
    if not args.no_batches:
        print("\nwhole fused batches (auto = current constants, fitted = the fit's choice):")
        for name in args.models:
            report["batches"][name] = whole_batches(name, args, device, fitted)
            write(args, tag, rows, report)
    print(f"\nwritten: {args.out}/entk_layer_costs_{tag}.csv, .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
