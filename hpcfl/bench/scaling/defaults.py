"""Defaults and file names of ``hpcfl bench scaling``, shared by its modules."""

from __future__ import annotations

from pathlib import Path

HELP = "round throughput vs ranks × clients × models: strong/weak efficiency, time split, projection"
DEFAULT_OUT = Path("benchmarks/out/scaling")
ROWS_FILE = "scaling_rows.jsonl"
PROBE_FILE = "allreduce_probe.jsonl"
DEFAULT_MODELS = ("simplecnn", "resnet8")
DEFAULT_CLIENTS = (10, 50, 100)
DEFAULT_CLIENTS_PER_RANK = 25
DEFAULT_RANKS = (1, 2, 4)
IB_ALPHA_S = 2e-6  # InfiniBand-like latency per message step
IB_BETA_BPS = 10e9  # InfiniBand-like bandwidth, bytes/s (~HDR 100 Gb/s after protocol overheads)
PROJECTION_LABEL = "PROJECTION (latency/bandwidth model from measured per-client time; not measured)"
PROBE_SIZES = tuple(8 * 4**i for i in range(12))  # 8 B … 32 MiB
# environment variables present only in a process started by an MPI launcher or by srun (the
# batch script of an sbatch job has SLURM_* but neither of these)
LAUNCHED_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_ID")
