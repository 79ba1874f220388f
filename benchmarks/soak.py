"""A soak (issue 63): does memory or disk grow over a long run of many clients?

SCAFFOLD with its control variates in the on-disk client-state store (``client_state_memory:
disk``), and FedBuff of the same size (concurrency = clients per round, K = 10), on Fashion-MNIST
with the MLP, ``dir:0.3`` (``--partition``; at 10,000 clients no per-class Dirichlet draw gives every
client a sample, so the full soak takes ``client-dir:0.3``: 6 samples a client, classes ~ Dir(0.3)). The process's resident memory (``VmRSS`` of ``/proc/self/status``) and the
run directory's size on disk are sampled after every round, from inside the round loop's own hook:
the runner reads its stop request once per round on every rank, and :class:`RoundProbe` is a stop
request that records the two figures when it is read (and never asks to stop).

    python benchmarks/soak.py --partition client-dir:0.3         # the full soak: 10,000 x 1,000 x 100
    python benchmarks/soak.py --clients 1000 --rounds 100 --tag smoke

Each run is its own process (one RSS curve per run). Goal: RSS after the last round within 5 % of RSS
after round 100 (or after the first tenth of a shorter run), and the run directory no larger at the
end than after that round, beyond the checkpoints it keeps (``KEEP`` complete ones). Writes
``benchmarks/results/soak_cpu[_TAG].{json,png}``: per run ``clients``, ``rounds``,
``clients_per_round``, ``rss_mb`` (one value per round) and ``run_dir_mb`` (likewise), and the
growth figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hpcfl.bench.machine import with_machine

RESULTS = Path(__file__).resolve().parent / "results"
OUT = Path(__file__).resolve().parent / "out" / "soak"


def rss_mb() -> float:
    """This process's resident memory now, in MiB (``VmRSS``; the peak is ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def dir_mb(path: Path) -> float:
    """The disk space the files under ``path`` take (allocated blocks), in MiB."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:  # a checkpoint renamed or removed meanwhile
                pass
    return total / 2**20


def _probe_class() -> type:
    from hpcfl.runner import StopRequest

    class RoundProbe(StopRequest):
        """A stop request that samples RSS and the run directory's size each time the round loop's
        hook reads it (once per round) and never asks to stop."""

        def __init__(self, run_dir: Path) -> None:
            super().__init__()
            self.run_dir = run_dir
            self.rss: list[float] = []
            self.disk: list[float] = []
            self.parts: list[tuple[float, float, float]] = []  # (checkpoints, client-state store, rest)
            self.wall: list[float] = []
            self._t0 = time.perf_counter()

        @property  # type: ignore[override]
        def requested(self) -> bool:
            self.rss.append(round(rss_mb(), 2))
            total = dir_mb(self.run_dir)
            ckpt = dir_mb(self.run_dir / "checkpoints")
            store = sum(dir_mb(p) for p in self.run_dir.glob("client_states_*.zarr"))
            self.disk.append(round(total, 3))
            self.parts.append((round(ckpt, 3), round(store, 3), round(total - ckpt - store, 3)))
            self.wall.append(round(time.perf_counter() - self._t0, 2))
            return False

        @requested.setter
        def requested(self, value: bool) -> None:
            pass

    return RoundProbe


def config(
    kind: str, clients: int, rounds: int, per_round: int, data: str | None, partition: str = "dir:0.3"
) -> dict[str, Any]:
    """The soak's config of run ``kind`` (``scaffold`` or ``fedbuff``)."""
    cfg: dict[str, Any] = dict(
        name=f"soak_{kind}_{clients}x{rounds}",
        algorithm=kind,
        model="mlp",
        dataset="fashion-mnist",
        partition=partition,
        num_clients=clients,
        clients_per_round=per_round,
        rounds=rounds,
        lr=0.05,
        batch_size=10,
        local_steps=5,
        seed=0,
        threads=1,
        progress=False,
        eval_every=max(1, rounds // 20),
        checkpoint_every=max(1, rounds // 10),
    )
    if data is not None:
        cfg["data_root"] = data
    if kind == "scaffold":
        cfg["client_state_memory"] = "disk"
    else:
        cfg["params"] = {"concurrency": per_round, "buffer_size": 10}
    return cfg


def one(
    kind: str,
    clients: int,
    rounds: int,
    per_round: int,
    data: str | None,
    reference: int | None = None,
    partition: str = "dir:0.3",
) -> dict[str, Any]:
    """One run in this process; its per-round samples and growth figures."""
    from hpcfl.config import config_from_dict
    from hpcfl.runner import run_experiment
    from hpcfl.runner.checkpoint import KEEP

    cfg = config(kind, clients, rounds, per_round, data, partition)
    run_dir = OUT / cfg["name"]
    probe = _probe_class()(run_dir)
    t0 = time.perf_counter()
    result = run_experiment(config_from_dict(cfg), run_dir, overwrite=True, stop=probe)
    seconds = time.perf_counter() - t0
    ref = (reference or min(100, max(1, rounds // 10))) - 1  # round 100 (index 99), or the first tenth's
    rss, disk = probe.rss, probe.disk
    # RSS moves by a buffer's size from round to round (the allocator keeps a freed block until
    # the next one reuses it: FedBuff's pending updates, 32 MB at 100 in flight), so beside the
    # single samples: the largest RSS of the last ``span`` rounds over that of the ``span`` ending at ref
    span = max(1, min(50, (ref + 1) // 2))
    window = max(rss[-span:]) / max(rss[ref + 1 - span : ref + 1]) - 1
    ckpt, store, rest = (list(v) for v in zip(*probe.parts, strict=True))
    return {
        "algorithm": kind,
        "clients": clients,
        "rounds": rounds,
        "clients_per_round": per_round,
        "partition": partition,
        "rounds_done": result.rounds_done,
        "reference_round": ref + 1,
        "rss_mb": rss,
        "run_dir_mb": disk,
        "wall_s": probe.wall,
        "checkpoints_mb": ckpt,
        "client_store_mb": store,
        "other_mb": rest,
        "rss_growth": round(rss[-1] / rss[ref] - 1, 4),
        "rss_window_growth": round(window, 4),
        "rss_window_rounds": span,
        "run_dir_growth": round(disk[-1] / disk[ref] - 1, 4),
        "other_growth_mb": round(rest[-1] - rest[ref], 3),
        "checkpoint_every": cfg["checkpoint_every"],
        "checkpoints_kept": KEEP,
        "final_test_accuracy": result.metrics[-1].get("test_accuracy"),
        "seconds": round(seconds, 1),
    }


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        label = f"{run['algorithm']} ({run['clients']:,} clients, {run['clients_per_round']}/round)"
        x = range(1, len(run["rss_mb"]) + 1)
        a.plot(x, run["rss_mb"], label=label)
        (line,) = b.plot(x, run["run_dir_mb"], label=label)
        if max(run["client_store_mb"]) > 0:
            b.plot(x, run["client_store_mb"], ls=":", color=line.get_color(), label="its client-state store")
    a.set(xlabel="round", ylabel="RSS (MiB)", title="process resident memory after each round")
    b.set(xlabel="round", ylabel="MiB on disk", title="run directory after each round")
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=1_000)
    ap.add_argument("--per-round", type=int, default=100)
    ap.add_argument("--runs", default="scaffold,fedbuff", help="comma-separated: scaffold, fedbuff")
    ap.add_argument("--tag", default="", help="suffix of the result files (soak_cpu_TAG.json)")
    ap.add_argument("--data-root", default=None, help="default: $HPCFL_DATA")
    ap.add_argument(
        "--partition",
        default="dir:0.3",
        help="dir:0.3 (the default) cannot give 10,000 clients of Fashion-MNIST a sample each (no draw "
        "in 1,000 does): use client-dir:0.3 there (Hsu et al. 2019: N/K samples a client, classes ~ Dir)",
    )
    ap.add_argument("--reference", type=int, default=None, help="the round growth is measured from (100)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:  # one run, in its own process
        out = one(
            args.child,
            args.clients,
            args.rounds,
            args.per_round,
            args.data_root,
            args.reference,
            args.partition,
        )
        print(json.dumps(out), flush=True)
        return 0
    runs = []
    for kind in args.runs.split(","):
        cmd = [sys.executable, __file__, "--child", kind, "--clients", str(args.clients)]
        cmd += ["--rounds", str(args.rounds), "--per-round", str(args.per_round)]
        if args.data_root:
            cmd += ["--data-root", args.data_root]
        if args.reference:
            cmd += ["--reference", str(args.reference)]
        cmd += ["--partition", args.partition]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-3000:])
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        runs.append(run)
        print(
            f"{kind}: {run['seconds']} s, RSS {run['rss_mb'][run['reference_round'] - 1]:.1f} -> "
            f"{run['rss_mb'][-1]:.1f} MiB ({run['rss_growth']:+.2%}; largest of the last "
            f"{run['rss_window_rounds']} rounds vs those to round {run['reference_round']}: "
            f"{run['rss_window_growth']:+.2%}), run dir {run['run_dir_mb'][run['reference_round'] - 1]:.1f} -> "
            f"{run['run_dir_mb'][-1]:.1f} MiB (checkpoints {run['checkpoints_mb'][-1]:.1f}, client-state "
            f"store {run['client_store_mb'][-1]:.1f}, the rest {run['other_growth_mb']:+.2f} MiB since)",
            flush=True,
        )
    first = runs[0]
    summary = {
        "clients": first["clients"],
        "rounds": first["rounds"],
        "clients_per_round": first["clients_per_round"],
        "partition": first["partition"],
        "rss_mb": first["rss_mb"],
        "run_dir_mb": first["run_dir_mb"],
        "runs": runs,
        "cpu_count": os.cpu_count(),
        "load_1min": os.getloadavg()[0],
    }
    stem = "soak_cpu" + (f"_{args.tag}" if args.tag else "")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(with_machine(summary)) + "\n")
    plot(runs, RESULTS / f"{stem}.png")
    print(f"wrote {RESULTS / stem}.json and .png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
