"""Submission overhead of a sweep as ONE job array against the same points as single jobs.

Stands up the private localhost SLURM of the test harness (tests/cluster/slurm.py; needs root and
Debian's slurm packages, ``bash .ci/setup_slurm.sh`` installs them) and, for an N-point grid of a
small synthetic config (lr × partition × seeds), measures from the command's start until every
task is in the queue:

- ``sweep``: one ``hpcfl sweep ... --executor slurm`` (validates all N points, one ``sbatch`` of
  an N-task array, writes the N job records);
- ``singles``: N ``hpcfl submit`` commands, one per point (the same configs and run directories),
  one after another as a shell loop would run them.

Every job is held with ``--sbatch begin=now+1hour`` so that nothing runs while the queue fills
(and all are cancelled afterwards): what is timed is submission alone. Prints the seconds per
point of each and their ratio; writes CSV + JSON.

    python benchmarks/sweep_submission.py --points 48 --repeats 3 --out benchmarks/out/sweep_submission
    python benchmarks/sweep_submission.py --quick        # 4 points, 1 repeat: checks that it runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpcfl.bench.machine import with_machine, with_machine_columns  # noqa: E402
from hpcfl.files import write_csv  # noqa: E402
from tests.cluster.slurm import SlurmCluster, start_cluster  # noqa: E402
from tests.helpers import synthetic_config  # noqa: E402

HOLD = ["--sbatch", "begin=now+1hour", "--time", "10", "-c", "1"]


def _grid(points: int) -> tuple[list[str], list[dict[str, str]]]:
    """``--grid``/``--seeds`` options for ``points`` points (2 partitions × 4 lr × seeds, or fewer),
    and each point's ``--set`` values for the single submissions, in the sweep's order."""
    lrs = ["0.01", "0.02", "0.05", "0.1"]
    parts = ["dir:0.1", "dir:0.5"]
    if points % 8 == 0:
        seeds = points // 8
    elif points % 2 == 0 and points <= 8:
        lrs, seeds = lrs[: points // 2], 1
    else:
        raise SystemExit("--points must be a multiple of 8, or 2, 4, 6")
    grid = ["--grid", f"partition={','.join(parts)}", f"lr={','.join(lrs)}", "--seeds", str(seeds)]
    sets = [{"partition": p, "lr": lr, "seed": str(7 + s)} for p in parts for lr in lrs for s in range(seeds)]
    return grid, sets


def _queued(cluster: SlurmCluster) -> int:
    """Jobs and array tasks in the queue (pending arrays expanded, ``squeue -r``)."""
    out = cluster.run("squeue", "-h", "-r", "-o", "%i").stdout
    return len([line for line in out.splitlines() if line.strip()])


def _wait_queued(cluster: SlurmCluster, n: int, t0: float, timeout: float = 600.0) -> float:
    while time.monotonic() - t0 < timeout:
        if _queued(cluster) >= n:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise TimeoutError(f"fewer than {n} tasks queued after {timeout:.0f} s")


def _cancel_all(cluster: SlurmCluster) -> None:
    cluster.run("scancel", "--user", "root", check=False)
    deadline = time.monotonic() + 60
    while _queued(cluster) and time.monotonic() < deadline:
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--points", type=int, default=48, help="grid points (a multiple of 8; default 48)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="4 points, 1 repeat: only checks that it runs")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/out/sweep_submission")
    args = parser.parse_args()
    if args.quick:
        args.points, args.repeats = 4, 1
    grid, sets = _grid(args.points)
    args.out.mkdir(parents=True, exist_ok=True)
    hpcfl = [sys.executable, "-m", "hpcfl"]
    cluster = start_cluster()
    rows = []
    try:
        env = cluster.subprocess_env({"PYTHONPATH": str(REPO)})
        for rep in range(args.repeats):
            with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
                cfg = synthetic_config(Path(tmp), rounds=3, algorithm="fedavg")
                sweep_dir = Path(tmp) / "sweep"
                t0 = time.monotonic()
                argv = [
                    *hpcfl,
                    "sweep",
                    str(cfg),
                    *grid,
                    "--out",
                    str(sweep_dir),
                    "--executor",
                    "slurm",
                    *HOLD,
                ]
                proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
                if proc.returncode != 0:
                    raise SystemExit(f"hpcfl sweep failed: {proc.stderr.strip()}")
                sweep_s = _wait_queued(cluster, args.points, t0)
                _cancel_all(cluster)

                t0 = time.monotonic()
                for i, values in enumerate(sets):
                    pairs = [f"{k}={v}" for k, v in values.items()]
                    argv = [
                        *hpcfl,
                        "submit",
                        str(cfg),
                        "--set",
                        *pairs,
                        "--run-dir",
                        str(Path(tmp) / f"single{i}"),
                    ]
                    proc = subprocess.run(
                        [*argv, *HOLD], env=env, capture_output=True, text=True, timeout=600
                    )
                    if proc.returncode != 0:
                        raise SystemExit(f"hpcfl submit failed: {proc.stderr.strip()}")
                singles_s = _wait_queued(cluster, args.points, t0)
                _cancel_all(cluster)
            row = {
                "repeat": rep,
                "points": args.points,
                "sweep_s": sweep_s,
                "singles_s": singles_s,
                "sweep_per_point_s": sweep_s / args.points,
                "singles_per_point_s": singles_s / args.points,
                "ratio_singles_over_sweep": singles_s / sweep_s,
            }
            rows.append(row)
            print(
                f"repeat {rep}: sweep {sweep_s:.2f} s ({row['sweep_per_point_s']:.3f} s/point), "
                f"{args.points} singles {singles_s:.2f} s ({row['singles_per_point_s']:.3f} s/point)",
                flush=True,
            )
    finally:
        cluster.stop()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k not in ("repeat", "points")}
    print(f"\n| {args.points} points, median of {len(rows)} | seconds |\n|---|---:|")
    for k, v in med.items():
        print(f"| {k} | {v:.3f} |")
    print(f"\n{args.points} single submissions / one sweep array: {med['ratio_singles_over_sweep']:.1f}x")
    rows = with_machine_columns(rows)
    write_csv(args.out / "sweep_submission.csv", rows)
    (args.out / "sweep_submission.json").write_text(
        json.dumps(with_machine({"rows": rows, "median": med}), indent=2)
    )
    print(f"written: {args.out}/sweep_submission.csv, .json")


if __name__ == "__main__":
    main()
