"""``hpcfl bench entk``: eNTK feature throughput of every method against one training step.

For one model and batch, each method computes the (B, p) features of the same random batch
(dataset-shaped: 1×28×28 for simplecnn/mlp, 3×32×32 for the CIFAR models, 10 classes; symbol codes
of Shakespeare's 80-symbol vocabulary, L = 80, for the ``char-`` text models) in a fresh
subprocess, so one method's allocations never colour another's memory figure (``--in-process``
runs them all in this process instead: on a GPU each fresh process pays a CUDA start-up of ~4 s,
which is most of a lent GPU session's eNTK step; CUDA peak memory is still reset per method):

- ``loop`` / ``vmap`` / ``fused``: :func:`hpcfl.entk.entk_features` with that method;
- ``fused-graph`` (``--device cuda`` only): ``fused`` with ``cuda_graph=True``, full batches
  replayed as one CUDA graph (:mod:`hpcfl.entk.cuda_graph`). Its set-up runs two batches (the eager
  one that compiles the kernels, then the capture, checked against the eager batch), so every timed
  batch is a replay; its note says whether the graph is in use or why it fell back to eager. On
  the CPU it is refused (one line, exit 2): there it is ``fused``;
- ``opacus`` / ``opacus-functorch``: ``GradSampleModule(loss_reduction="sum")`` per-sample
  gradients in Opacus's two modes that form them — its per-layer hooks (the default) and
  ``force_functorch`` (``vmap`` per layer) — then the same coordinate gather (Opacus only records
  activations in train mode, so it runs in train mode, which is the same function for models
  without BatchNorm/dropout; BN models are skipped). Opacus's ghost clipping computes per-sample
  gradient norms without ever forming the gradients, so it cannot give eNTK coordinates and is not
  a method here (``benchmarks/privacy.py`` times it for the DP step, where it applies);
- ``backpack``: ``extend(model)`` + ``BatchGrad``, then the same gather;
- ``plain``: one batched forward + backward of Σ_b f_logit(x_b) (parameter gradients only) —
  the practical limit every method is compared with.

Timing: one warm-up, then ``--repeats`` timed runs; the best (minimum) time is reported together
with the median. All methods are run ``--rounds`` times, interleaved, and each keeps its best round
(peak memory: the largest of its rounds): the dev machine's cores are shared, so a busy spell
must not land on one method only, and the minimum is the stable figure. Each acceptance ratio is
also given per round (methods of one round run back to back, so they share the machine's state)
and as the median over rounds: on a host whose speed drifts by ±20% over minutes, the ratio of
two best-of-all-rounds figures taken at different times is the noisier statistic. ``loop``
runs ``--loop-samples`` samples and is reported per sample. Features are written into one
preallocated (B, p) buffer (the streaming use: batches go to the feature store one at a time).

OpenMP: ``--omp-wait-policy passive|active`` sets ``OMP_WAIT_POLICY`` for the timed processes
(default: the environment's; recorded in the JSON). It matters on cores shared with other
processes and it does not shift all methods alike, so compare only runs with the same policy:
measured on the 2-core dev box, passive waiting cut the fused Linear gather under heavy load
(load 12) from 2,184 to 107 ms but slowed plain training at light load (4,710 → 2,834 samples/s)
while speeding up vmap (189 → 521 samples/s).

Allocator: ``--keep-freed-memory`` runs every timed process with glibc's ``MALLOC_MMAP_THRESHOLD_``
and ``MALLOC_TRIM_THRESHOLD_`` raised (256 MiB / 1 GiB), so freed activations and per-sample
gradients stay in the heap instead of going back to the kernel and being page-faulted in again on
the next batch. It does not shift all methods alike. Measured on the 2-core dev box (simplecnn,
p = 1e5, batch 256, 2 threads, best of 3-5 rounds): in session 3 it took vmap from 829 to 1,934
samples/s (its chunks then held 350 MB of per-sample gradients, mostly page faults), BackPACK
from 505 to 1,025 and Opacus from 620 to 859, with fused unchanged within noise. Since vmap's
chunks stay below glibc's reused-heap bound (``hpcfl.entk.reference.VMAP_BLOCK_BYTES``) it
barely moves vmap (session 4: 2,217 → 2,246); BackPACK 667 → 1,725, Opacus 797 → 1,097, fused
5,260 → 6,026, plain 9,308 → 11,125. Default: the environment's allocator settings (recorded in
the JSON).

Peak memory: CUDA ``torch.cuda.max_memory_allocated`` above the steady state; CPU the process's
peak resident set (``VmHWM`` of ``/proc/self/status``, reset through ``/proc/self/clear_refs``
after set-up and warm-up) minus the resident set at that point — i.e. the extra memory the
method needs on top of model, inputs and output. (``tracemalloc`` does not see torch's
allocations.) Where the reset is not permitted the figure is the peak minus the pre-run RSS.

``vmap`` runs in chunks of :func:`hpcfl.entk.reference.vmap_chunk`: cache-sized on the CPU (as
measured above), on a GPU the largest chunk that fits the stated budget (half the free memory);
its row notes the chunk. The "best other" method that fused is compared with is chosen per device
(:data:`BEST_OTHER`): on the CPU the fastest of vmap, Opacus and BackPACK; on a GPU the fastest
Opacus mode, named (issue 39: the fair GPU baseline; vmap's figure is still in the table).

Writes ``entk_bench.csv``, ``entk_bench.json`` and ``entk_bench.png`` into ``--out`` and prints a
table plus the acceptance ratios of issue #3.
"""

from hpcfl.bench.entk.benchmark import DEFAULT_METHODS as DEFAULT_METHODS
from hpcfl.bench.entk.benchmark import run_benchmark as run_benchmark
from hpcfl.bench.entk.cli import HELP as HELP
from hpcfl.bench.entk.cli import add_arguments as add_arguments
from hpcfl.bench.entk.cli import main as main
from hpcfl.bench.entk.cli import run_cli as run_cli
from hpcfl.bench.entk.measure import KEEP_FREED_MEMORY as KEEP_FREED_MEMORY
from hpcfl.bench.entk.measure import time_method as time_method
from hpcfl.bench.entk.report import BEST_OTHER as BEST_OTHER
from hpcfl.bench.entk.report import best_other as best_other
from hpcfl.bench.entk.runners import METHODS as METHODS
from hpcfl.bench.entk.runners import OPACUS_MODES as OPACUS_MODES
from hpcfl.bench.entk.runners import bench_model as bench_model
from hpcfl.bench.entk.runners import input_shape as input_shape
from hpcfl.bench.entk.runners import model_and_batch as model_and_batch

__all__ = [
    "BEST_OTHER",
    "DEFAULT_METHODS",
    "HELP",
    "KEEP_FREED_MEMORY",
    "METHODS",
    "OPACUS_MODES",
    "add_arguments",
    "bench_model",
    "best_other",
    "input_shape",
    "main",
    "model_and_batch",
    "run_benchmark",
    "run_cli",
    "time_method",
]
