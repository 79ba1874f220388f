"""Peak memory of personalised methods against the number of clients K (issue 41: "memory flat in K
for K up to 10,000 with 100 per round"): Ditto (a personal model per client) and FedPer (a personal
head per client) with their states in the on-disk client-state store.

    python benchmarks/personalised_memory.py     # 4 runs, about 2 minutes on 2 cores

Synthetic data (100,000 samples, iid), the MLP, 100 participants per round, 10 rounds of 5 local
steps, ``client_state_memory: disk``, ``client_eval`` on a seeded sample of 100 clients per evaluated
round (their personal models read back from the store). Each run is its own process; the figure is
the largest ``peak_rss_mb`` its metrics rows report. Prints one JSON line per run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "out" / "personalised_memory"


def one(algo: str, clients: int) -> dict[str, Any]:
    """One run in this process; returns its figures."""
    from hpcfl.config import config_from_dict
    from hpcfl.runner import run_experiment

    cfg = dict(
        name=f"{algo}_k{clients}",
        algorithm=algo,
        model="mlp",
        lr=0.05,
        batch_size=10,
        local_steps=5,
        seed=0,
        threads=1,
        progress=False,
        dataset="synthetic",
        dataset_options={"n_train": 100_000, "n_test": 1000, "seed": 0},
        partition="iid",
        num_clients=clients,
        clients_per_round=100,
        rounds=10,
        client_state_memory="disk",
        eval_every=5,
        checkpoint_every=10,
        client_eval=0.2,
        client_eval_clients=100,
    )
    t0 = time.perf_counter()
    rows = run_experiment(config_from_dict(cfg), OUT / cfg["name"], overwrite=True).metrics
    return {
        "algorithm": algo,
        "clients": clients,
        "participants": 100,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in rows),
        "personal_acc_mean": rows[-1]["personal_acc_mean"],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> int:
    if len(sys.argv) == 3:  # a child: one run
        print(json.dumps(one(sys.argv[1], int(sys.argv[2]))), flush=True)
        return 0
    for algo in ("ditto", "fedper"):
        for clients in (1_000, 10_000):
            proc = subprocess.run(
                [sys.executable, __file__, algo, str(clients)], capture_output=True, text=True
            )
            if proc.returncode != 0:
                raise SystemExit(proc.stderr[-2000:])
            print(proc.stdout.strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
