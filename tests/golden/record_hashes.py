"""Record ``final_state_hashes.json`` entries for this machine's CPU capability.

A bit-exact hash of float32 training depends on the SIMD kernels PyTorch, oneDNN and MKL pick for
the CPU (AVX512 and AVX2 machines round differently), so each entry keeps one hash per
``torch.backends.cpu.get_cpu_capability()``. The entries check that the round-protocol redesign
changed no result, so their hashes must come from the code BEFORE it (commit 0ad1a79), except
``tct``, which issue 16 re-recorded on purpose with the fresh eNTK head (current code):

    git worktree add /tmp/pre 0ad1a79
    (cd /tmp/pre && PYTHONPATH=/tmp/pre python /path/to/this/file fedavg fedprox scaffold moon fedcka --write)
    python tests/golden/record_hashes.py tct tct-head-keep --write    # current code, from the repo root

``tct-head-keep`` equals the pre-redesign ``tct`` (run the old code on the entry named ``tct`` there
and copy it). Prints ``name capability sha256`` per entry; ``--write`` stores them in the golden file
of THIS file's checkout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from pathlib import Path

import torch

GOLDEN = Path(__file__).resolve().with_name("final_state_hashes.json")


def final_hash(config: dict) -> str:
    """sha256 of the final server vector of the run ``config`` (float32 reduction where the code
    knows that key; the pre-redesign code always summed in float32)."""
    from hpcfl.config import config_from_dict
    from hpcfl.errors import ConfigError
    from hpcfl.runner import run_experiment

    try:
        cfg = config_from_dict({**config, "reduction": "float32"})
    except ConfigError:
        cfg = config_from_dict(config)
    with tempfile.TemporaryDirectory() as tmp:
        x = run_experiment(cfg, Path(tmp) / "run").server.x
    return hashlib.sha256(x.contiguous().numpy().tobytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("names", nargs="+", help="entries of final_state_hashes.json")
    parser.add_argument("--write", action="store_true", help="store the hashes under this CPU's capability")
    args = parser.parse_args()
    golden = json.loads(GOLDEN.read_text())
    capability = torch.backends.cpu.get_cpu_capability()
    for name in args.names:
        digest = final_hash(golden[name]["config"])
        print(name, capability, digest, flush=True)
        golden[name]["sha256"][capability] = digest
    if args.write:
        GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")


if __name__ == "__main__":
    main()
