"""The scaling benchmark's figures: efficiencies and projection, and the time split per configuration."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpcfl.files import save_figure


def plot_scaling(rows: Sequence[dict[str, Any]], proj: dict[str, Any], path: Path) -> None:
    """``scaling.png``: strong and weak efficiency per model, and the projected rounds/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(len(models), 3, figsize=(16, 4.2 * len(models)), squeeze=False)
    styles = {"measured": "--", "IB-like": ":"}  # projection lines: one style per network model
    colors = {"measured": "black", "IB-like": "dimgray"}
    for ax_row, model in zip(axes, models, strict=True):
        mine = [r for r in rows if r["model"] == model]
        strong_ax, weak_ax, rate_ax = ax_row
        for k in sorted({r["clients"] for r in mine}):
            pts = sorted(
                (r for r in mine if r["clients"] == k and r["strong_eff"] is not None),
                key=lambda r: r["ranks"],
            )
            if pts:
                r0 = min(r["ranks"] for r in mine if r["clients"] == k)
                xs = [r0] + [r["ranks"] for r in pts]
                strong_ax.plot(xs, [1.0] + [r["strong_eff"] for r in pts], "o-", label=f"measured K={k}")
                over = [r for r in pts if r["oversubscribed"]]
                strong_ax.plot([r["ranks"] for r in over], [r["strong_eff"] for r in over], "kx", ms=9)
        weak = {}
        for r in mine:
            if r["weak_eff"] is not None:
                weak.setdefault(r["weak_base"], []).append(r)
        for base_name, pts in sorted(weak.items()):
            pts.sort(key=lambda r: r["ranks"])
            r0 = int(base_name.split(",")[0][2:])
            k0 = int(base_name.split("K=")[1])
            xs = [r0] + [r["ranks"] for r in pts]
            weak_ax.plot(xs, [1.0] + [r["weak_eff"] for r in pts], "o-", label=f"measured {k0}/rank")
            over = [r for r in pts if r["oversubscribed"]]
            weak_ax.plot([r["ranks"] for r in over], [r["weak_eff"] for r in over], "kx", ms=9)
        for kind, ax in (("strong", strong_ax), ("weak", weak_ax)):
            what = (
                f"K={proj['strong']['clients']}"
                if kind == "strong"
                else f"K={proj['weak']['clients_per_rank']}·R"
            )
            for net in proj["networks"]:
                p = [q for q in proj[kind]["rows"] if q["model"] == model and q["network"] == net["name"]]
                if not p:
                    continue
                xs = [q["ranks"] for q in p]
                style = dict(ls=styles.get(net["name"], "-."), color=colors.get(net["name"], "gray"))
                label = f"PROJECTION {kind} {what}, {net['name']} α,β"
                ax.plot(xs, [q["efficiency"] for q in p], label=label, **style)
                style["color"] = "tab:blue" if kind == "strong" else "tab:red"
                rate_ax.plot(xs, [q["rounds_per_s"] for q in p], label=label, **style)
            ax.set_xscale("log", base=2)
            if any(r["oversubscribed"] for r in mine):
                ax.plot([], [], "kx", ms=9, label="oversubscribed (ranks x threads > cores)")
            top = max([1.15] + [q["efficiency"] + 0.05 for q in proj[kind]["rows"] if q["model"] == model])
            top = max([top] + [r[f"{kind}_eff"] + 0.05 for r in mine if r[f"{kind}_eff"] is not None])
            ax.set_ylim(0, top)
            ax.axhline(1.0, color="gray", lw=0.5)
            ax.set_xlabel("ranks")
            ax.set_ylabel(f"{kind}-scaling efficiency")
            ax.set_title(f"{model}: {kind} scaling")
            ax.legend(fontsize=7)
        rate_ax.set_xscale("log", base=2)
        rate_ax.set_yscale("log")
        rate_ax.set_xlabel("ranks")
        rate_ax.set_ylabel("rounds / s")
        rate_ax.set_title(f"{model}: projected rounds/s (PROJECTION)")
        rate_ax.legend(fontsize=7)
    fig.suptitle(
        "hpcfl bench scaling — measured (solid) and PROJECTION (dashed/dotted: ring allreduce model)",
        fontsize=10,
    )
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def plot_time_split(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """``scaling_time_split.png``: compute / allreduce / evaluation stacked per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(max(6, 0.55 * len(rows) + 3), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        mine = sorted(
            (r for r in rows if r["model"] == model), key=lambda r: (r["clients"], r["ranks"], r["nodes"])
        )
        labels = [
            f"K{r['clients']}\nR{r['ranks']}"
            + (f"\nN{r['nodes']}" if r["nodes"] > 1 else "")
            + ("\n(over)" if r["oversubscribed"] else "")
            for r in mine
        ]
        xs = range(len(mine))
        comp = [r["compute_s"] for r in mine]
        ar = [max(r["train_s"] - r["compute_s"], 0.0) for r in mine]  # the slowest rank's allreduce
        ev = [r["eval_s"] / r["eval_every"] for r in mine]
        ax.bar(xs, comp, label="local compute (slowest rank)")
        ax.bar(xs, ar, bottom=comp, label="allreduce (on the critical path)")
        ax.bar(xs, ev, bottom=[c + a for c, a in zip(comp, ar, strict=True)], label="evaluation ÷ eval_every")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel("seconds per round")
        ax.set_title(f"{model}: time split of one round")
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
