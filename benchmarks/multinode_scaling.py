"""Scaling measured ACROSS hosts: ``hpcfl bench scaling`` in world mode on emulated nodes.

For each link profile (default ``10gbe`` and ``1gbe``, :mod:`tests.cluster.links`) this
starts an emulated SLURM cluster of ``--nodes`` nodes (:func:`tests.cluster.slurm.start_cluster`:
one network + UTS + mount namespace and one ``slurmd`` per node, links shaped with ``tc``), then runs
``srun -N n --ntasks-per-node r python -m hpcfl bench scaling --mode world`` at every point n×r of
``--points`` (MPI between nodes over TCP on the shaped links; inside a node over shared memory).
Every point with ≥ 2 ranks also runs the allreduce probe (float32, 8 B … 32 MiB) across its hosts.

Then, per profile:
- α, β of the ring-allreduce model fitted to the cross-node probes of that profile whose ranks each
  have a core of the machine (2 here: every emulated node shares the machine's cores, and a rank
  waiting for a core adds milliseconds to a small message; the other probes are reported, not
  fitted); α from the small messages, β from the large ones (:func:`fit_latency_bandwidth`);
- the measured points' allreduce time against that model's prediction for the round buffer
  (error stated per point and as the median);
- the projection to 16 … 1,024 nodes (one rank per node) for simplecnn, resnet8 and resnet18 at a
  stated per-client compute: the CPU's measured here (one rank, one thread), and the GPU's from
  ``benchmarks/results`` (H200: simplecnn ``round_throughput_cuda.json``, client_batch 1;
  resnet18 ``fl_frameworks_setup_cuda.csv``, hpcfl auto), with two networks: the emulated link as
  fitted, and the profile's line rate times MPI's efficiency on the slowest shaped profile (the one
  the veth surely carries) with its published latency (this kernel has no ``netem``: the latency is
  projected, never injected; a faster profile is measured at the veth's limit, which its line-rate
  network does not inherit).

What 2 shared cores cannot show: every emulated node runs on the same 2 cores, so the compute of
the ranks of different "nodes" contends (a real cluster's nodes compute in parallel); the rows say
``oversubscribed`` where ranks exceed cores. Communication is separated from compute in every
figure (``compute_s``, ``allreduce_s``), and the cross-host claims rest on the allreduce figures.

    python benchmarks/multinode_scaling.py [--profiles 10gbe,1gbe] [--nodes 4] [--points 1x1,2x1,4x1,2x2,4x2]

Needs root (namespaces) and the SLURM packages (``.ci/setup_slurm.sh``). Writes
``benchmarks/results/multinode_scaling.{csv,json,png}`` and prints the table. Run it alone.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpcfl.bench.machine import stamp_csv, with_machine  # noqa: E402
from hpcfl.bench.scaling.perfmodel import (  # noqa: E402
    ComputeModel,
    Network,
    projected_round,
    ring_allreduce_s,
)
from tests.cluster.links import parse_link  # noqa: E402
from tests.cluster.slurm import start_cluster  # noqa: E402
from tests.helpers import repo_env  # noqa: E402

SAMPLES = 50
FIT_RANKS = os.cpu_count() or 1  # probes with at most this many ranks feed the α-β fit
CLIENTS = 16
PROJECT_NODES = [16, 32, 64, 128, 256, 512, 1024]
# GPU per-sample throughput measured on one H200 (benchmarks/results), one client at a time
GPU_SAMPLES_PER_S = {
    "simplecnn": (37634.05, "round_throughput_cuda.json: hpcfl client_batch 1, K=10, H200"),
    "resnet18": (10878.41, "fl_frameworks_setup_cuda.csv: hpcfl client_batch auto, H200"),
}


def run_points(profile: str, nodes: int, points: list[tuple[int, int]], out: Path, models: str) -> float:
    """Start the cluster with ``profile`` links and measure every point; returns the wall time."""
    t0 = time.monotonic()
    cluster = start_cluster(nodes=nodes, link=profile, accounting=False)
    try:
        for n, r in points:
            point_out = out / profile / f"nodes{n}-ranks{r}"
            bench = [
                sys.executable, "-m", "hpcfl", "bench", "scaling", "--mode", "world",
                "--models", models, "--clients", str(CLIENTS), "--clients-per-rank", "0",
                "--samples-per-client", str(SAMPLES), "--test-samples", "200", "--rounds", "4",
                "--warmup", "1", "--probe-budget", "1.5", "--out", str(point_out),
            ]  # fmt: skip
            step = f"srun --mpi=pmi2 -N {n} --ntasks-per-node {r} " + " ".join(bench)
            job = cluster.sbatch(wrap=step, args=[f"-N{n}", f"--ntasks-per-node={r}", "-c1"], env=repo_env())
            state = cluster.wait_state(job, timeout=900)
            print(f"  {profile} {n}x{r}: {state}", flush=True)
            if state != "COMPLETED":
                print(cluster.output_path(job).read_text()[-2000:])
        if DEADLINE_OVERHEAD and profile == PROFILES_FIRST[0]:  # the collective deadline across hosts
            script = REPO / "benchmarks" / "comm_deadline_overhead.py"
            dest = RESULTS_DIR / f"comm_deadline_overhead_2nodes_{profile}"
            step = (
                f"srun --mpi=pmi2 -N2 --ntasks-per-node=1 {sys.executable} {script} --repeats 50 --out {dest}"
            )
            job = cluster.sbatch(wrap=step, args=["-N2", "--ntasks-per-node=1", "-c1"], env=repo_env())
            print(f"  {profile} deadline overhead: {cluster.wait_state(job, timeout=900)}", flush=True)
            print(cluster.output_path(job).read_text(), flush=True)
        # resnet18's per-client CPU time: one rank, two clients
        r18 = out / profile / "resnet18-1x1"
        if not r18.exists() and profile == PROFILES_FIRST[0]:
            bench = [
                sys.executable, "-m", "hpcfl", "bench", "scaling", "--mode", "world", "--models", "resnet18",
                "--clients", "2", "--clients-per-rank", "0", "--samples-per-client", str(SAMPLES),
                "--test-samples", "50", "--rounds", "2", "--warmup", "1", "--no-probe", "--out", str(r18),
            ]  # fmt: skip
            job = cluster.sbatch(wrap="srun -N1 -n1 " + " ".join(bench), args=["-N1", "-n1"], env=repo_env())
            print(f"  {profile} resnet18 1x1: {cluster.wait_state(job, timeout=900)}", flush=True)
    finally:
        cluster.stop()
    return time.monotonic() - t0


PROFILES_FIRST: list[str] = []
DEADLINE_OVERHEAD: list[bool] = []
RESULTS_DIR = REPO / "benchmarks" / "results"


def fit_latency_bandwidth(samples: list[tuple[int, int, float]]) -> tuple[float, float]:
    """α from the small messages (≤ 2 KiB: t / 2(R−1), median), then β by least squares on the
    large ones (≥ 1 MiB: t − 2(R−1)α = 2(R−1)/R · n/β).

    Why not :func:`fit_alpha_beta`'s relative fit over all sizes: the token bucket that shapes a
    link lets a message smaller than the bucket (68 KiB+) pass at the veth's own speed, so the
    middle sizes look faster than the link; the relative fit weighs them as much as the rest and
    overstates β several times (1gbe: 569 MB/s fitted for a link measured at 115 MB/s)."""
    small = [t / (2 * (r - 1)) for r, n, t in samples if n <= 2048 and r > 1]
    alpha = statistics.median(small) if small else 0.0
    big = [(2 * (r - 1) / r * n, t - 2 * (r - 1) * alpha) for r, n, t in samples if n >= 2**20 and r > 1]
    if not big:
        return alpha, math.inf
    x2 = sum(x * x for x, _ in big)
    inv_beta = sum(x * y for x, y in big) / x2
    return alpha, (1.0 / inv_beta if inv_beta > 0 else math.inf)


def _jsonl(paths: list[Path]) -> list[dict]:
    return [json.loads(line) for p in paths for line in p.read_text().splitlines() if line.strip()]


def analyse(out: Path, profiles: list[str]) -> dict:
    """Fits, measured-vs-model errors and projections from the rows under ``out``."""
    result: dict = {"profiles": {}, "samples_per_client": SAMPLES, "clients": CLIENTS}
    per_client_cpu: dict[str, tuple[float, int, float]] = {}  # model -> (s, payload floats, eval_1rank)
    for profile in profiles:
        rows = _jsonl(sorted((out / profile).rglob("scaling_rows.jsonl")))
        probes = [
            p for p in _jsonl(sorted((out / profile).rglob("allreduce_probe.jsonl"))) if p.get("nodes", 1) > 1
        ]
        # the fit uses the probes whose ranks each have a core of the machine (all emulated nodes
        # share its cores: with more ranks, a rank waiting for its turn on a core adds ms)
        own_core = [p for p in probes if p["ranks"] <= FIT_RANKS] or probes
        samples = [
            (p["ranks"], n, t)
            for p in own_core
            for n, t in zip(p["sizes_bytes"], p["seconds_best"], strict=True)
        ]
        alpha, beta = fit_latency_bandwidth(samples) if samples else (math.nan, math.nan)
        link = parse_link(profile)
        points = []
        for row in rows:
            if row["ranks"] == 1 and row["nodes"] == 1:
                c = row["compute_s"] / row["clients"]
                per_client_cpu.setdefault(row["model"], (c, row["payload_floats"], row["eval_s"]))
            if row["ranks"] < 2:
                continue
            model_s = ring_allreduce_s(row["ranks"], row["buffer_bytes"], alpha, beta)
            points.append(
                {
                    "model": row["model"],
                    "nodes": row["nodes"],
                    "ranks": row["ranks"],
                    "compute_s": row["compute_s"],
                    "allreduce_s": row["allreduce_s"],
                    "allreduce_model_s": model_s,
                    "allreduce_error": (model_s - row["allreduce_s"]) / row["allreduce_s"],
                    "round_s": row["train_s"] + row["eval_s"] / 5,
                    "oversubscribed": row["oversubscribed"],
                }
            )
        errors = [abs(p["allreduce_error"]) for p in points if p["nodes"] > 1]
        result["profiles"][profile] = {
            "link": link.describe() if link else profile,
            "source": link.source if link else "",
            "alpha_s": alpha,
            "beta_Bps": beta,
            "fit_from": f"probes with <= {FIT_RANKS} ranks (one core each on this {FIT_RANKS}-core machine)",
            "probes": [
                {
                    "ranks": p["ranks"],
                    "nodes": p["nodes"],
                    "sizes_bytes": p["sizes_bytes"],
                    "seconds_best": p["seconds_best"],
                }
                for p in probes
            ],
            "points": points,
            "median_abs_allreduce_error_across_nodes": statistics.median(errors) if errors else None,
        }
    result["per_client_cpu"] = {
        m: {"seconds": v[0], "payload_floats": v[1]} for m, v in per_client_cpu.items()
    }
    result["projection"] = project_all(result, per_client_cpu)
    return result


def project_all(result: dict, per_client_cpu: dict[str, tuple[float, int, float]]) -> list[dict]:
    """16 … 1,024 nodes, one rank per node, K = 10 clients per node (weak scaling)."""
    rows = []
    reachable = {p: v for p, v in result["profiles"].items() if not math.isnan(v["beta_Bps"])}
    # MPI's share of the line, from the slowest shaped profile (the one this machine's veth surely
    # carries: a faster one is measured at the veth's limit, which says nothing of its line)
    shaped = {p: parse_link(p) for p in reachable if (lk := parse_link(p)) is not None and lk.rate_bit_s}
    slowest = min(shaped, key=lambda p: shaped[p].rate_bit_s or 0.0) if shaped else None
    efficiency = (
        min(1.0, reachable[slowest]["beta_Bps"] / ((shaped[slowest].rate_bit_s or 1.0) / 8))
        if slowest
        else 1.0
    )
    for profile, fit in reachable.items():
        link = parse_link(profile)
        nets = [
            Network(
                f"{profile} emulated (fitted)",
                fit["alpha_s"],
                fit["beta_Bps"],
                "fitted on the emulated links",
            )
        ]
        if link is not None and link.rate_bit_s is not None and link.latency_s is not None:
            nets.append(
                Network(
                    f"{profile} line rate",
                    link.latency_s,
                    link.rate_bit_s / 8 * efficiency,
                    f"published latency {link.latency_s * 1e6:g} us; line rate x the efficiency fitted on "
                    f"{slowest} ({efficiency:.2f})",
                )
            )
        for model, (c_cpu, floats, eval_s) in per_client_cpu.items():
            computes = [("cpu", c_cpu, "measured here, 1 rank, 1 thread")]
            if model in GPU_SAMPLES_PER_S:
                sps, src = GPU_SAMPLES_PER_S[model]
                computes.append(("gpu", SAMPLES / sps, src))
            for device, c, src in computes:
                cm = ComputeModel(model, c, eval_s if device == "cpu" else 0.0, floats, SAMPLES, 5, src)
                for net in nets:
                    base = None
                    for n in PROJECT_NODES:
                        p = projected_round(cm, net, n, 10 * n)
                        base = base or p["round_s"]
                        rows.append(
                            {
                                "model": model, "device": device, "network": net.name, "nodes": n,
                                "compute_s": p["compute_s"], "allreduce_s": p["allreduce_s"],
                                "round_s": p["round_s"], "allreduce_share": p["allreduce_share"],
                                "weak_efficiency": base / p["round_s"], "compute_source": src,
                            }
                        )  # fmt: skip
    return rows


def write(result: dict, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.with_suffix(".json").write_text(json.dumps(with_machine(result), indent=1, default=float) + "\n")
    with dest.with_suffix(".csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kind", "profile_or_network", "model", "device", "nodes", "ranks", "compute_s",
                    "allreduce_s", "allreduce_model_s", "allreduce_error", "round_s", "weak_efficiency"])  # fmt: skip
        for profile, fit in result["profiles"].items():
            for p in fit["points"]:
                w.writerow(["measured", profile, p["model"], "cpu", p["nodes"], p["ranks"], p["compute_s"],
                            p["allreduce_s"], p["allreduce_model_s"], p["allreduce_error"], p["round_s"], ""])  # fmt: skip
        for p in result["projection"]:
            w.writerow(["projected", p["network"], p["model"], p["device"], p["nodes"], p["nodes"], p["compute_s"],
                        p["allreduce_s"], "", "", p["round_s"], p["weak_efficiency"]])  # fmt: skip
    stamp_csv(dest.with_suffix(".csv"))
    plot(result, dest.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    for profile, fit in result["profiles"].items():
        for probe in fit["probes"]:
            ax.loglog(probe["sizes_bytes"], probe["seconds_best"], "o-", ms=3,
                      label=f"{profile}: {probe['ranks']} ranks / {probe['nodes']} nodes")  # fmt: skip
    ax.set(
        xlabel="allreduce message (bytes)", ylabel="seconds (best)", title="allreduce across emulated hosts"
    )
    ax.legend(fontsize=7)
    ax = axes[1]
    labels, comp, comm = [], [], []
    for profile, fit in result["profiles"].items():
        for p in fit["points"]:
            if p["model"] == "simplecnn":
                labels.append(f"{profile}\n{p['nodes']}x{p['ranks'] // p['nodes']}")
                comp.append(p["compute_s"])
                comm.append(p["allreduce_s"])
    ax.bar(range(len(labels)), comp, label="compute (max over ranks)")
    ax.bar(range(len(labels)), comm, bottom=comp, label="allreduce")
    ax.set_xticks(range(len(labels)), labels, fontsize=6)
    ax.set(ylabel="seconds per round", title=f"simplecnn, K={CLIENTS}: measured split (2 shared cores)")
    ax.legend(fontsize=7)
    ax = axes[2]
    for key in sorted({(p["model"], p["device"], p["network"]) for p in result["projection"]}):
        rows = [p for p in result["projection"] if (p["model"], p["device"], p["network"]) == key]
        ax.semilogx(
            [p["nodes"] for p in rows], [p["allreduce_share"] for p in rows], ".-", label=" / ".join(key)
        )
    ax.set(xlabel="nodes (1 rank each, 10 clients per node)", ylabel="allreduce share of a round",
           title="PROJECTION (ring allreduce model)")  # fmt: skip
    ax.legend(fontsize=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profiles", default="10gbe,1gbe")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--points", default="1x1,2x1,4x1,2x2,4x2")
    p.add_argument("--models", default="simplecnn,resnet8")
    p.add_argument(
        "--work", default="benchmarks/out/multinode", help="raw rows (kept: a rerun skips nothing)"
    )
    p.add_argument("--out", default="benchmarks/results/multinode_scaling")
    p.add_argument("--analyse-only", action="store_true")
    p.add_argument(
        "--deadline-overhead",
        action="store_true",
        help="also time the deadline-bounded allreduce against the blocking one across 2 nodes (first profile)",
    )
    args = p.parse_args()
    profiles = args.profiles.split(",")
    PROFILES_FIRST.extend(profiles[:1])
    if args.deadline_overhead:
        DEADLINE_OVERHEAD.append(True)
    points = [tuple(int(v) for v in s.split("x")) for s in args.points.split(",")]
    work = Path(args.work).resolve()  # the jobs run in the cluster's own directory
    if not args.analyse_only:
        for profile in profiles:
            print(f"profile {profile}: {args.nodes} emulated nodes", flush=True)
            wall = run_points(profile, args.nodes, points, work, args.models)
            print(f"  {wall:.0f} s", flush=True)
    result = analyse(work, profiles)
    write(result, Path(args.out))
    for profile, fit in result["profiles"].items():
        err = fit["median_abs_allreduce_error_across_nodes"]
        print(f"{profile}: alpha {fit['alpha_s'] * 1e6:.1f} us, beta {fit['beta_Bps'] / 1e6:.1f} MB/s; "
              f"median |model - measured| allreduce across nodes: {err if err is None else f'{err:.0%}'}")  # fmt: skip
        for pt in fit["points"]:
            print(f"  {pt['model']:<9} {pt['nodes']}n x {pt['ranks'] // pt['nodes']}r: compute {pt['compute_s']:.3f} s, "
                  f"allreduce {pt['allreduce_s'] * 1e3:.2f} ms (model {pt['allreduce_model_s'] * 1e3:.2f} ms)")  # fmt: skip
    print(f"wrote {args.out}.csv/.json/.png")


if __name__ == "__main__":
    main()
