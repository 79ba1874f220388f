"""NTK-FL reproduction on the authors' setup (Yue et al., ICML 2022, Section 6, Table 1; issue 32).

Fashion-MNIST, 300 clients of 200 samples on Hsu et al.'s per-client Dirichlet (``client-dir:0.1``),
21 per round (the reference code's part_rate 0.07), MLP-100 with Kaiming-normal weights and zero
biases: NTK-FL (``configs/fmnist_ntkfl_paper.yaml``), CP-NTK-FL (``configs/fmnist_cp_ntkfl_paper.yaml``)
and FedAvg at each of ``--fedavg-steps`` local steps (momentum 0, the reference code's optimiser),
each over ``--seeds`` (default 3), under the comparison protocol (:mod:`hpcfl.report.protocol`,
:func:`benchmarks._runs.run_protocol`): FedAvg's lr is chosen per local-step count on a 1 %
validation hold-out (``validation: 0.01``) by the last-k mean ``val_accuracy`` at the first seed,
then every seed runs at the chosen lr; NTK-FL's η is the paper's (no search).

Reported per method (mean ± std over seeds): the mean test accuracy of the last ``--last`` evaluated
rounds, and the rounds (and MB) to ``--target`` (default 85 %) of the running mean of test accuracy
over ``--window`` evaluated rounds. The paper's claim (Table 1, α = 0.1): 85 % in 26 rounds for
CP-NTK-FL against 284 for FedAvg.

    python benchmarks/ntkfl_reproduction.py --out benchmarks/results/ntkfl_paper           # the full run
    python benchmarks/ntkfl_reproduction.py --rounds 2 --fedavg-rounds 2 --fedavg-steps 1 \\
        --fedavg-lrs 0.05 --seeds 0 --out /tmp/ntkfl_tiny                                 # a smoke run

Budget (CPU, 2 cores): an NTK-FL round at 21 × 200 samples is its Jacobians (factored), the
4,200 × 4,200 kernel and 2,000 float32 products of it (the cross-entropy evolution), ~1 min on one
busy thread; 3 seeds × 50 rounds × 2 methods plus FedAvg's 300 rounds × (4 local-step counts ×
3 lrs + 2 more seeds each) is many hours: run it alone. Runs are cached (a re-run only adds what is
missing). ``--euler-step 10`` runs NTK-FL's evolution before issue 32 (explicit Euler steps of 10 on
the cross-entropy flow, past its stability limit), exactly: an Euler step of K with η is a gradient
step with η·K, S growing by K·g either way, so η·K on the grid / K is the same iteration and the same
weight update. To compare other before/after changes, run the same command on both checkouts with
different ``--out``. Writes ``ntkfl_reproduction.{md,csv,json,png}`` under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _runs import Setting, run_protocol, write_tables  # noqa: E402

from hpcfl.algorithms.ntkfl import NTKFLParams  # noqa: E402
from hpcfl.report.protocol import DEFAULT_LAST_K, DEFAULT_WINDOW, Protocol  # noqa: E402


def _paper(name: str) -> dict[str, Any]:
    """A shipped paper config as a dict (its name dropped: the runs are named here)."""
    cfg = yaml.safe_load((REPO / "configs" / name).read_text())
    cfg.pop("name", None)
    return cfg


def _common(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    return dict(
        data_root=args.data_root,
        seed=seed,
        threads=args.threads,
        progress=False,
        checkpoint_every=10,
        clients_per_round=args.per_round,
    )


def _fedavg(args: argparse.Namespace, seed: int, steps: int, lr: float) -> dict[str, Any]:
    """FedAvg on the same split and model as the NTK-FL paper config (plain SGD, momentum 0)."""
    base = {k: v for k, v in _paper("fmnist_ntkfl_paper.yaml").items() if k not in ("params", "algorithm")}
    return {
        **base,
        **_common(args, seed),
        "algorithm": "fedavg",
        "rounds": args.fedavg_rounds,
        "local_steps": steps,
        "lr": lr,
        "batch_size": args.batch_size,
        "momentum": 0.0,
    }


def settings(args: argparse.Namespace) -> list[Setting]:
    """The table's rows: NTK-FL and CP-NTK-FL at the paper's η (their client ``lr`` is unused: one
    fixed value, no search), FedAvg per local-step count with an lr search on validation."""
    column = "client-dir:0.1"
    out = []
    for method in args.methods:
        if method == "fedavg":
            for steps in args.fedavg_steps:
                cfg = {k: v for k, v in _fedavg(args, 0, steps, 0.0).items() if k not in ("lr", "seed")}
                lrs = tuple(args.fedavg_lrs)
                if len(lrs) > 1:
                    cfg["validation"] = 0.01
                out.append(Setting(f"fedavg-k{steps}", column, cfg, lrs))
            continue
        paper = _paper("fmnist_ntkfl_paper.yaml" if method == "ntkfl" else "fmnist_cp_ntkfl_paper.yaml")
        params = {**paper["params"], "evolution": args.evolution}
        name = method
        if args.euler_step > 1:
            # explicit Euler steps of K on the flow = gradient descent steps with η·K, the grid / K
            k = args.euler_step
            grid = [int(t) // k for t in params.get("grid", NTKFLParams().grid)]
            if any(int(t) % k for t in params.get("grid", NTKFLParams().grid)):
                raise SystemExit(f"ntkfl_reproduction: --euler-step {k} must divide every grid point")
            params = {**params, "eta": params.get("eta", NTKFLParams().eta) * k, "grid": grid}
            name = f"{method}-euler{k}"
        cfg = {**paper, **_common(args, 0), "rounds": args.rounds, "params": params}
        cfg.pop("seed")
        out.append(Setting(name, column, cfg, (0.01,)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "ntkfl_paper")
    ap.add_argument(
        "--data-root", default=os.environ.get("HPCFL_DATA", str(REPO.parent / "shared" / "datasets"))
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--per-round", type=int, default=21, help="clients per round (part_rate 0.07 of 300)")
    ap.add_argument("--rounds", type=int, default=50, help="NTK-FL / CP-NTK-FL rounds")
    ap.add_argument("--methods", nargs="+", default=["ntkfl", "cp-ntkfl", "fedavg"])
    ap.add_argument("--evolution", choices=["discrete", "flow"], default="discrete")
    ap.add_argument(
        "--euler-step",
        type=int,
        default=1,
        help="K > 1: NTK-FL's evolution before issue 32 (explicit Euler steps of K on the cross-entropy "
        "flow, K = 10 then), run exactly as gradient descent with η·K on the grid / K",
    )
    ap.add_argument("--fedavg-rounds", type=int, default=300)
    ap.add_argument("--fedavg-steps", type=int, nargs="+", default=[1, 5, 10, 20])
    ap.add_argument("--fedavg-lrs", type=float, nargs="+", default=[0.01, 0.03, 0.1])
    ap.add_argument("--batch-size", type=int, default=50, help="FedAvg's local batch")
    ap.add_argument("--target", type=float, default=0.85)
    ap.add_argument(
        "--window", type=int, default=DEFAULT_WINDOW, help="running-mean window (evaluated rounds)"
    )
    ap.add_argument("--last", type=int, default=DEFAULT_LAST_K, help="last-k evaluated rounds averaged")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (worker processes)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per run (0: all cores)")
    args = ap.parse_args()
    if args.euler_step < 1:
        ap.error(f"--euler-step must be >= 1, got {args.euler_step}")
    if not args.threads:
        args.threads = os.cpu_count() or 1
    protocol = Protocol(last_k=args.last, window=args.window)
    cells = run_protocol(settings(args), seeds=args.seeds, out=args.out, jobs=args.jobs, protocol=protocol)
    header = (
        "# NTK-FL, CP-NTK-FL and FedAvg on the authors' Fashion-MNIST setup (client-dir 0.1, 300 clients, "
        f"{args.per_round} per round), seeds {args.seeds}"
    )
    text = write_tables(
        cells, protocol, {"client-dir:0.1": args.target}, args.out / "ntkfl_reproduction", header
    )
    print(text)


if __name__ == "__main__":
    main()
