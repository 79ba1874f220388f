"""Submit-to-first-round latency of ``hpcfl submit`` on a real single-node SLURM.

Stands up the private localhost SLURM of the test harness (tests/cluster/slurm.py: munged,
slurmctld, slurmd, slurmdbd + MariaDB in a temp dir; needs root and Debian's slurm packages,
``bash .ci/setup_slurm.sh`` installs them) and measures, in one run:

- ``sbatch``: a bare ``sbatch --wrap true`` from submission to COMPLETED (the scheduler's floor);
- ``run``: ``hpcfl run`` started directly, from process start to its first metrics row (the
  floor without a scheduler: Python, torch, data and model set-up, one round);
- ``submit``: ``hpcfl submit`` (2 MPI ranks through submitit and ``srun --mpi=pmi2``), from the
  command's start to the first metrics row in the run directory.

The difference submit − run is what the scheduler path adds. Prints a table; writes CSV + JSON.

    python benchmarks/submit_latency.py --repeats 3 --out benchmarks/out/submit_latency
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
from tests.cluster.slurm import start_cluster  # noqa: E402
from tests.helpers import synthetic_config  # noqa: E402


def _first_row(run_dir: Path, t0: float, timeout: float = 300.0) -> float:
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() - t0 < timeout:
        if metrics.exists() and metrics.read_text().strip():
            return time.monotonic() - t0
        time.sleep(0.05)
    raise TimeoutError(f"no metrics row in {run_dir} after {timeout}s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/out/submit_latency")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    hpcfl = [sys.executable, "-m", "hpcfl"]
    cluster = start_cluster()
    rows = []
    try:
        env = cluster.subprocess_env({"PYTHONPATH": str(REPO)})
        for rep in range(args.repeats):
            with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
                tmp = Path(tmp)
                cfg = synthetic_config(tmp, rounds=3)
                t0 = time.monotonic()
                job = cluster.sbatch(wrap="true")
                cluster.wait_state(job, ["COMPLETED"], timeout=120)
                sbatch_s = time.monotonic() - t0

                t0 = time.monotonic()
                proc = subprocess.Popen([*hpcfl, "run", str(cfg), "--run-dir", str(tmp / "direct")], env=env)
                run_s = _first_row(tmp / "direct", t0)
                proc.wait(timeout=300)

                t0 = time.monotonic()
                sub = subprocess.run(
                    [
                        *hpcfl,
                        "submit",
                        str(cfg),
                        "--run-dir",
                        str(tmp / "slurm"),
                        "--ntasks-per-node",
                        "2",
                        "-c",
                        "1",
                        "--time",
                        "10",
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                if sub.returncode != 0:
                    raise SystemExit(f"hpcfl submit failed: {sub.stderr.strip()}")
                accepted_s = time.monotonic() - t0
                submit_s = _first_row(tmp / "slurm", t0)
                rows.append(
                    {
                        "repeat": rep,
                        "sbatch_true_s": sbatch_s,
                        "run_first_round_s": run_s,
                        "submit_accepted_s": accepted_s,
                        "submit_first_round_s": submit_s,
                        "scheduler_overhead_s": submit_s - run_s,
                    }
                )
                print(
                    f"repeat {rep}: sbatch {sbatch_s:.2f}s, run {run_s:.2f}s, submit accepted {accepted_s:.2f}s, "
                    f"submit first round {submit_s:.2f}s",
                    flush=True,
                )
                time.sleep(3)  # let the job's last rounds finish before the temp dir goes
    finally:
        cluster.stop()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "repeat"}
    print("\n| measure | median (s) |\n|---|---:|")
    for k, v in med.items():
        print(f"| {k} | {v:.2f} |")
    print(
        f"\nsubmit-to-first-round / direct run-to-first-round: {med['submit_first_round_s'] / med['run_first_round_s']:.2f}x"
    )
    rows = with_machine_columns(rows)
    write_csv(args.out / "submit_latency.csv", rows)
    (args.out / "submit_latency.json").write_text(
        json.dumps(with_machine({"rows": rows, "median": med}), indent=2)
    )
    print(f"written: {args.out}/submit_latency.csv, .json")


if __name__ == "__main__":
    main()
