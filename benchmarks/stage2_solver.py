"""TCT stage 2 on one client at the paper's size: closed form vs the primal M-step reference.

    python benchmarks/stage2_solver.py --n 6000 --p 100000 --classes 10 --local-steps 500
    python benchmarks/stage2_solver.py --device cuda   # the same on the GPU (issue 40: GPU vs CPU)

What is measured, and why. A TCT stage-2 round runs M = 500 local SCAFFOLD steps
W ← W − η((1/n)Z̃ᵀ(Z̃W − Y) − h) on each client's standardised eNTK features Z̃ (n_k × (p+1), the
bias as a constant column). :class:`hpcfl.tct.solvers.PrimalSolver` takes them one by one (2M
products with Z̃); :class:`hpcfl.tct.solvers.ClosedFormSolver` (kernel form, since n_k < p) pays
once for K = Z̃Z̃ᵀ = UΛUᵀ and then does a round in three products with Z̃ (DESIGN.md, "Stage 2 in
closed form"). This script checks that both give the same ψ = W and measures what the closed form
buys:

1. *Data*: synthetic features with a decaying low-rank correlation structure
   (z = F·diag(s)·A + σE, s_j ∝ j^(-1/2)), standardised with pooled moments, stored in float32 with
   the bias column; labels from a noisy linear function of the latent factors. The measured client
   has ``--n`` rows. A second, small partner client (``--partner-n`` rows, same features) joins
   the federation only so that SCAFFOLD's correction h is non-zero from round 2 on; every timing
   below is the measured client's alone.
2. *One-time cost* of the closed form on the measured client, reported separately: float64 cast +
   K = Z̃Z̃ᵀ formation, and ``torch.linalg.eigh(K)``.
3. *Equivalence*: the :class:`hpcfl.tct.stage2.Stage2` algorithm (SCAFFOLD, the same round loop as
   ``hpcfl run``) with the closed form (float64 state) and with ``PrimalSolver`` (float32 state,
   as the pipeline runs it) for ``--check-rounds`` rounds of ``--check-steps`` local steps,
   η2 = half the largest stable rate (``stage2.auto_lr``). Reported per round: the relative
   difference ‖ψ_primal − ψ_closed‖_F / ‖ψ_closed‖_F (and max-abs relative). Round 1 has h = 0;
   later rounds exercise the correction.
4. *Per-round time* at M = ``--local-steps``, measured interleaved (``--rounds`` repetitions of:
   closed-form round, primal steps) so that the drifting load of a shared machine hits both alike.
   The closed form's cost does not depend on M, so a round is timed in full. The primal is timed
   over full M-step rounds only when one is estimated to take at most ``--max-primal-seconds``;
   otherwise over ``--probe-steps`` steps, extrapolated linearly to M — the output says which
   (``primal_round_extrapolated``). Speed-up = primal / closed-form seconds per round.
   Supplementary rows time both solvers with their Zᵀ-products written as (RᵀZ)ᵀ: MKL runs
   ``Z.T @ R`` several times slower than that for these tall-skinny shapes (see
   benchmarks/README.md), and both hpcfl solvers use the slow form.

``--device cuda`` runs both solvers (setup, equivalence rounds, timed rounds) on the GPU: the
synthetic features are drawn on the host from the seeded generator (the same numbers on every
device) and moved to the device once; every timed section ends with ``torch.cuda.synchronize``.
Run it once per device (a separate ``--out``) to compare the closed form on the GPU and the CPU.

Writes ``stage2_solver.{csv,json}`` to ``--out`` (default benchmarks/out/stage2_solver/) and prints
a table. Memory: the float32 features (n·(p+1)·4 bytes) plus the closed form's float64 copy (×2):
about 7.3 GB at the default size.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hpcfl.algorithms import ClientData, RoundPlan
from hpcfl.algorithms.participation import Population
from hpcfl.bench.machine import stamp_csv, with_machine
from hpcfl.comm.local import LocalComm
from hpcfl.runner.rounds import MemoryStates, run_rounds
from hpcfl.tct.problem import LinearProblem, centred_one_hot
from hpcfl.tct.solvers import ClosedFormSolver, LocalSolver, PrimalSolver, _geometric_sums
from hpcfl.tct.stage2 import Stage2, Stage2Params, auto_lr, spectrum

MAIN, PARTNER = 0, 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=6000, help="rows n_k of the measured client (default 6000)")
    p.add_argument("--p", type=int, default=100_000, help="eNTK coordinates p (default 100000; +1 bias)")
    p.add_argument("--classes", "-C", type=int, default=10, help="classes C (default 10)")
    p.add_argument("--local-steps", "-M", type=int, default=500, help="local steps M per round (500)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing repetitions (default 3)")
    p.add_argument(
        "--check-steps", type=int, default=10, help="local steps of the equivalence rounds (default 10)"
    )
    p.add_argument("--check-rounds", type=int, default=3, help="rounds of the equivalence check (3)")
    p.add_argument(
        "--check-primal",
        choices=("library", "fast"),
        default="library",
        help="primal used for the equivalence check: hpcfl's PrimalSolver, or the same steps with "
        "(RᵀZ)ᵀ products (use 'fast' for full-M checks at smaller p)",
    )
    p.add_argument(
        "--max-primal-seconds",
        type=float,
        default=300.0,
        help="measure full primal rounds only if one is estimated to take at most this (else extrapolate)",
    )
    p.add_argument(
        "--probe-steps", type=int, default=3, help="primal steps per timing repetition when extrapolating (3)"
    )
    p.add_argument("--partner-n", type=int, default=600, help="rows of the small partner client (600)")
    p.add_argument("--rank", type=int, default=64, help="latent rank r of the synthetic features (64)")
    p.add_argument("--noise", type=float, default=1.0, help="isotropic noise σ of the features (1.0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data (0)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="where the solvers run: cpu | cuda | cuda:N (default cpu)")
    p.add_argument(
        "--out", type=Path, default=Path("benchmarks/out/stage2_solver"), help="CSV + JSON directory"
    )
    p.add_argument(
        "--results",
        type=Path,
        default=None,
        help="also merge the result into this JSON file under --results-key (e.g. benchmarks/results/stage2_solver.json)",
    )
    p.add_argument("--results-key", default="paper_size", help="key for --results (default paper_size)")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# data


def make_clients(args: argparse.Namespace, device: torch.device) -> dict[int, LinearProblem]:
    """Two clients' standardised float32 design matrices [Z, 1] and centred one-hot targets, drawn
    on the host (the seeded generator gives the same data whatever the device) and moved to
    ``device`` once per client."""
    g = torch.Generator().manual_seed(args.seed)
    r, p, C = args.rank, args.p, args.classes
    scale = 3.0 * torch.arange(1, r + 1, dtype=torch.float32).pow(-0.5)
    loadings = torch.randn(r, p, generator=g)
    readout = torch.randn(r, C, generator=g)
    sizes = {MAIN: args.n, PARTNER: args.partner_n}
    latent = {k: torch.randn(n, r, generator=g) * scale for k, n in sizes.items()}
    z = {k: torch.empty(n, p + 1, dtype=torch.float32) for k, n in sizes.items()}
    chunk = 8192
    for k, n in sizes.items():
        for c0 in range(0, p, chunk):
            c1 = min(p, c0 + chunk)
            block = z[k][:, c0:c1]
            torch.mm(latent[k], loadings[:, c0:c1], out=block)
            block.add_(torch.randn(n, c1 - c0, generator=g), alpha=args.noise)
    # pooled moments in float64, one column chunk at a time (what federated_moments computes)
    total = sum(sizes.values())
    for c0 in range(0, p, chunk):
        c1 = min(p, c0 + chunk)
        s1 = sum(z[k][:, c0:c1].sum(0, dtype=torch.float64) for k in sizes)
        s2 = sum(z[k][:, c0:c1].double().pow(2).sum(0) for k in sizes)
        mean = s1 / total
        std = (s2 / total - mean * mean).clamp_min(0).sqrt().clamp_min(1e-12)
        for k in sizes:
            block = z[k][:, c0:c1]
            block.sub_(mean.float()).div_(std.float())
    problems = {}
    for k in sizes:
        z[k][:, -1] = 1.0
        logits = latent[k] @ readout + 0.5 * torch.randn(sizes[k], C, generator=g)
        labels = logits.argmax(1).to(device)
        problems[k] = LinearProblem(z[k].to(device), centred_one_hot(labels, C, torch.float32), labels)
        del z[k]  # the host copy, once it is on the device (a no-op move on the CPU keeps it)
    return problems


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a timed section measures it (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------
# solvers


class FastPrimalSolver(PrimalSolver):
    """PrimalSolver's exact step, with the Zᵀ-product computed as (RᵀZ)ᵀ (supplementary timing)."""

    def local_steps(self, w0: torch.Tensor, h: torch.Tensor, lr: float, steps: int) -> torch.Tensor:
        z, y, n = self.problem.z, self.problem.y, self.problem.n
        w = w0.clone()
        for _ in range(steps):
            w -= lr * (((z @ w - y).T @ z).T / n - h)
        return w


def fast_closed_steps(
    solver: ClosedFormSolver, w0: torch.Tensor, h: torch.Tensor, lr: float, steps: int
) -> torch.Tensor:
    """ClosedFormSolver.local_steps (kernel form) with Z̃ᵀΣR computed as ((ΣR)ᵀZ̃)ᵀ (supplementary)."""
    n, vec, z = solver.problem.n, solver.eigenvectors, solver._z
    w0_64, h64 = w0.to(torch.float64), h.to(torch.float64)
    s1, s2 = _geometric_sums(solver.eigenvalues, n, lr, steps)
    r0 = vec.T @ (z @ w0_64 - solver._y)
    q = vec.T @ (lr * (z @ h64))
    residual_sum = vec @ (s1[:, None] * r0 + s2[:, None] * q)
    w = w0_64 + (lr * steps) * h64 - (lr / n) * (residual_sum.T @ z).T
    return w.to(w0.dtype)


class TimedSolver:
    """Wraps a local solver and records the seconds of each ``local_steps`` call."""

    def __init__(self, inner: LocalSolver) -> None:
        self.inner = inner
        self.problem = inner.problem
        self.seconds: list[float] = []

    def local_steps(self, w0: torch.Tensor, h: torch.Tensor, lr: float, steps: int) -> torch.Tensor:
        synchronize(w0.device)
        t0 = time.perf_counter()
        w = self.inner.local_steps(w0, h, lr, steps)
        synchronize(w.device)
        self.seconds.append(time.perf_counter() - t0)
        return w

    def lambda_max(self) -> float:
        return self.inner.lambda_max()


@contextlib.contextmanager
def timed_eigh(record: list[float]) -> Iterator[None]:
    """Record the seconds of every ``torch.linalg.eigh`` call inside the block (setup breakdown)."""
    original = torch.linalg.eigh

    def wrapper(*a: Any, **kw: Any) -> Any:
        synchronize(a[0].device)
        t0 = time.perf_counter()
        out = original(*a, **kw)
        synchronize(a[0].device)
        record.append(time.perf_counter() - t0)
        return out

    torch.linalg.eigh = wrapper
    try:
        yield
    finally:
        torch.linalg.eigh = original


def run_stage2(
    solvers: dict[int, LocalSolver],
    problems: dict[int, LinearProblem],
    lr: float,
    steps: int,
    rounds: int,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """``rounds`` SCAFFOLD rounds of :class:`Stage2` through hpcfl's round loop; ψ after each round."""
    shape = (problems[MAIN].z.shape[1], problems[MAIN].y.shape[1])
    algo = Stage2(Stage2Params(lr=lr, local_steps=steps, variant="scaffold"), solvers, shape)
    plan = RoundPlan(
        algorithm=algo,
        comm=LocalComm(),
        data={k: ClientData(k, pr.z, pr.y) for k, pr in problems.items()}.__getitem__,
        trainer=None,
        population=Population(tuple(problems[k].n for k in sorted(problems))),
        generator=lambda rnd, k: torch.Generator(),  # host: stage 2 draws nothing
        evaluate=lambda server, joint: {},
    )
    device = problems[MAIN].z.device
    server = algo.init_server(torch.zeros(shape[0] * shape[1], dtype=dtype, device=device))
    clients = MemoryStates(lambda k: algo.init_client(k, server))
    states: list[torch.Tensor] = []

    def hook(done, srv, cls, row) -> bool:
        states.append(srv.x.view(shape).to(torch.float64).clone())
        return False

    run_rounds(plan, server, clients, 0, rounds, stage="stage2", hook=hook)
    return states


def rel_diffs(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(‖a − b‖_F / ‖b‖_F, max|a − b| / max|b|) in float64; b is the closed form."""
    d = a.double() - b.double()
    return float(d.norm() / b.norm()), float(d.abs().max() / b.abs().max())


# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("stage2_solver: error: --device cuda but no CUDA GPU is visible", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    print(
        f"stage 2 solver benchmark on {device}: n={args.n} p={args.p} C={args.classes} "
        f"M={args.local_steps}, {torch.get_num_threads()} threads, load average {load_start[0]:.1f}",
        flush=True,
    )

    t0 = time.perf_counter()
    problems = make_clients(args, device)
    synchronize(device)
    gen_s = time.perf_counter() - t0
    print(f"synthetic features: {gen_s:.1f} s", flush=True)

    # one-time closed-form setup: cast + K = Z̃Z̃ᵀ, then eigh (measured client only)
    eigh_s: list[float] = []
    t0 = time.perf_counter()
    with timed_eigh(eigh_s):
        closed_main = ClosedFormSolver(problems[MAIN], form="kernel")
    synchronize(device)
    setup_s = time.perf_counter() - t0
    closed = {MAIN: closed_main, PARTNER: ClosedFormSolver(problems[PARTNER], form="kernel")}
    print(
        f"closed-form setup: {setup_s:.1f} s (cast + K formation {setup_s - eigh_s[0]:.1f} s, "
        f"eigh {eigh_s[0]:.1f} s)",
        flush=True,
    )
    every = spectrum(closed, LocalComm())  # λ_max from the eigendecomposition
    lr = auto_lr(every)
    print(f"η2 = {lr:.4g} (stage2.auto_lr); λ_max/n = {every[MAIN][0] / args.n:.4g}", flush=True)

    # equivalence check: closed form vs primal, the same Stage2 rounds
    M_chk = args.check_steps
    timed_closed = {k: TimedSolver(s) for k, s in closed.items()}
    psi_closed = run_stage2(timed_closed, problems, lr, M_chk, args.check_rounds, torch.float64)
    primal_cls = PrimalSolver if args.check_primal == "library" else FastPrimalSolver
    timed_primal = {k: TimedSolver(primal_cls(pr)) for k, pr in problems.items()}
    psi_primal = run_stage2(timed_primal, problems, lr, M_chk, args.check_rounds, torch.float32)
    check_rows = []
    for r, (a, b) in enumerate(zip(psi_primal, psi_closed, strict=True), start=1):
        fro, mx = rel_diffs(a, b)
        check_rows.append(
            {
                "round": r,
                "local_steps": M_chk,
                "rel_diff_fro": fro,
                "rel_diff_max": mx,
                "primal_seconds": timed_primal[MAIN].seconds[r - 1],
                "closed_seconds": timed_closed[MAIN].seconds[r - 1],
            }
        )
        print(f"round {r}: ‖ψ_primal − ψ_closed‖/‖ψ_closed‖ = {fro:.3e} (max-abs {mx:.3e})", flush=True)
    check_step_s = sum(timed_primal[MAIN].seconds) / (M_chk * args.check_rounds)

    # per-round timing at the full M, interleaved; w and h are realistic but do not affect the cost
    M = args.local_steps
    w64 = psi_closed[-1]
    # host: seeded draw, the same h on every device
    h64 = 1e-3 * torch.randn(w64.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    h64 = h64.to(device)
    w32, h32 = w64.float(), h64.float()
    primal, fast_primal = PrimalSolver(problems[MAIN]), FastPrimalSolver(problems[MAIN])
    full = check_step_s * M <= args.max_primal_seconds
    steps = M if full else args.probe_steps
    same = rel_diffs(
        fast_closed_steps(closed_main, w64, h64, lr, M), closed_main.local_steps(w64, h64, lr, M)
    )
    times: dict[str, list[float]] = {"closed": [], "closed_fast": [], "primal": [], "primal_fast": []}
    for rep in range(args.rounds):
        for name, fn in (
            ("closed", lambda: closed_main.local_steps(w64, h64, lr, M)),
            ("closed_fast", lambda: fast_closed_steps(closed_main, w64, h64, lr, M)),
            ("primal", lambda: primal.local_steps(w32, h32, lr, steps)),
            ("primal_fast", lambda: fast_primal.local_steps(w32, h32, lr, steps)),
        ):
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            sec = time.perf_counter() - t0
            times[name].append(sec if name.startswith("closed") else sec * M / steps)
        print(
            f"timing repetition {rep + 1}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in times.items()),
            flush=True,
        )
    extrapolated = not full
    med = {k: statistics.median(v) for k, v in times.items()}
    result: dict[str, Any] = {
        "config": {
            "n": args.n,
            "p": args.p,
            "classes": args.classes,
            "local_steps": M,
            "timing_repetitions": args.rounds,
            "check_steps": M_chk,
            "check_rounds": args.check_rounds,
            "check_primal": args.check_primal,
            "partner_n": args.partner_n,
            "features": f"synthetic rank-{args.rank} + noise {args.noise}, standardised, float32 + bias",
            "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "load_average_start": load_start[0],
            "load_average_end": os.getloadavg()[0],
        },
        "stage2_lr": lr,
        "lambda_max_over_n": every[MAIN][0] / args.n,
        "feature_generation_s": gen_s,
        "setup": {
            "total_s": setup_s,
            "cast_and_K_formation_s": setup_s - eigh_s[0],
            "eigh_s": eigh_s[0],
        },
        "round_s": times,
        "round_s_median": med,
        "primal_round_extrapolated": extrapolated,
        "primal_steps_timed_per_repetition": steps,
        "speedup_per_round": med["primal"] / med["closed"],
        "speedup_both_fast_products": med["primal_fast"] / med["closed_fast"],
        "rounds_to_amortise_setup": setup_s / max(med["primal"] - med["closed"], 1e-12),
        "fast_closed_vs_closed_rel_diff": same[0],
        "equivalence": check_rows,
        "max_rel_diff_fro": max(r["rel_diff_fro"] for r in check_rows),
        "total_s": time.perf_counter() - t_start,
    }
    (args.out / "stage2_solver.json").write_text(json.dumps(with_machine(result), indent=1) + "\n")
    with open(args.out / "stage2_solver.csv", "w", newline="") as f:
        w = csv.DictWriter(
            f, fieldnames=["kind", "round", "local_steps", "seconds", "rel_diff_fro", "rel_diff_max"]
        )
        w.writeheader()
        for r in check_rows:
            w.writerow(
                {
                    "kind": "equivalence",
                    **{k: r[k] for k in ("round", "local_steps", "rel_diff_fro", "rel_diff_max")},
                }
            )
        for name, secs in times.items():
            for i, sec in enumerate(secs, start=1):
                w.writerow({"kind": f"round_time_{name}", "round": i, "local_steps": M, "seconds": sec})
    stamp_csv(args.out / "stage2_solver.csv")
    if args.results is not None:
        merged = json.loads(args.results.read_text()) if args.results.exists() else {}
        merged[args.results_key] = with_machine(result)
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(merged, indent=1) + "\n")
    print_table(result)
    print(f"wrote {args.out}/stage2_solver.{{json,csv}}" + (f" and {args.results}" if args.results else ""))
    ok = result["max_rel_diff_fro"] <= 1e-4 and result["speedup_per_round"] >= 50
    return 0 if ok and math.isfinite(result["speedup_per_round"]) else 1


def print_table(res: dict[str, Any]) -> None:
    c, med = res["config"], res["round_s_median"]
    M = c["local_steps"]
    mark = " (extrapolated)" if res["primal_round_extrapolated"] else ""
    rows = [
        ("one-time: float64 cast + K = Z̃Z̃ᵀ", f"{res['setup']['cast_and_K_formation_s']:.1f} s"),
        ("one-time: eigh(K)", f"{res['setup']['eigh_s']:.1f} s"),
        (f"closed form, s / round (M = {M})", f"{med['closed']:.2f} s"),
        (f"primal float32, s / round (M = {M}){mark}", f"{med['primal']:.1f} s"),
        ("speed-up per round", f"{res['speedup_per_round']:.0f}×"),
        ("rounds to amortise the one-time cost", f"{res['rounds_to_amortise_setup']:.2f}"),
        ("closed form with (RᵀZ)ᵀ, s / round", f"{med['closed_fast']:.2f} s"),
        (f"primal with (RᵀZ)ᵀ, s / round{mark}", f"{med['primal_fast']:.1f} s"),
        ("speed-up, both with (RᵀZ)ᵀ", f"{res['speedup_both_fast_products']:.0f}×"),
    ]
    for r in res["equivalence"]:
        rows.append(
            (
                f"Stage2 round {r['round']} (M = {r['local_steps']}): rel. diff of ψ",
                f"{r['rel_diff_fro']:.2e}",
            )
        )
    width = max(len(a) for a, _ in rows)
    print(
        f"\n{c['device']}: n={c['n']} p={c['p']} C={c['classes']} M={M}, η2 = {res['stage2_lr']:.4g}, "
        f"{c['threads']} threads, "
        f"medians of {c['timing_repetitions']} interleaved repetitions"
    )
    for a, b in rows:
        print(f"  {a:<{width}}  {b}")


if __name__ == "__main__":
    sys.exit(main())
