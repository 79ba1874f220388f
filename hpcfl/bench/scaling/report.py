"""The report: table, CSV and JSON, and the summary that rebuilds them from raw rows."""

from __future__ import annotations

import argparse
import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpcfl.bench.machine import csv_with_machine, with_machine
from hpcfl.bench.scaling.aggregate import build_projection, select_probe, summarize_rows
from hpcfl.bench.scaling.defaults import PROBE_FILE, ROWS_FILE
from hpcfl.bench.scaling.plots import plot_scaling, plot_time_split

CSV_FIELDS = (
    "config",
    "model",
    "clients",
    "ranks",
    "nodes",
    "ranks_per_node",
    "threads",
    "oversubscribed",
    "samples_per_client",
    "rounds_per_s",
    "samples_per_s",
    "round_s",
    "compute_s",
    "allreduce_s",
    "allreduce_wait_s",
    "eval_s",
    "eval_every",
    "compute_share",
    "allreduce_share",
    "eval_share",
    "imbalance",
    "strong_eff",
    "strong_base",
    "weak_eff",
    "weak_base",
    "buffer_bytes",
    "timed_rounds",
    "measurements",
    "slurm_job_ids",
)


def _f(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The measured rows as a markdown table."""
    head = (
        "| model | K | R | nodes | note | rounds/s | samples/s | compute s | allreduce ms | "
        "eval s (÷N) | allreduce % | E strong | E weak |\n"
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['clients']} | {r['ranks']} | {r['nodes']} | "
            f"{'oversubscribed' if r['oversubscribed'] else ''} | {r['rounds_per_s']:.3f} | "
            f"{r['samples_per_s']:,.0f} | {r['compute_s']:.3f} | {r['allreduce_s'] * 1e3:.2f} | "
            f"{r['eval_s']:.3f} (÷{r['eval_every']}) | {100 * r['allreduce_share']:.2f} | "
            f"{_f(r['strong_eff'], '.3f')} | {_f(r['weak_eff'], '.3f')} |"
        )
    return "\n".join(lines)


def format_projection(proj: dict[str, Any], ranks: Sequence[int] = (1, 8, 64, 512)) -> str:
    """A compact table of the projection (selected rank counts)."""
    lines = [
        f"{proj['label']}",
        *(f"  network {n['name']}: {n['source']}" for n in proj["networks"]),
        "| kind | model | network | R | K | rounds/s | allreduce % | efficiency |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for kind in ("strong", "weak"):
        for p in proj[kind]["rows"]:
            if p["ranks"] in ranks:
                lines.append(
                    f"| {kind} (projection) | {p['model']} | {p['network']} | {p['ranks']} | "
                    f"{p['clients']} | {p['rounds_per_s']:.3f} | {100 * p['allreduce_share']:.2f} | "
                    f"{p['efficiency']:.3f} |"
                )
    return "\n".join(lines)


def acceptance(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Issue #5 figures: allreduce share of simplecnn at 2 ranks (≤ 5%), E_s 1→2 ranks (≥ 0.9)."""
    two = [r for r in rows if r["model"] == "simplecnn" and r["ranks"] == 2 and r["threads"] == 1]
    if not two:
        return {}
    return {
        "allreduce_share_simplecnn_2_ranks": {
            "values": {str(r["clients"]): r["allreduce_share"] for r in two},
            "max": max(r["allreduce_share"] for r in two),
            "required_max": 0.05,
        },
        "strong_eff_simplecnn_1_to_2_ranks": {
            "values": {str(r["clients"]): r["strong_eff"] for r in two},
            "min": min((r["strong_eff"] for r in two if r["strong_eff"] is not None), default=None),
            "required_min": 0.9,
        },
    }


def _method() -> str:
    """The benchmark's full method (the package docstring), stored in ``scaling.json``: read from
    the package's ``__init__.py`` as text, since the package imports this module."""
    import ast

    source = Path(__file__).with_name("__init__.py").read_text()
    return ast.get_docstring(ast.parse(source), clean=False) or ""


def summarize(src: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Rebuild the report from every raw row under ``src``; write CSV/JSON/PNG to ``out``."""
    from hpcfl.errors import ConfigError
    from hpcfl.files import atomic_write_text, read_jsonl

    raw = [r for p in sorted(Path(src).rglob(ROWS_FILE)) for r in read_jsonl(p)]
    probes = [r for p in sorted(Path(src).rglob(PROBE_FILE)) for r in read_jsonl(p)]
    if not raw:
        raise ConfigError(f"no {ROWS_FILE} under {src}: run `hpcfl bench scaling --out {src}` first")
    rows = summarize_rows(raw, args.eval_every)
    probe = select_probe(probes)
    proj = build_projection(
        rows,
        probe,
        eval_every=args.eval_every,
        max_ranks=args.project_ranks,
        strong_clients=args.project_clients,
        weak_clients_per_rank=args.project_clients_per_rank,
        ib_alpha=args.ib_alpha,
        ib_beta=args.ib_beta,
    )
    report = {
        "method": _method(),
        "eval_every": args.eval_every,
        "rows": rows,
        "acceptance": acceptance(rows),
        "allreduce_probe": probe,
        "projection": proj,
        "raw_rows": len(raw),
    }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "scaling.json", json.dumps(with_machine(report), indent=2, default=str))
    table = io.StringIO()
    writer = csv.DictWriter(table, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(out / "scaling.csv", csv_with_machine(table.getvalue()))
    plot_scaling(rows, proj, out / "scaling.png")
    plot_time_split(rows, out / "scaling_time_split.png")
    print(format_table(rows))
    if probe is not None:
        print(
            f"\nallreduce probe ({probe['ranks']} ranks, {probe.get('nodes', 1)} node(s), {probe.get('mpi')}): "
            f"alpha = {probe['alpha_s'] * 1e6:.2f} us, beta = {probe['beta_Bps'] / 1e9:.2f} GB/s"
        )
    print()
    print(format_projection(proj))
    for name, item in report["acceptance"].items():
        value = item.get("max", item.get("min"))
        bound = item.get("required_max", item.get("required_min"))
        ok = value is not None and (value <= bound if "required_max" in item else value >= bound)
        print(
            f"{name}: {_f(value, '.3f')} (required {'<=' if 'required_max' in item else '>='} {bound}) "
            f"[{'ok' if ok else 'BELOW'}]"
        )
    print(f"wrote {out}/scaling.{{csv,json,png}}, scaling_time_split.png")
    return report
