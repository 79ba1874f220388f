"""Launcher mode: one ``mpiexec -n R`` worker per configuration, then the summary."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from hpcfl.bench.scaling.defaults import PROBE_FILE, ROWS_FILE
from hpcfl.bench.scaling.measure import probe_allreduce, slurm_meta, usable_cores, world_info
from hpcfl.bench.scaling.report import summarize
from hpcfl.bench.scaling.world import base_config, world_points


def _mpiexec(args: argparse.Namespace) -> str:
    if args.mpiexec:
        return args.mpiexec
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        from hpcfl.errors import CommError

        raise CommError("mpiexec not found next to python or on PATH; pass --mpiexec or --ranks 1")
    return found


def _worker_argv(args: argparse.Namespace, model: str, clients: int, probe_only: bool) -> list[str]:
    argv = [sys.executable, "-m", "hpcfl", "bench", "scaling"]
    if args.config:
        argv.append(str(args.config))
    argv += ["--worker", "--out", str(args.out), "--models", model, "--clients", str(clients)]
    argv += ["--clients-per-rank", "0", "--rounds", str(args.rounds), "--warmup", str(args.warmup)]
    argv += ["--threads", str(args.threads), "--test-samples", str(args.test_samples)]
    argv += ["--eval-every", str(args.eval_every), "--probe-budget", str(args.probe_budget)]
    if args.samples_per_client:
        argv += ["--samples-per-client", str(args.samples_per_client)]
    if probe_only:
        argv += ["--probe-only"]
    else:
        argv += ["--no-probe"]
    if args.set:
        argv += ["--set", *args.set]
    return argv


def _spawn(args: argparse.Namespace, ranks: int, argv: list[str]) -> tuple[int, str, float]:
    env = dict(os.environ)
    if args.threads > 0:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    root = str(Path(__file__).resolve().parents[3])  # the directory holding the hpcfl package
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    cmd = argv if ranks == 1 else [_mpiexec(args), "-n", str(ranks), *argv]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        return 124, out + f"\n(timed out after {args.timeout} s)", time.perf_counter() - t0
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0


def run_launcher(args: argparse.Namespace) -> int:
    """Launcher mode: one worker launch per configuration (+ the 2-rank allreduce probe)."""
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if not args.append:
        for name in (ROWS_FILE, PROBE_FILE):
            if (out / name).exists():
                (out / name).replace(out / (name + ".prev"))
    base = base_config(args)
    configs = [(r, m, k) for r in args.ranks for m, k in world_points(args, base, r)]
    plan = configs * args.repeats  # whole passes, so a busy spell on shared cores is not one config's
    cores = len(usable_cores())
    print(
        f"hpcfl bench scaling: {len(configs)} configurations x {args.repeats} pass(es), ranks "
        f"{args.ranks}, {cores} cores here, {args.rounds} rounds each (first {args.warmup} dropped) "
        f"-> {out}",
        flush=True,
    )
    failed = 0
    for i, (r, m, k) in enumerate(plan, 1):
        over = " (oversubscribed)" if r * max(args.threads, 1) > cores else ""
        print(f"[{i}/{len(plan)}] {m} K={k} R={r}{over} ...", end=" ", flush=True)
        rc, text, wall = _spawn(args, r, _worker_argv(args, m, k, probe_only=False))
        if rc != 0:
            failed += 1
            tail = "\n    ".join(text.strip().splitlines()[-8:])
            print(f"FAILED (exit {rc}) after {wall:.0f}s:\n    {tail}", flush=True)
            continue
        line = [s for s in text.splitlines() if s.startswith("hpcfl: ")]
        print((line[-1].split(": ", 2)[-1] if line else "done") + f"  [{wall:.0f}s]", flush=True)
    if not args.no_probe and max(args.ranks) >= 2:
        print("allreduce probe at 2 ranks ...", end=" ", flush=True)
        rc, text, _ = _spawn(args, 2, _worker_argv(args, args.models[0] if args.models else "mlp", 2, True))
        line = [s for s in text.splitlines() if "probe" in s]
        print(line[-1].split(": ", 2)[-1] if rc == 0 and line else f"FAILED (exit {rc}): {text[-300:]}")
    summarize(out, out, args)
    return 1 if failed == len(plan) else 0


def run_probe_only(args: argparse.Namespace) -> int:
    """``--probe-only``: just the allreduce micro-benchmark at the current world."""
    from hpcfl.comm import get_comm
    from hpcfl.files import append_jsonl

    comm = get_comm("auto")
    if comm.size < 2:
        from hpcfl.errors import CommError

        raise CommError("the allreduce probe needs at least 2 ranks: mpiexec -n 2 ... --probe-only")
    info = world_info(comm, args.threads)
    probe = probe_allreduce(comm, budget_s=args.probe_budget)
    if comm.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        probe.update(info, **slurm_meta(), time=time.time())
        append_jsonl(args.out / PROBE_FILE, probe)
        print(
            f"hpcfl: allreduce probe at R={comm.size}: alpha {probe['alpha_s'] * 1e6:.2f} us, "
            f"beta {probe['beta_Bps'] / 1e9:.2f} GB/s",
            flush=True,
        )
    return 0
