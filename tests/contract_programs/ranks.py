"""Run under ``mpiexec -n R``: every run of ``RUNS.json`` ({run name: config dict}) on this world,
each into ``OUT/<name>``, one after another in the same processes (one MPI start for all of them).
Prints ``rank r: OK`` when every run finished."""

import json
import sys
from pathlib import Path

from hpcfl.comm import get_comm
from hpcfl.config import config_from_dict
from hpcfl.runner import run_experiment

runs, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
comm = get_comm("mpi")
for name, config in runs.items():
    result = run_experiment(config_from_dict(config), out / name, comm=comm)
    assert result.finished, name
print(f"rank {comm.rank}: OK", flush=True)
