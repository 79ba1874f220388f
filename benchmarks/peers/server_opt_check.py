"""Flower's server optimisers against hpcfl's: the same client models in, the new global model out.

Issue 60, item 5 (the unit half). Two sides, one per virtual environment, meeting in a .npz file:

- ``--side flower`` (Flower's python, ``.peers/flower/bin/python``; imports numpy and flwr only)
  draws R rounds of K client updates (seeded; a client's model is the global model it received plus
  its update, in float64 by default so that the arithmetic is compared, not float32's
  conditioning), feeds the client models as reply
  Messages to ``flwr.serverapp.strategy`` FedAdam, FedYogi, FedAdagrad and FedAvgM
  (``aggregate_train``, the Message API of Flower 1.42), and writes the inputs and Flower's global
  model after every round. The adaptive strategies get hpcfl's initial second moment
  (``v_t = τ²`` set before round 1; Flower starts from zeros) and, for the record, are run again
  from Flower's own zeros;
- ``--side hpcfl`` (hpcfl's venv) feeds the same client models to hpcfl's server steps
  (:mod:`hpcfl.algorithms.fedadam`, ``fedyogi``, ``fedadagrad``, ``fedavgm``) from the same start,
  and prints the largest difference from Flower's model, relative to the largest entry of Flower's
  model (and element-wise, entries above 1e-3 of it); exit 1 above 1e-6.

Known differences the check accounts for, each stated in the output:
- Flower's FedAdam takes a bias-corrected rate η_t = η·√(1 − β2^(t+1))/(1 − β1^(t+1)) (t the server
  round, from 1); hpcfl's FedAdam is Reddi et al.'s Algorithm 2, without bias correction. The check
  gives hpcfl Flower's η_t of each round (``eta`` in the file), so the rest of the step is compared;
- Flower's FedAdagrad has no first moment (β1 = 0 in FedOpt): hpcfl's ``beta1: 0``;
- Flower's FedAvgM defaults to momentum 0 (plain FedAvg) and takes v₁ = Δ₁; hpcfl's default is
  β = 0.9 with v₀ = 0 (so v₁ = Δ₁ as well). Checked at Flower's defaults and at β = 0.9.

    .peers/flower/bin/python benchmarks/peers/server_opt_check.py --side flower --out /tmp/f.npz
    PYTHONPATH=. .venv/bin/python benchmarks/peers/server_opt_check.py --side hpcfl --fixture /tmp/f.npz

``tests/fixtures/flower_server_opt.npz`` is this file from Flower 1.42.0 (``--rounds 4 --clients 5
--size 64``, float64), checked by tests/test_server_opt_flower.py without Flower installed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

#: name -> (Flower strategy class, its keyword arguments, hpcfl algorithm, hpcfl params); the
#: adaptive ones at Flower's defaults (η, β1, β2, τ), FedAvgM at Flower's defaults and at β = 0.9
CASES: dict[str, tuple[str, dict[str, float], str, dict[str, float]]] = {
    "fedadam": ("FedAdam", {}, "fedadam", {"server_lr": 0.1, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}),
    "fedyogi": ("FedYogi", {}, "fedyogi", {"server_lr": 0.01, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}),
    "fedadagrad": ("FedAdagrad", {}, "fedadagrad", {"server_lr": 0.1, "beta1": 0.0, "tau": 1e-3}),
    "fedavgm_default": ("FedAvgM", {}, "fedavgm", {"server_lr": 1.0, "beta": 0.0}),
    "fedavgm_0.9": (
        "FedAvgM",
        {"server_learning_rate": 1.0, "server_momentum": 0.9},
        "fedavgm",
        {"server_lr": 1.0, "beta": 0.9},
    ),
}
TOLERANCE = 1e-6


def split(flat: np.ndarray, shapes: list[tuple[int, ...]]) -> dict[str, np.ndarray]:
    """A flat vector as the named arrays of a state dict (``p0``, ``p1``, ...)."""
    out, at = {}, 0
    for i, shape in enumerate(shapes):
        n = int(np.prod(shape))
        out[f"p{i}"] = flat[at : at + n].reshape(shape).copy()
        at += n
    return out


def shapes_for(size: int) -> list[tuple[int, ...]]:
    """A small model's arrays summing to ``size`` entries: a conv-like, a bias, a matrix, the rest."""
    return [(2, 1, 3, 3), (2,), (4, 5), (size - 18 - 2 - 20,)]


def flower_side(args: argparse.Namespace) -> None:
    """Run Flower's strategies on seeded client models; write inputs and outputs to ``args.out``."""
    import flwr
    from flwr.app import Array, ArrayRecord, Message, Metadata, MetricRecord, RecordDict
    from flwr.serverapp import strategy as strategies

    def record(flat: np.ndarray) -> ArrayRecord:
        return ArrayRecord({k: Array(v) for k, v in split(flat, shapes).items()})

    rng = np.random.default_rng(args.seed)
    shapes = shapes_for(args.size)
    dtype = np.dtype(args.dtype)
    x0 = (0.1 * rng.standard_normal(args.size)).astype(dtype)
    # client models = the round's global model + a shared drift + each client's own noise, so Δ has
    # a direction; weights are sample counts
    drift = 0.01 * rng.standard_normal((args.rounds, 1, args.size))
    updates = (drift + 0.01 * rng.standard_normal((args.rounds, args.clients, args.size))).astype(dtype)
    weights = rng.integers(20, 600, size=(args.rounds, args.clients)).astype(np.int64)
    out: dict[str, Any] = {"x0": x0, "updates": updates, "weights": weights}
    meta: dict[str, Any] = {"flwr": flwr.__version__, "numpy": np.__version__, "cases": {}, "shapes": shapes}
    for case, (cls_name, kwargs, algo, params) in CASES.items():
        for v0 in ("tau2", "zeros") if "tau" in params else ("none",):
            strategy = getattr(strategies, cls_name)(**kwargs)
            x = x0.copy()
            models, etas = [], []
            if v0 == "tau2":
                strategy.v_t = {k: np.full(s, params["tau"] ** 2, dtype=dtype) for k, s in _named(shapes)}
            if cls_name == "FedAvgM":
                strategy.current_arrays = record(x)
            for t in range(1, args.rounds + 1):
                ys = x[None, :] + updates[t - 1]  # (K, P): the clients' models, trained from x
                if cls_name != "FedAvgM":
                    strategy.current_arrays = split(x, shapes)  # what configure_train keeps
                replies = [
                    Message(
                        RecordDict(
                            {
                                "arrays": record(ys[k]),
                                "metrics": MetricRecord({"num-examples": int(weights[t - 1, k])}),
                            }
                        ),
                        metadata=Metadata(  # a client's reply, as the SuperLink delivers it
                            run_id=0,
                            message_id=f"{t}-{k}",
                            src_node_id=k + 1,
                            dst_node_id=0,
                            reply_to_message_id=f"{t}",
                            group_id=str(t),
                            created_at=0.0,
                            ttl=3600.0,
                            message_type="train",
                        ),
                    )
                    for k in range(args.clients)
                ]
                new, _ = strategy.aggregate_train(t, replies)
                x = np.concatenate([a.numpy().reshape(-1) for a in new.values()])
                models.append(x)
                etas.append(_flower_eta(cls_name, params, t))
            key = f"{case}@v0zeros" if v0 == "zeros" else case
            out[f"{key}/models"] = np.stack(models)
            out[f"{key}/eta"] = np.array(etas, dtype=np.float64)
            meta["cases"][key] = {
                "flower": cls_name,
                "flower_kwargs": kwargs,
                "hpcfl": algo,
                "params": params,
            }
    out["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    tmp = Path(str(args.out) + ".tmp.npz")
    np.savez_compressed(tmp, **out)
    tmp.replace(args.out)
    print(f"flower {flwr.__version__}: {len(meta['cases'])} cases x {args.rounds} rounds -> {args.out}")


def _named(shapes: list[tuple[int, ...]]) -> list[tuple[str, tuple[int, ...]]]:
    return [(f"p{i}", s) for i, s in enumerate(shapes)]


def _flower_eta(cls_name: str, params: dict[str, float], t: int) -> float:
    """The server rate Flower's strategy applies in round ``t``: FedAdam's bias-corrected η_t."""
    if cls_name == "FedAdam":
        b1, b2 = params["beta1"], params["beta2"]
        return params["server_lr"] * float(np.sqrt(1 - np.power(b2, t + 1.0)) / (1 - np.power(b1, t + 1.0)))
    return params["server_lr"]


def hpcfl_models(fixture: dict[str, np.ndarray], key: str, case: dict[str, Any]) -> np.ndarray:
    """hpcfl's global model after every round of ``key``'s client models (R, P), in the fixture's dtype, from the
    fixture's start; the adaptive methods from hpcfl's own v₋₁ = τ², each round at the fixture's
    η (Flower's bias-corrected rate for FedAdam)."""
    import dataclasses

    import torch

    from hpcfl.algorithms.base import Aggregate, ServerContext
    from hpcfl.algorithms.participation import Population
    from hpcfl.registry import ALGORITHMS
    from hpcfl.training.layout import StateLayout

    cls = ALGORITHMS[case["hpcfl"]]
    updates, weights, etas = fixture["updates"], fixture["weights"], fixture[f"{key}/eta"]
    size = updates.shape[-1]
    layout = StateLayout.vector(size)
    params = cls.Params(**case["params"])
    x0 = torch.from_numpy(fixture["x0"].copy())
    server = cls(params, layout=layout).init_server(x0)
    out = []
    for t in range(updates.shape[0]):
        algo = cls(dataclasses.replace(params, server_lr=float(etas[t])), layout=layout)
        w = weights[t].tolist()
        total = torch.zeros(size, dtype=torch.float64)  # the runner's float64 round buffer
        ys = server.x[None, :] + torch.from_numpy(updates[t])  # the clients' models, trained from x
        for k in range(updates.shape[1]):
            total.add_(ys[k].double(), alpha=float(w[k]))
        aggregate = Aggregate(sums={"x": total.to(x0.dtype)}, weight=float(sum(w)), count=len(w))
        ctx = ServerContext(t, tuple(range(len(w))), Population(tuple(w)), lambda v: v)
        server, _ = algo.server_update(server, aggregate, ctx)
        out.append(server.x.numpy().copy())
    return np.stack(out)


def differences(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, float]:
    """(max |ours − theirs| / max |theirs|, the element-wise max relative difference over the entries
    whose magnitude is at least 1e-3 of the largest)."""
    scale = float(np.abs(theirs).max())
    diff = np.abs(ours.astype(np.float64) - theirs.astype(np.float64))
    big = np.abs(theirs) >= 1e-3 * scale
    return float(diff.max() / scale), float((diff[big] / np.abs(theirs[big])).max())


def load_fixture(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays of a ``--side flower`` file and its metadata."""
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    return arrays, json.loads(arrays.pop("meta").tobytes().decode())


def hpcfl_side(args: argparse.Namespace) -> int:
    """Compare hpcfl's server steps with Flower's file; 0 when every tau² case is within 1e-6."""
    fixture, meta = load_fixture(args.fixture)
    print(
        f"Flower {meta['flwr']} (numpy {meta['numpy']}) vs hpcfl, {fixture['weights'].shape} rounds x clients"
    )
    worst = 0.0
    for key, case in meta["cases"].items():
        scaled, elementwise = differences(hpcfl_models(fixture, key, case), fixture[f"{key}/models"])
        note = "Flower's own v0 = 0 (for the record)" if key.endswith("@v0zeros") else "the same start"
        if not key.endswith("@v0zeros"):
            worst = max(worst, scaled)
        print(
            f"{key:>22}: max |diff| / max |flower| = {scaled:.2e}; element-wise {elementwise:.2e}  ({note})"
        )
    print(f"largest difference (v0 = tau^2 cases): {worst:.2e} (tolerance {TOLERANCE:.0e})")
    return 0 if worst <= TOLERANCE else 1


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--side", choices=["flower", "hpcfl"], required=True)
    parser.add_argument("--out", type=Path, help="the .npz the flower side writes")
    parser.add_argument("--fixture", type=Path, help="the .npz the hpcfl side reads")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--size", type=int, default=64, help="entries of the model (at least 41)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype",
        choices=["float64", "float32"],
        default="float64",
        help="the models' dtype (float64: compares the steps' arithmetic; in float32 FedAdagrad at "
        "Flower's η = 0.1 moves both sides ~5e-4 from a float64 reference within 4 rounds)",
    )
    args = parser.parse_args()
    if args.side == "flower":
        if args.out is None or args.size < 41:
            sys.exit("server_opt_check: the flower side needs --out FILE.npz and --size >= 41")
        flower_side(args)
        return
    if args.fixture is None or not args.fixture.is_file():
        sys.exit("server_opt_check: the hpcfl side needs --fixture FILE.npz written by --side flower")
    sys.exit(hpcfl_side(args))


if __name__ == "__main__":
    main()
