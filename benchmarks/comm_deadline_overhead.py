"""Issue 50: the cost of bounding MPI collectives by a deadline (nonblocking + polling) against the
blocking call, for the round's allreduce.

    mpiexec -n 2 python benchmarks/comm_deadline_overhead.py [--repeats 200] [--out FILE]

``--out FILE`` writes FILE.json and FILE.csv (the same rows). Across two emulated nodes (TCP over
a veth link instead of shared memory), ``benchmarks/multinode_scaling.py --deadline-overhead`` runs
this script under srun on its cluster.

For each message size (1 KB .. 8 MB of float64), ``--repeats`` calls of ``MPI_Allreduce`` (in place,
blocking) and of :meth:`hpcfl.comm.mpi.MPIComm.allreduce` (``MPI_Iallreduce`` polled by
:func:`hpcfl.comm.deadline.poll`) alternate after a warm-up, every call preceded by a barrier so
both ranks enter together; rank 0 prints the median and p90 microseconds of each and the median's
overhead. Both ranks measure the same thing, so their figures agree within noise; rank 0 reports.

``--late`` adds the cost of waiting past the deadline (issue 61): the last rank computes ``--late``
seconds before each allreduce while the others wait in it, once on a communicator whose deadline
(60 s) never passes and once on one whose deadline (``--knock-after``, 0.02 s) passes again and
again, so the waiting ranks knock on every rank each time (:meth:`MPIComm._silent`). Rank 0 reports
the median time of the waiting allreduce in both, the rounds of knocks and the median seconds of
one round (``late_*`` rows).
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
    parser.add_argument("--late", type=float, default=0.0, help="the late rank's compute seconds (0: skip)")
    parser.add_argument("--late-repeats", type=int, default=20)
    parser.add_argument("--knock-after", type=float, default=0.02)
    args = parser.parse_args()
    comm = MPIComm(timeout=60)
    world = MPI.COMM_WORLD
    rows = []
    if args.late > 0:
        rows += late_rows(comm, MPIComm(world.Dup(), timeout=args.knock_after), args)
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
        row: dict[str, float | str] = {"bytes": size}
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
        import socket
        from pathlib import Path

        from hpcfl.bench.machine import with_machine, with_machine_columns
        from hpcfl.files import write_csv

        hosts = sorted(set(comm.hosts))
        out = Path(args.out)
        meta = {"ranks": comm.size, "hosts": hosts, "repeats": args.repeats, "hostname": socket.gethostname()}
        out.with_suffix(".json").write_text(json.dumps(with_machine({**meta, "rows": rows}), indent=1) + "\n")
        rows = with_machine_columns(rows)
        fields = list(dict.fromkeys(k for row in rows for k in row))  # the late rows have their own
        table = [{"hosts": " ".join(hosts), **row} for row in rows]
        write_csv(out.with_suffix(".csv"), table, ["hosts", *fields], restval="")


def late_rows(plain: MPIComm, knocking: MPIComm, args: argparse.Namespace) -> list[dict]:
    """The waiting allreduce's time with and without knocks while the last rank computes late."""
    knock_s: list[float] = []
    silent = knocking._silent

    def timed() -> set[int]:
        t = time.perf_counter()
        missing = silent()
        knock_s.append(time.perf_counter() - t)
        return missing

    knocking._silent = timed  # type: ignore[method-assign]
    x = torch.ones(1 << 13, dtype=torch.float64)  # 64 KB
    a = torch.randn(128, 128, dtype=torch.float64)
    times: dict[str, list[float]] = {"plain": [], "knocking": []}
    for i in range(args.late_repeats + 2):
        for name, comm in (("plain", plain), ("knocking", knocking)):
            MPI.COMM_WORLD.Barrier()
            t = time.perf_counter()
            if comm.rank == comm.size - 1:
                until = time.monotonic() + args.late
                while time.monotonic() < until:  # compute, the main thread busy
                    a = torch.tanh(a @ a)
            comm.allreduce(x)
            if i >= 2:
                times[name].append(time.perf_counter() - t)
            x.fill_(1.0)
    rows = []
    if plain.rank == 0:
        for name, ts in times.items():
            row = {
                "bytes": f"late_{name}",
                "median_s": float(np.median(ts)),
                "p90_s": float(np.percentile(ts, 90)),
            }
            if name == "knocking":
                row |= {"knock_rounds": len(knock_s), "knock_round_median_s": float(np.median(knock_s))}
            rows.append(row)
            print(
                f"late rank {args.late:g} s, {name:9}: "
                + ", ".join(f"{k} {v:.6g}" for k, v in row.items() if k != "bytes")
            )
    return rows


if __name__ == "__main__":
    main()
