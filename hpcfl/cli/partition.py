"""``hpcfl partition``: split a dataset's train set over clients and show what each client holds.

Prints a clients × classes count table, and writes ``partition.json`` (the exact indices, which a
run can reuse) and ``partition.png`` (a heatmap of the table) into ``--out``. The spec is checked
before the dataset is read, and the heavy imports (torch, matplotlib) wait until ``run`` so that
``hpcfl --help`` stays fast.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from hpcfl.errors import ConfigError

# Kept literal so --help needs no torch import; a test checks it against hpcfl.data.DATASETS.
_DATASET_NAMES = "mnist, fashion-mnist (fmnist), cifar10, cifar100, femnist, shakespeare, synthetic"

_EPILOG = """\
partition specs:
  iid          uniform random split, equal sizes
  dir:ALPHA    per-class Dirichlet(ALPHA) shares (NIID-Bench labeldir); smaller ALPHA = more skew,
               redrawn until every client has >= --min-size samples
  client-dir:ALPHA
               per-client Dirichlet(ALPHA) class shares, N/K samples each (Hsu et al. 2019; the
               NTK-FL paper's setup); the last clients take what the others left
  classes:C    NIID-Bench's #C rule (TCT, FedPVR papers): client k holds class k mod #classes and C-1
               more drawn at random; each class split evenly among its holders, so sizes vary
               (redrawn until every class has a holder when there are fewer clients than classes)
  balanced-classes:C
               every client holds exactly C classes assigned round-robin, each class split evenly:
               equal sizes (same as classes:C for C = 1)
  natural      one client per writer (femnist) or speaking role (shakespeare); --num-clients <= writers
               takes the first ones

examples:
  hpcfl partition --dataset fashion-mnist --partition dir:0.5 --num-clients 10
  hpcfl partition --dataset mnist --partition classes:2 --num-clients 100 --seed 1 --out parts/
  hpcfl partition --dataset femnist --partition natural --num-clients 16 --data-root /data
"""


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``partition`` sub-command to the ``hpcfl`` parser."""
    parser = subparsers.add_parser(
        "partition",
        help="split a dataset over clients; print and save per-client class counts",
        description="Split a dataset's train set over federated clients, print the per-client class counts, "
        "and save partition.json (indices) and partition.png (heatmap).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dataset", required=True, metavar="NAME", help=f"dataset: {_DATASET_NAMES}")
    parser.add_argument(
        "--partition",
        required=True,
        metavar="SPEC",
        help="iid, dir:ALPHA, client-dir:ALPHA, classes:C, balanced-classes:C or natural (see below)",
    )
    parser.add_argument("--num-clients", required=True, type=int, metavar="K", help="number of clients")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default: 0)")
    parser.add_argument(
        "--data-root",
        metavar="DIR",
        default=None,
        help="directory holding the datasets (default: $HPCFL_DATA, else ~/.cache/hpcfl)",
    )
    parser.add_argument(
        "--min-size",
        type=int,
        default=10,
        metavar="N",
        help="dir:ALPHA redraws until every client has at least N samples (default: 10)",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help="output directory (default: ./partition_<dataset>_<spec>, with ':' written as '-')",
    )
    parser.add_argument(
        "--no-download", action="store_true", help="fail instead of downloading missing dataset files"
    )
    parser.add_argument(
        "--clients-per-round",
        type=int,
        default=None,
        metavar="M",
        help="also show who participates: M clients drawn per round (as `hpcfl run` draws them)",
    )
    parser.add_argument(
        "--rounds", type=int, default=10, metavar="R", help="rounds of that schedule (default: 10)"
    )
    parser.add_argument(
        "--participation-weighting",
        choices=("uniform", "size"),
        default="uniform",
        help="how the M are drawn",
    )
    parser.set_defaults(func=run)
    return parser


def default_out_dir(dataset: str, spec: str) -> Path:
    """``./partition_<dataset>_<spec>`` with characters unsafe in file names (``:`` ``/`` …) as ``-``."""
    return Path(re.sub(r"[^A-Za-z0-9._-]", "-", f"partition_{dataset}_{spec}"))


def run(args: argparse.Namespace) -> int:
    """Partition, print the table, save ``partition.json`` and ``partition.png``; returns 0."""
    from hpcfl.data import (
        canonical_name,
        format_partition_table,
        load_dataset,
        parse_partition_spec,
        partition,
        partition_stats,
        plot_partition_heatmap,
        save_partition,
    )
    from hpcfl.data.root import absolute_data_root

    spec = args.partition.strip().lower()
    parse_partition_spec(spec)  # a bad spec fails before any data is read
    name = canonical_name(args.dataset)
    if args.num_clients < 1:
        raise ConfigError(f"--num-clients must be >= 1, got {args.num_clients}")
    if args.min_size < 0:
        raise ConfigError(f"--min-size must be >= 0, got {args.min_size}")
    dataset = load_dataset(name, absolute_data_root(args.data_root), download=not args.no_download)
    parts = partition(
        dataset.train.y,
        spec,
        args.num_clients,
        seed=args.seed,
        num_classes=dataset.num_classes,
        natural=dataset.natural_clients,
        min_size=args.min_size,
    )
    counts = partition_stats(dataset.train.y, parts, dataset.num_classes)
    out = Path(args.out) if args.out else default_out_dir(name, spec)
    json_path = save_partition(out / "partition.json", parts, spec, args.seed, counts, dataset=name)
    title = f"{name}  {spec}  K={len(parts)}  seed={args.seed}"
    png_path = plot_partition_heatmap(counts, out / "partition.png", title=title)

    sizes = counts.sum(axis=1)
    held = (counts > 0).sum(axis=1)
    if dataset.vocab_size is None:
        print(format_partition_table(counts))
    else:  # one column per next symbol: too wide to read; the counts are in partition.json
        print(f"(the clients x {dataset.num_classes} next-symbol counts are in {json_path})")
    print(
        f"{title}: client sizes {int(sizes.min())}..{int(sizes.max())} (mean {sizes.mean():.0f}), "
        f"classes per client {int(held.min())}..{int(held.max())}"
    )
    print(size_summary(sizes))
    if args.clients_per_round is not None:
        print(participation_summary(sizes.tolist(), args))
    print(f"saved {json_path} and {png_path}")
    return 0


def size_summary(sizes: Any) -> str:
    """One line: the number of clients and their train samples' mean, std and quartiles."""
    import numpy as np

    n = np.asarray(sizes, dtype=np.int64)
    q1, q2, q3 = (float(v) for v in np.percentile(n, [25, 50, 75]))
    return (
        f"{n.size} clients, {int(n.sum())} train samples; per client: mean {n.mean():.1f}, "
        f"std {n.std():.1f}, quartiles {q1:g} / {q2:g} / {q3:g}, min {int(n.min())}, max {int(n.max())}"
    )


def participation_summary(sizes: list[int], args: argparse.Namespace) -> str:
    """Who trains in rounds 1..R under ``--clients-per-round``: the draw ``hpcfl run`` makes with
    the same seed (participants depend only on seed and round)."""
    from hpcfl.algorithms.participation import Participation, Population
    from hpcfl.runner.rounds import round_generator

    if args.clients_per_round < 1 or args.rounds < 1:
        raise ConfigError("--clients-per-round and --rounds must be >= 1")
    part = Participation(count=args.clients_per_round, weighting=args.participation_weighting)
    pop = Population(tuple(int(s) for s in sizes))
    trained = [0] * len(sizes)
    lines = []
    for rnd in range(args.rounds):
        who = part.sample(pop, round_generator(args.seed, 0, rnd))
        for k in who:
            trained[k] += 1
        lines.append(f"round {rnd + 1}: clients {' '.join(map(str, who))}")
    never = sum(1 for t in trained if t == 0)
    lines.append(
        f"participation over {args.rounds} rounds: each client trains {min(trained)}..{max(trained)} times; "
        f"{never} of {len(sizes)} clients never train"
    )
    return "\n".join(lines)
