"""Write the experiment bundle every framework of the peers harness reads (runs in hpcfl's venv).

    PYTHONPATH=. python benchmarks/peers/experiment.py [--out bench-out/peers/experiment]

The bundle holds what must be identical for every framework, computed by hpcfl itself:

- ``train_x.npy``/``test_x.npy`` float32 (N, 1, 28, 28): Fashion-MNIST as hpcfl loads and normalises
  it (``hpcfl.data.load_dataset``), ``train_y.npy``/``test_y.npy`` int64;
- ``clients.json``: hpcfl's ``dir:0.5`` partition of 100 clients (seed ``partition_seed``), one
  sorted index list per client; the same split for every run seed;
- ``draws.json``: ``{"<seed>": [[10 client ids] per round]}``, hpcfl's own participant draw of each
  run seed (``Participation(10).sample`` from ``round_generator(seed, 0, round)``);
- ``spec.json``: the experiment's settings.

It is written to a temp folder beside the target and renamed, so a bundle under ``--out`` is
always complete. An existing complete bundle with the same spec is kept (``--force`` rebuilds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_OUT = "bench-out/peers/experiment"

SPEC: dict[str, Any] = {
    "dataset": "fashion-mnist",
    "partition": "dir:0.5",
    "partition_seed": 0,
    "num_clients": 100,
    "min_client_size": 10,
    "rounds": 50,
    "clients_per_round": 10,
    "local_epochs": 1,
    "batch_size": 32,
    "lr": 0.05,
    "momentum": 0,
    "weight_decay": 0,
    "drop_last": False,
    "weighting": "samples",
    "eval_every": 5,
    "model": "simplecnn",
    "seeds": [0, 1, 2],
}


def client_draws(
    seeds: list[int], rounds: int, num_clients: int, per_round: int
) -> dict[str, list[list[int]]]:
    """hpcfl's participant draw of each seed: the ids an ``hpcfl run`` with ``clients_per_round:
    per_round`` trains in each round (uniform without replacement; it does not depend on sizes)."""
    from hpcfl.algorithms.participation import Participation, Population
    from hpcfl.runner.rounds import round_generator

    rule, population = Participation(per_round), Population(tuple([1] * num_clients))
    return {str(s): [rule.sample(population, round_generator(s, 0, r)) for r in range(rounds)] for s in seeds}


def client_partition(labels: Any, num_classes: int, spec: dict[str, Any]) -> list[list[int]]:
    """hpcfl's partition of the train labels as ``spec`` names it (sorted index lists)."""
    from hpcfl.data import partition

    parts = partition(
        labels,
        spec["partition"],
        spec["num_clients"],
        seed=spec["partition_seed"],
        num_classes=num_classes,
        min_size=spec["min_client_size"],
    )
    return [p.tolist() for p in parts]


def build(out: Path, data_root: str | None, spec: dict[str, Any]) -> Path:
    """Write the bundle to ``out`` (temp folder + rename); returns ``out``."""
    from hpcfl.data import load_dataset
    from hpcfl.models import build_model

    ds = load_dataset(spec["dataset"], data_root, download=False)
    model = build_model(spec["model"], ds.input_shape, ds.num_classes)
    full = {
        **spec,
        "num_classes": ds.num_classes,
        "input_shape": list(ds.input_shape),
        "num_params": sum(p.numel() for p in model.parameters()),
        "num_train": len(ds.train),
        "num_test": len(ds.test),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the bundle is read by every peer's process
    try:
        np.save(tmp / "train_x.npy", ds.train.x.numpy().astype(np.float32, copy=False))
        np.save(tmp / "train_y.npy", ds.train.y.numpy().astype(np.int64, copy=False))
        np.save(tmp / "test_x.npy", ds.test.x.numpy().astype(np.float32, copy=False))
        np.save(tmp / "test_y.npy", ds.test.y.numpy().astype(np.int64, copy=False))
        clients = client_partition(ds.train.y, ds.num_classes, spec)
        (tmp / "clients.json").write_text(json.dumps(clients, separators=(",", ":")) + "\n")
        draws = client_draws(spec["seeds"], spec["rounds"], spec["num_clients"], spec["clients_per_round"])
        (tmp / "draws.json").write_text(json.dumps(draws, separators=(",", ":")) + "\n")
        (tmp / "spec.json").write_text(json.dumps(full, indent=1) + "\n")  # last: marks the bundle whole
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def is_current(out: Path, spec: dict[str, Any]) -> bool:
    """True when ``out`` holds a complete bundle written for ``spec``."""
    try:
        saved = json.loads((out / "spec.json").read_text())
    except (OSError, ValueError):
        return False
    files = ("train_x.npy", "train_y.npy", "test_x.npy", "test_y.npy", "clients.json", "draws.json")
    return all((out / f).is_file() for f in files) and all(saved.get(k) == v for k, v in spec.items())


def ensure(
    out: str | os.PathLike[str] = DEFAULT_OUT, data_root: str | None = None, *, force: bool = False
) -> Path:
    """The bundle at ``out``, built first if it is missing, stale or ``force``."""
    path = Path(out)
    if force or not is_current(path, SPEC):
        build(path, data_root, SPEC)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--data-root", default=None, help="hpcfl's data root (default: $HPCFL_DATA)")
    p.add_argument("--force", action="store_true", help="rebuild even if a current bundle exists")
    args = p.parse_args(argv)
    from hpcfl.errors import HpcflError

    try:
        path = ensure(args.out, args.data_root, force=args.force)
    except HpcflError as err:
        print(f"experiment: {err}", file=sys.stderr)
        return 2
    spec = json.loads((path / "spec.json").read_text())
    print(
        f"experiment bundle: {path} ({spec['num_train']} train, {spec['num_test']} test, {spec['num_params']:,} parameters)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
