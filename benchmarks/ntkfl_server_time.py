"""NTK-FL server time per round, split into its parts, on 1 and 2 ranks (one thread each), and
per-sample Jacobian throughput against a ``torch.func.vmap(jacrev)`` baseline in the same run.

The round: ``--clients`` participants × ``--samples`` samples (the authors' setup: 21 × 200), MLP-100
on 784 inputs (Kaiming-normal init), 10 outputs, random inputs and labels (time does not depend on
the values), NTK-FL's default evolution (cross entropy, η 0.01, the 12-point grid to 2,000; ``--loss``,
``--evolution``, ``--kernel-cond`` change it). Each rank builds the round's gathered Jacobians itself
(the state after the runner's allgather) and runs NTK-FL's server step; the split is the step's own
metrics:

- ``jacobians``: every participant's per-sample Jacobians as it uploads them (``--upload factored``,
  the default: the Linear layers' factors; ``dense``: the fused (n, C, P) tensor), seconds for all
  participants on one rank, and the vmap(jacrev) baseline on the same samples → samples/s of each;
- ``kernel``: this rank's kernel blocks (reduce excluded); ``evolution``: the function-space
  evolution on rank 0 (its eigendecomposition, if any, is also ``eigh``) and the reduce that shares
  it; ``update``: the local Σ J_mᵀS_m products; ``selection``: the batched real-network losses of the
  Ψ candidates; ``allreduce``: all reducer calls; ``evolve_steps``: products of H the evolution took.

The paper-scale round, for the lead to time alone (one thread per rank):

    python benchmarks/ntkfl_server_time.py --ranks 1 --out benchmarks/results/ntkfl_server_time

Kernel-step scaling = kernel(1 rank) / kernel(2 ranks) (required ≥ 1.8×).

``--products`` (cross entropy, ``discrete``): on rank 0 of the 1-rank run, the same evolution on the
same kernel with each product of :mod:`hpcfl.ntk.product` and with the one it replaced (float32, the
N × 10 residual unpadded: ``before``), its seconds and its error against the float64 iteration
(max over grid points of ‖Δf‖ / max ‖f(t) − f(0)‖), in the summary's ``products``.

    python benchmarks/ntkfl_server_time.py --out benchmarks/results/ntkfl_server_time
    python benchmarks/ntkfl_server_time.py --clients 4 --samples 50 --out /tmp/ntk_time   # smoke

Memory: with ``--upload dense`` every rank holds N·C·P·4 bytes of Jacobians (12.7 GB at 20 × 200,
so the 2-rank run needs ~2 × 14 GB on one node); factored, ~30 MB. Writes ``ntkfl_server_time.json``
and ``.csv``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hpcfl.bench.machine import stamp_csv, with_machine
from hpcfl.files import write_csv

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def worker(args: argparse.Namespace) -> None:
    """One rank of the measurement (run under mpiexec)."""
    import torch

    torch.set_num_threads(1)
    from hpcfl.algorithms.base import Aggregate, ServerContext
    from hpcfl.algorithms.ntkfl import NTKFL, NTKFLParams
    from hpcfl.algorithms.participation import Population
    from hpcfl.comm.mpi import MPIComm
    from hpcfl.entk.jacobian import factored_jacobian, per_sample_jacobian
    from hpcfl.models import build_model
    from hpcfl.training.flat import FlatModel
    from hpcfl.training.layout import StateLayout

    comm = MPIComm()
    torch.manual_seed(0)
    flat = FlatModel(build_model("mlp", (1, 28, 28), 10, init="kaiming"))
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(args.samples, 1, 28, 28, generator=g) for _ in range(args.clients)]
    ys = [torch.randint(0, 10, (args.samples,), generator=g) for _ in range(args.clients)]
    result: dict[str, float] = {}
    t0 = time.perf_counter()
    if args.upload == "factored":
        jac = [factored_jacobian(flat.model, x) for x in xs]
    else:
        jac = [per_sample_jacobian(flat.model, x, method="fused") for x in xs]
    fused_s = time.perf_counter() - t0
    result["jacobians"] = fused_s
    result["jacobian_fused_samples_per_s"] = args.clients * args.samples / fused_s
    n_base = min(args.baseline_samples, args.samples)
    t0 = time.perf_counter()
    base = per_sample_jacobian(flat.model, xs[0][:n_base], method="vmap", batch_size=args.baseline_batch)
    result["jacobian_vmap_samples_per_s"] = n_base / (time.perf_counter() - t0)
    first = jac[0].dense()[:n_base] if args.upload == "factored" else jac[0][:n_base]
    result["jacobian_max_abs_diff"] = float((base - first).abs().max())
    del first
    del base
    with torch.no_grad():
        outs = [flat.model(x) for x in xs]
    params = NTKFLParams(
        upload=args.upload,
        loss=args.loss,
        evolution=args.evolution,
        kernel_cond=args.kernel_cond,
        kernel_product=args.kernel_product,
    )
    algo = NTKFL(params, layout=StateLayout.of_model(flat.model))
    algo.attach(flat.model)
    agg = Aggregate(
        sums={},
        weight=float(args.clients * args.samples),
        count=args.clients,
        gathered={"jacobian": jac, "output": outs, "label": ys, "input": xs},
    )
    ctx = ServerContext(
        0,
        tuple(range(args.clients)),
        Population((args.samples,) * args.clients),
        comm.allreduce,
        comm.rank,
        comm.size,
    )
    server = algo.init_server(flat.vector)
    comm.barrier()
    t0 = time.perf_counter()
    _, m = algo.server_update(server, agg, ctx)
    total = time.perf_counter() - t0
    reduce_s = m["reduce_s"]
    result.update(
        kernel=m["kernel_s"],  # includes the kernel's reduce; the split below removes it
        eigh=m["eigh_s"],
        evolution=m["evolve_s"] + m["eigh_s"],
        update=m["update_s"],
        selection=m["select_s"],
        evolve_steps=m["evolve_steps"],
        allreduce=reduce_s,
        server_total=total,
        t_star=m["t_star"],
        evolve_product=m["evolve_product"],
    )
    if args.products and comm.size == 1:
        result["products"] = compare_products(jac, outs, ys, params)
    # the kernel's own reduce: time it alone on the same matrix size
    N = args.clients * args.samples
    H = torch.zeros(N, N, dtype=torch.float64)
    comm.barrier()
    t0 = time.perf_counter()
    comm.allreduce(H)
    result["kernel_reduce"] = time.perf_counter() - t0
    result["kernel_compute"] = result["kernel"] - result["kernel_reduce"]
    rows = comm.allgather(result)
    if comm.rank == 0:
        Path(args.result).write_text(json.dumps({"ranks": comm.size, "per_rank": rows}))


def compare_products(jac: list, outs: list, ys: list, params: object) -> list[dict[str, object]]:
    """The discrete cross-entropy evolution on the round's kernel with each product (and the
    replaced unpadded float32 one), timed, and its error against the float64 iteration."""
    import torch
    import torch.nn.functional as F

    from hpcfl.ntk import evolution as ev
    from hpcfl.ntk.product import kernel_product

    H = ev.kernel(jac, 0, 1, lambda t: t)
    f0 = torch.cat(outs).double()
    Y = F.one_hot(torch.cat(ys), f0.shape[1]).double()
    lr, grid = params.eta, params.grid
    H32 = H.float()
    ways = {
        "float64": kernel_product(H, "float64"),
        "before (float32, unpadded)": lambda v: (H32 @ v.float()).double(),
        "float32": kernel_product(H, "float32"),
        "int8": None,  # built inside the timing: its setup (subspace, limbs) is part of its cost
    }
    rows, ref = [], None
    for name, matvec in ways.items():
        t0 = time.perf_counter()
        mv = kernel_product(H, "int8") if matvec is None else matvec
        evo = ev._descend_ce(mv, f0, Y, lr=lr, grid=grid)
        seconds = time.perf_counter() - t0
        ref = evo if ref is None else ref
        move = max(float((o - f0).norm()) for o in ref.outputs)
        err = max(float((a - b).norm()) for a, b in zip(evo.outputs, ref.outputs, strict=True)) / move
        rows.append(
            {"product": name, "seconds": seconds, "per_step_ms": 1e3 * seconds / evo.steps, "error": err}
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "ntkfl_server_time")
    ap.add_argument("--clients", type=int, default=21)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--baseline-samples", type=int, default=200, help="samples for the vmap(jacrev) baseline")
    ap.add_argument("--baseline-batch", type=int, default=16)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument(
        "--upload",
        choices=["factored", "dense"],
        default="factored",
        help="how the Jacobians travel (params.upload); dense needs ~14 GB per rank at 20 × 200",
    )
    ap.add_argument("--loss", choices=["ce", "mse"], default="ce")
    ap.add_argument("--evolution", choices=["discrete", "flow"], default="discrete")
    ap.add_argument("--kernel-cond", action="store_true", help="also compute λ_max/λ_min (an eigvalsh)")
    ap.add_argument(
        "--kernel-product",
        choices=["auto", "float64", "float32", "int8"],
        default="auto",
        help="the cross-entropy evolution's products of H (params.kernel_product)",
    )
    ap.add_argument(
        "--products", action="store_true", help="also time the evolution with every product (1 rank)"
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)  # prepended: keep deps
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    runs = {}
    for r in args.ranks:
        result = args.out / f"ranks{r}.json"
        cmd = [
            str(Path(sys.executable).parent / "mpiexec"),
            "-n",
            str(r),
            sys.executable,
            __file__,
            "--worker",
        ]
        cmd += ["--clients", str(args.clients), "--samples", str(args.samples), "--result", str(result)]
        cmd += (
            [
                "--baseline-samples",
                str(args.baseline_samples),
                "--baseline-batch",
                str(args.baseline_batch),
                "--upload",
                args.upload,
                "--loss",
                args.loss,
                "--evolution",
                args.evolution,
                "--kernel-product",
                args.kernel_product,
            ]
            + (["--kernel-cond"] if args.kernel_cond else [])
            + (["--products"] if args.products else [])
        )
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-2000:]}")
        runs[r] = json.loads(result.read_text())
    parts = [
        "jacobians",
        "kernel_compute",
        "kernel_reduce",
        "evolution",
        "eigh",
        "update",
        "selection",
        "allreduce",
        "server_total",
    ]
    table = []
    for r, run in runs.items():
        slowest = {p: max(row[p] for row in run["per_rank"]) for p in parts}
        first = run["per_rank"][0]
        table.append(
            {
                "ranks": r,
                **slowest,
                "evolve_steps": first["evolve_steps"],
                "jacobian_fused_samples_per_s": first["jacobian_fused_samples_per_s"],
                "jacobian_vmap_samples_per_s": first["jacobian_vmap_samples_per_s"],
                "jacobian_max_abs_diff": first["jacobian_max_abs_diff"],
            }
        )
    summary = {
        "clients": args.clients,
        "samples": args.samples,
        "upload": args.upload,
        "loss": args.loss,
        "evolution": args.evolution,
        "kernel_cond": args.kernel_cond,
        "table": table,
    }
    summary["evolve_product"] = runs[args.ranks[0]]["per_rank"][0]["evolve_product"]
    products = runs[args.ranks[0]]["per_rank"][0].get("products")
    if products:
        summary["products"] = products
    if 1 in runs and 2 in runs:
        k1 = next(t for t in table if t["ranks"] == 1)["kernel_compute"]
        k2 = next(t for t in table if t["ranks"] == 2)["kernel_compute"]
        summary["kernel_scaling_1_to_2"] = k1 / k2
    (args.out / "ntkfl_server_time.json").write_text(json.dumps(with_machine(summary), indent=2))
    write_csv(args.out / "ntkfl_server_time.csv", table)
    stamp_csv(args.out / "ntkfl_server_time.csv")
    for row in table:
        print(
            f"ranks={row['ranks']}: "
            + ", ".join(f"{p}={row[p]:.3f}s" for p in parts)
            + f"; Jacobians ({args.upload}) {row['jacobian_fused_samples_per_s']:.0f}/s vs vmap(jacrev) "
            f"{row['jacobian_vmap_samples_per_s']:.0f}/s"
        )
    for row in products or []:
        print(
            f"evolution with {row['product']}: {row['seconds']:.2f}s ({row['per_step_ms']:.2f} ms/step), "
            f"error {row['error']:.1e} of the movement"
        )
    if "kernel_scaling_1_to_2" in summary:
        print(f"kernel step scaling 1 → 2 ranks: {summary['kernel_scaling_1_to_2']:.2f}×")


if __name__ == "__main__":
    main()
