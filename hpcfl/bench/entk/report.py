"""The report of ``hpcfl bench entk``: the acceptance ratios (fused against the best other method of
the device, the loop and plain training), the printed table and the CSV/JSON/PNG files."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from hpcfl.bench.entk.runners import OPACUS_MODES

FUSED_METHODS = {"fused": "fused", "fused-graph": "fused_graph"}
"""The fused methods an acceptance ratio is given for, and the prefix of their ratios' names."""
BEST_OTHER = {
    "cpu": ("vmap", "opacus", "opacus-functorch", "backpack"),
    "cuda": ("opacus", "opacus-functorch"),
}
"""Per device, the methods whose fastest is the "best other" that fused is compared with."""


def best_other(rates: dict[str, float], device: str) -> str | None:
    """The fastest of ``device``'s :data:`BEST_OTHER` methods among ``rates`` (samples/s of the
    methods that ran), or None when none of them ran."""
    candidates = [m for m in BEST_OTHER[device] if m in rates]
    return max(candidates, key=lambda m: rates[m]) if candidates else None


def acceptance(rows: dict[str, dict[str, Any]], device: str) -> dict[str, Any]:
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


def best_other_label(item: dict[str, Any], rows: dict[str, dict[str, Any]]) -> str:
    """``best other on cuda: opacus (hooks) of opacus, opacus-functorch``: the named winner, its mode."""
    best = item["best"]
    mode = f" ({OPACUS_MODES[best]})" if best in OPACUS_MODES else ""
    return f"best other on {item['device']}: {best}{mode} of {', '.join(item['among'])}"


def table(rows: list[dict[str, Any]], plain: float | None) -> str:
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


def plot(rows: list[dict[str, Any]], config: dict[str, Any], path: Path) -> None:
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


def write_report(out: Path, report: dict[str, Any], plain: float | None) -> None:
    """Write ``entk_bench.{json,csv,png}`` into ``out`` and print the table and each acceptance
    ratio (``plain``: plain training's samples/s, the table's reference; None when it failed)."""
    from hpcfl.bench.machine import csv_with_machine, with_machine
    from hpcfl.files import atomic_write_text

    rows, config, ratios = report["results"], report["config"], report["acceptance"]
    by_method = {r["method"]: r for r in rows}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(
        out / "entk_bench.json", json.dumps(with_machine(report, config.get("threads") or None), indent=2)
    )
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
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(
        out / "entk_bench.csv", csv_with_machine(text.getvalue(), config.get("threads") or None)
    )
    plot(rows, config, out / "entk_bench.png")
    print(table(rows, plain))
    if "native_kernel" in config:
        print(f"fused's native CPU kernel: {config['native_kernel']}")
    for name, item in ratios.items():
        extra = f" ({best_other_label(item, by_method)})" if "best" in item else ""
        verdict = "ok" if item["ratio"] >= item["required"] else "BELOW"
        rounds = ", ".join(f"{r:.2f}" for r in item["per_round"])
        print(
            f"{name}: {item['ratio']:.2f}x, required >= {item['required']}x{extra} [{verdict}]; "
            f"per round {rounds} (median {item['median_of_rounds']:.2f}x)"
        )
    print(f"wrote {out}/entk_bench.{{csv,json,png}}")
