"""``hpcfl bench scaling``: round throughput over ranks, clients and models, and a projection.

What is measured, and why this way
----------------------------------
One *configuration* is (model, K clients, R ranks, T threads per rank). It runs the real round
loop (:func:`hpcfl.runner.rounds.run_rounds` over :func:`hpcfl.runner.federation.build_federation`,
exactly what ``hpcfl run`` executes, minus checkpoints and file output) for ``--rounds`` rounds of
FedAvg with one local epoch. The first ``--warmup`` round(s) are dropped (allocator, thread pools
and MPI connections warm up there); every later round is timed. The loop's own metrics row — the
one ``hpcfl run`` appends to ``metrics.jsonl``: ``compute_s`` (local updates), ``allreduce_s`` and
``eval_s`` (server step + sharded evaluation) — is collected from **every** rank, not only rank 0,
because under a synchronous allreduce rank 0's ``allreduce_s`` also contains the time it waited
for slower ranks. Per timed round:

- ``compute_s``   = max over ranks of the local work (the critical path),
- ``allreduce_s`` = min over ranks of the allreduce time (the collective itself, seen by the rank
  that arrived last), ``allreduce_wait_s`` = max − min (idle time of faster ranks: imbalance),
- ``train_s``     = max over ranks of compute + allreduce (the training part of a round),
- ``eval_s``      = max over ranks of the evaluation.

Each is the median over the timed rounds. Evaluation runs in every timed round so its cost is
known, but a run evaluates only every ``--eval-every`` N rounds, so a round is charged
``round_s = train_s + eval_s / N`` (default N = 5). From that:

- rounds/s = 1 / round_s; samples/s = training samples of a round / round_s;
- strong-scaling efficiency at fixed K: E_s(R) = R₀·T(R₀, K) / (R·T(R, K)), R₀ the smallest rank
  count measured (1 in the default sweep, so E_s = T(1)/(R·T(R)));
- weak-scaling efficiency with K ∝ R: E_w(R) = T(R₀, K·R₀/R) / T(R, K) where that base point was
  measured (the default sweep adds K = 25·R, so (1, 25) → (2, 50) → (4, 100) is one weak series,
  (1, 50) → (2, 100) another). E_w can exceed 1: the test set is fixed, so each rank's
  evaluation shard shrinks as R grows.

The data is synthetic (:func:`hpcfl.data.synthetic.make_synthetic`, FMNIST-shaped 1×28×28, 10
classes) with a FIXED number of samples per client (``--samples-per-client``, default 200), so the
work of a round is proportional to K and strong and weak scaling come from the same sweep. The
test set (``--test-samples``) has a fixed size. Threads: one torch thread per rank by default
(``--threads``); a configuration with more ranks × threads on a node than that node has cores is
labelled ``oversubscribed`` (MPICH lets R exceed the cores; the ranks then time-share cores, and
MPICH's busy-polling in the allreduce takes cycles from ranks still computing).

Modes
-----
- **launcher** (default when started without MPI): for every configuration spawn
  ``mpiexec -n R python -m hpcfl bench scaling --worker ...`` (R = 1 runs without mpiexec), plus an
  allreduce micro-benchmark at 2 ranks; then summarise. ``--repeats N`` makes N whole passes
  over the configurations (the fastest of each is reported), so a busy spell on shared cores
  lands on every configuration rather than on one.
- **world** (started by ``srun``/``mpiexec`` — as ``slurm/scaling_sweep.sbatch`` does — or with
  ``--mode world``): measure the current world only (every model × K of the options, K ≥ R) and
  append one row per configuration, with SLURM_JOB_ID, node count and ranks, to
  ``OUT/scaling_rows.jsonl``, so repeated jobs at different node counts accumulate; a requeued job
  skips the configurations it already measured. With ≥ 2 ranks the allreduce probe runs too.
- **summarize** (``--summarize DIR``): rebuild table, CSV, JSON and PNGs from every
  ``scaling_rows.jsonl`` / ``allreduce_probe.jsonl`` under DIR (when a configuration was measured
  more than once, the fastest measurement is kept: noise only ever adds time).

Projection (a model, not a measurement)
---------------------------------------
Round time at R ranks and K clients::

    T(R, K) = ceil(K/R)·c + t_ar(R, 4·(L + K + 2)) + (e₁/R + t_ar(R, 24)) / N
    t_ar(R, n) = 2(R−1)·α + 2(R−1)/R · n/β                  (ring allreduce)

c is the measured per-client local-update time (median of compute_s / ceil(K/R) over the
model's rows at the smallest measured R), ``ceil`` models stragglers (the rank with the most
clients sets the pace), L the model's float32 parameters (the allreduced buffer also carries K
non-finite flags, the weight and the loss), e₁ the evaluation time at one rank (sharded: /R; its 3 float64 counts are
allreduced). α and β come from two sources, both reported: (1) the allreduce micro-benchmark
(``allreduce_probe.jsonl``: float32 allreduce over message sizes 8 B … 32 MiB, best of the
repeats, fitted to the ring formula by relative least squares) — on this machine that is MPICH
over shared memory inside ONE node, so it is optimistic for a network; under SLURM across nodes
the probe with the most nodes is used; (2) an InfiniBand-like α = 2 µs, β = 10 GB/s (typical
of HDR/NDR fabrics after MPI overheads; ``--ib-alpha``/``--ib-beta`` change it). The
projection covers R = 1 … ``--project-ranks`` (512) for strong scaling at K = 1000 and weak
scaling at K = 10·R. It ignores per-rank jitter (real stragglers), memory-bandwidth contention
between ranks of a node, hierarchical (node-aware) allreduce algorithms and start-up.

Outputs in ``--out`` (default ``benchmarks/out/scaling``): ``scaling_rows.jsonl`` (raw rows),
``allreduce_probe.jsonl``, ``scaling.csv``, ``scaling.json`` (rows + projection + method),
``scaling.png`` (strong / weak efficiency and projected rounds/s per model) and
``scaling_time_split.png`` (stacked compute / allreduce / evaluation per configuration).

Code layout: ``defaults`` (options and file names), ``perfmodel`` (pure arithmetic: efficiencies,
ring-allreduce model, projection), ``measure`` (inside one world: its layout, one configuration's
rounds through the real round loop, the allreduce probe), ``world`` and ``launcher`` (the two ways
of running a sweep), ``aggregate`` (raw rows into report rows and projection), ``report`` and
``plots`` (table, CSV, JSON, PNG), ``cli`` (options and entry points).
"""

from hpcfl.bench.scaling.aggregate import build_projection as build_projection
from hpcfl.bench.scaling.aggregate import summarize_rows as summarize_rows
from hpcfl.bench.scaling.cli import add_arguments as add_arguments
from hpcfl.bench.scaling.cli import main as main
from hpcfl.bench.scaling.cli import run_cli as run_cli
from hpcfl.bench.scaling.defaults import HELP as HELP
from hpcfl.bench.scaling.defaults import LAUNCHED_VARS as LAUNCHED_VARS
from hpcfl.bench.scaling.defaults import PROBE_FILE as PROBE_FILE
from hpcfl.bench.scaling.defaults import PROBE_SIZES as PROBE_SIZES
from hpcfl.bench.scaling.defaults import PROJECTION_LABEL as PROJECTION_LABEL
from hpcfl.bench.scaling.defaults import ROWS_FILE as ROWS_FILE
from hpcfl.bench.scaling.measure import measure_point as measure_point
from hpcfl.bench.scaling.measure import probe_allreduce as probe_allreduce
from hpcfl.bench.scaling.perfmodel import ComputeModel as ComputeModel
from hpcfl.bench.scaling.perfmodel import Network as Network
from hpcfl.bench.scaling.perfmodel import fit_alpha_beta as fit_alpha_beta
from hpcfl.bench.scaling.perfmodel import powers_of_two as powers_of_two
from hpcfl.bench.scaling.perfmodel import project as project
from hpcfl.bench.scaling.perfmodel import projected_round as projected_round
from hpcfl.bench.scaling.perfmodel import ring_allreduce_s as ring_allreduce_s
from hpcfl.bench.scaling.perfmodel import strong_efficiency as strong_efficiency
from hpcfl.bench.scaling.perfmodel import weak_efficiency as weak_efficiency
from hpcfl.bench.scaling.report import summarize as summarize

__all__ = [
    "HELP",
    "LAUNCHED_VARS",
    "PROBE_FILE",
    "PROBE_SIZES",
    "PROJECTION_LABEL",
    "ROWS_FILE",
    "ComputeModel",
    "Network",
    "add_arguments",
    "build_projection",
    "fit_alpha_beta",
    "main",
    "measure_point",
    "powers_of_two",
    "probe_allreduce",
    "project",
    "projected_round",
    "ring_allreduce_s",
    "run_cli",
    "strong_efficiency",
    "summarize",
    "summarize_rows",
    "weak_efficiency",
]
