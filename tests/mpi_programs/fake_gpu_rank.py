"""``python fake_gpu_rank.py GPUS HPCFL-ARGS...``: one rank of ``hpcfl HPCFL-ARGS`` on a node with
GPUS fake GPUs (:func:`hpcfl.testing.fake_accelerator.fake_cuda`), this process playing
``cuda:(SLURM_LOCALID % N)``, the GPU SLURM's node-local task id says it should use, N being the
GPUs it sees: those of ``CUDA_VISIBLE_DEVICES`` when SLURM bound some (``--gpus-per-task=1``: one),
else GPUS.

hpcfl itself picks ``cuda:(local rank % GPUS)`` from the node's shared-memory communicator and
records it per rank in ``determinism.json``, where a test compares it with the node-local ids.
Runs without the rank guard (its ``exec`` would leave the fake device)."""

import os
import sys

os.environ["HPCFL_RANK_GUARD"] = "0"

from hpcfl.cli.main import main  # noqa: E402
from hpcfl.testing.fake_accelerator import fake_cuda  # noqa: E402

visible = os.environ.get("CUDA_VISIBLE_DEVICES")
gpus = len(visible.split(",")) if visible else int(sys.argv[1])
with fake_cuda(index=int(os.environ.get("SLURM_LOCALID", "0")) % gpus, device_count=gpus):
    code = main(sys.argv[2:])
sys.exit(code)
