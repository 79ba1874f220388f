"""Issue 50: the cost of bounding MPI collectives by a deadline (nonblocking + polling) against the
blocking call, for the round's allreduce.

    mpiexec -n 2 python benchmarks/comm_deadline_overhead.py [--repeats 200] [--out FILE.json]

For each message size (1 KB .. 8 MB of float64), ``--repeats`` calls of ``MPI_Allreduce`` (in place,
blocking) and of :meth:`hpcfl.comm.mpi.MPIComm.allreduce` (``MPI_Iallreduce`` polled by
:func:`hpcfl.comm.deadline.poll`) alternate after a warm-up, every call preceded by a barrier so
both ranks enter together; rank 0 prints the median and p90 microseconds of each and the median's
overhead. Both ranks measure the same thing, so their figures agree within noise; rank 0 reports.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from mpi4py import MPI

from hpcfl.comm.mpi import MPIComm

SIZES = [1 << 10, 1 << 13, 1 << 16, 1 << 19, 1 << 21, 1 << 23]  # bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    comm = MPIComm(timeout=60)
    world = MPI.COMM_WORLD
    rows = []
    for size in SIZES:
        x = torch.ones(size // 8, dtype=torch.float64)
        times: dict[str, list[float]] = {"blocking": [], "deadline": []}
        for i in range(args.repeats + 10):
            for name in ("blocking", "deadline"):
                world.Barrier()
                t = time.perf_counter()
                if name == "blocking":
                    world.Allreduce(MPI.IN_PLACE, x.numpy())
                else:
                    comm.allreduce(x)
                if i >= 10:
                    times[name].append(time.perf_counter() - t)
                x.fill_(1.0)
        row = {"bytes": size}
        for name, ts in times.items():
            row[f"{name}_median_us"] = float(np.median(ts) * 1e6)
            row[f"{name}_p90_us"] = float(np.percentile(ts, 90) * 1e6)
        row["overhead_median_pct"] = 100 * (row["deadline_median_us"] / row["blocking_median_us"] - 1)
        rows.append(row)
        if comm.rank == 0:
            print(
                f"{size:>9} B  blocking {row['blocking_median_us']:9.1f} us (p90 {row['blocking_p90_us']:9.1f})"
                f"  deadline {row['deadline_median_us']:9.1f} us (p90 {row['deadline_p90_us']:9.1f})"
                f"  overhead {row['overhead_median_pct']:+6.1f} %",
                flush=True,
            )
    if comm.rank == 0 and args.out:
        with open(args.out, "w") as fh:
            json.dump({"ranks": comm.size, "repeats": args.repeats, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
