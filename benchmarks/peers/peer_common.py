"""What every peer runner shares: the experiment bundle, the model, the local loop, the record.

Imports ONLY the standard library, numpy and torch, so that every peer's own virtual environment
(Flower, pfl, BlazeFL, FedLab; each with its own Python) can import it::

    import sys, pathlib
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import peer_common as pc          # first: it notes the script's start time (startup_s)

A runner defines ``MODES = {"key": "description", ...}`` (a literal dict at the top level: the
harness reads it without importing the runner; the first key is the default mode) and ends with
``sys.exit(pc.main(MODES, run, "framework"))`` where ``run(args, exp, rec, info)`` drives the
framework for ``args.rounds`` rounds and reports to the :class:`Recorder` ``rec``. The command
line (``--experiment DIR --seed S --mode MODE --out FILE.json [--rounds R]``), the bundle, the
sampler of peak RSS and the record (written atomically, also when the run fails) are handled here.
A runner that also runs hpcfl's server optimisers with the peer's own (issue 60, item 5) defines
``ALGORITHMS = ("fedavg", ...)`` (a literal tuple, read by the harness the same way) and passes it
as ``pc.main(..., algorithms=ALGORITHMS)``: ``--algorithm NAME`` then picks one (``args.algorithm``,
recorded as ``algorithm``); every other runner runs FedAvg only.

The conventions (each matches hpcfl's, checked by ``tests/test_peers_harness.py``):

- the model is hpcfl's ``simplecnn`` (:class:`SimpleCNN`: same layers, same parameter order), its
  initial weights drawn after ``torch.manual_seed(seed)`` as hpcfl draws them (:func:`initial_model`);
- local training is plain ``torch.optim.SGD`` (no momentum, no weight decay), one fresh permutation
  per epoch, the last partial batch kept, mean cross-entropy (:func:`train_one_epoch`); the client's
  generator is hpcfl's, a pure function of (seed, round, client) (:func:`client_generator`);
- the global model is evaluated in eval mode on the full test set (:func:`evaluate`) after rounds
  5, 10, ... and after the last round (:func:`eval_rounds`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCRIPT_START = time.perf_counter()  # before the framework is imported: the origin of startup_s

import numpy as np  # noqa: E402  (the start time is taken first on purpose)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_EXPERIMENT = "bench-out/peers/experiment"
BUNDLE_FILES = (
    "train_x.npy",
    "train_y.npy",
    "test_x.npy",
    "test_y.npy",
    "clients.json",
    "draws.json",
    "spec.json",
)


# ---------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class Experiment:
    """The bundle written by ``experiment.py``: the same arrays, clients and draws for every framework."""

    train_x: Tensor  # float32 (N, 1, 28, 28), normalised as hpcfl normalises Fashion-MNIST
    train_y: Tensor  # int64 (N,)
    test_x: Tensor  # float32 (M, 1, 28, 28)
    test_y: Tensor  # int64 (M,)
    clients: list[list[int]]  # hpcfl's dir:0.5 partition: sorted train indices per client
    draws: dict[int, list[list[int]]]  # seed -> the round's 10 client ids (sorted), per round
    spec: dict[str, Any]  # rounds, clients_per_round, local_epochs, batch_size, lr, ...

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def num_classes(self) -> int:
        return int(self.spec.get("num_classes", 10))

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(int(d) for d in self.train_x.shape[1:])  # type: ignore[return-value]

    def client_data(self, k: int) -> tuple[Tensor, Tensor]:
        """Client ``k``'s training samples (a copy, gathered by its index list)."""
        idx = torch.as_tensor(self.clients[k], dtype=torch.int64)
        return self.train_x[idx], self.train_y[idx]

    def draw(self, seed: int, rnd: int) -> list[int]:
        """The client ids of round ``rnd`` (1-based) for ``seed``."""
        return list(self.draws[seed][rnd - 1])


def load_experiment(directory: str | os.PathLike[str], *, mmap: bool = False) -> Experiment:
    """Read the bundle (arrays as torch tensors); a missing or incomplete bundle is a ValueError.

    ``mmap=True`` maps the arrays copy-on-write instead of reading them (a process that trains a
    few clients, such as a Ray actor, reads only their rows)."""
    d = Path(directory)
    missing = [f for f in BUNDLE_FILES if not (d / f).is_file()]
    if missing:
        raise ValueError(
            f"experiment bundle {d} lacks {', '.join(missing)}; build it with benchmarks/peers/experiment.py"
        )

    def arr(name: str) -> Tensor:
        return torch.from_numpy(np.load(d / name, mmap_mode="c" if mmap else None))

    draws = {
        int(s): [list(map(int, r)) for r in rounds]
        for s, rounds in json.loads((d / "draws.json").read_text()).items()
    }
    return Experiment(
        train_x=arr("train_x.npy"),
        train_y=arr("train_y.npy"),
        test_x=arr("test_x.npy"),
        test_y=arr("test_y.npy"),
        clients=[list(map(int, c)) for c in json.loads((d / "clients.json").read_text())],
        draws=draws,
        spec=json.loads((d / "spec.json").read_text()),
    )


# --------------------------------------------------------------------------------------------- model
def _conv_out(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


class SimpleCNN(nn.Module):
    """hpcfl's ``simplecnn`` (hpcfl/models/simplecnn.py) as a plain module: the same layers, built in
    the same order (so the same seed draws the same weights), the same state_dict keys.

    conv 3×3/2 (1→32) → ReLU → conv 3×3/2 (32→64) → ReLU → conv 3×3/2 (64→128) → ReLU → flatten →
    fc (2048→128) → ReLU → fc (128→10): 356,234 parameters on 1×28×28 with 10 classes.
    """

    def __init__(self, input_shape: tuple[int, int, int] = (1, 28, 28), num_classes: int = 10) -> None:
        super().__init__()
        channels, height, width = input_shape
        self.conv1 = nn.Conv2d(channels, 32, kernel_size=3, stride=2, padding=1)
        self.relu1 = nn.ReLU(inplace=False)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, stride=2, padding=1)
        self.relu2 = nn.ReLU(inplace=False)
        self.conv3 = nn.Conv2d(64, 128, kernel_size=3, stride=2, padding=1)
        self.relu3 = nn.ReLU(inplace=False)
        for _ in range(3):
            height, width = _conv_out(height, 3, 2, 1), _conv_out(width, 3, 2, 1)
        self.fc1 = nn.Linear(128 * height * width, 128)
        self.relu4 = nn.ReLU(inplace=False)
        self.classifier = nn.Linear(128, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu1(self.conv1(x))  # (B, 32, 14, 14)
        x = self.relu2(self.conv2(x))  # (B, 64, 7, 7)
        x = self.relu3(self.conv3(x))  # (B, 128, 4, 4)
        x = self.relu4(self.fc1(torch.flatten(x, 1)))  # (B, 128)
        return self.classifier(x)  # (B, C)


def initial_model(seed: int, exp: Experiment | None = None) -> SimpleCNN:
    """The global model of round 0 for ``seed``: drawn after ``torch.manual_seed(seed)``, as hpcfl
    draws its model, so every framework starts from the same weights."""
    torch.manual_seed(seed)
    if exp is None:
        return SimpleCNN()
    return SimpleCNN(exp.input_shape, exp.num_classes)


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def get_weights(model: nn.Module) -> list[np.ndarray]:
    """The state dict as a list of numpy arrays (state_dict order): what Flower and FedLab exchange."""
    return [v.detach().cpu().numpy().copy() for v in model.state_dict().values()]


def set_weights(model: nn.Module, weights: Sequence[np.ndarray]) -> None:
    """Load a list of arrays (state_dict order) into ``model``."""
    keys = list(model.state_dict().keys())
    model.load_state_dict({k: torch.as_tensor(np.asarray(w)) for k, w in zip(keys, weights, strict=True)})


# -------------------------------------------------------------------------------------------- train
def client_generator(seed: int, rnd: int, k: int) -> torch.Generator:
    """Client ``k``'s shuffling generator in round ``rnd`` (0-based): hpcfl's own
    (``hpcfl.runner.federation.client_generator``: ``np.random.SeedSequence([seed, rnd, k])``'s first
    two 32-bit words, high word first), so every framework shuffles each client as hpcfl does."""
    words = np.random.SeedSequence([seed, rnd, k]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(words[0]) << 32 | int(words[1]))


def train_one_epoch(
    model: nn.Module, x: Tensor, y: Tensor, batch_size: int, lr: float, generator: torch.Generator
) -> tuple[float, int]:
    """One local epoch of plain SGD (no momentum, no weight decay) on mean cross-entropy: a fresh
    permutation of the client's samples, cut into batches, the last partial batch kept (hpcfl's
    convention, ``drop_last: false``; as a ``DataLoader(shuffle=True)`` does). Batches are gathered
    by indexing the client's tensors (what a user who cares about speed writes; a ``DataLoader`` over
    a ``TensorDataset`` collates sample by sample and is slower on every framework alike).
    Returns (mean loss over the steps, steps)."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0, weight_decay=0.0)
    n = x.shape[0]
    perm = torch.randperm(n, generator=generator)
    total, steps = 0.0, 0
    for start in range(0, n, batch_size):
        idx = perm[start : start + batch_size]
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += float(loss.detach())
        steps += 1
    return total / max(steps, 1), steps


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 1000) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` in eval mode on (x, y)."""
    was_training = model.training
    model.eval()
    correct, loss = 0, 0.0
    for start in range(0, x.shape[0], batch_size):
        logits = model(x[start : start + batch_size])
        target = y[start : start + batch_size]
        loss += float(F.cross_entropy(logits, target, reduction="sum"))
        correct += int((logits.argmax(1) == target).sum())
    model.train(was_training)
    n = max(int(x.shape[0]), 1)
    return correct / n, loss / n


def eval_rounds(rounds: int, every: int) -> set[int]:
    """The rounds (1-based) after which the global model is evaluated: every ``every``-th and the last."""
    return set(range(every, rounds + 1, every)) | {rounds}


def weighted_average(states: Sequence[Sequence[np.ndarray]], weights: Sequence[float]) -> list[np.ndarray]:
    """Σ w_k·θ_k / Σ w_k per array (float64 accumulation): the sample-weighted FedAvg mean, for a
    framework whose own aggregator must be checked or whose handler leaves the mean to the user."""
    total = float(sum(weights))
    out = []
    for arrays in zip(*states, strict=True):
        acc = np.zeros(arrays[0].shape, dtype=np.float64)
        for w, a in zip(weights, arrays, strict=True):
            acc += float(w) * np.asarray(a, dtype=np.float64)
        out.append((acc / total).astype(arrays[0].dtype))
    return out


# ------------------------------------------------------------------------------------------- memory
class ProcessTreeRss:
    """Peak of the summed RSS of this process and all its descendants (Ray's workers, spawned
    processes), sampled from /proc every ``interval`` seconds in a daemon thread. Use as a context
    manager or start()/stop(); ``peak_mb`` is the peak so far in MiB (1 MB = 2**20 bytes)."""

    def __init__(self, interval: float = 0.1, root: int | None = None) -> None:
        self.interval, self.root = interval, root or os.getpid()
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._page = os.sysconf("SC_PAGE_SIZE")

    @staticmethod
    def _children() -> dict[int, list[int]]:
        tree: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            # the command name may hold spaces and parentheses: the fields after the last ')' are fixed
            ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
            tree.setdefault(ppid, []).append(int(entry))
        return tree

    def tree_pids(self) -> list[int]:
        """This process and every descendant alive now."""
        tree, out, todo = self._children(), [], [self.root]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(tree.get(pid, []))
        return out

    def sample(self) -> int:
        """The summed RSS of the tree now, in bytes (and the peak updated)."""
        total = 0
        for pid in self.tree_pids():
            try:
                with open(f"/proc/{pid}/statm", "rb") as f:
                    total += int(f.read().split()[1]) * self._page
            except (OSError, IndexError, ValueError):
                continue  # ended between the listing and the read
        self.peak_bytes = max(self.peak_bytes, total)
        return total

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> ProcessTreeRss:
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> float:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        return self.peak_mb

    @property
    def peak_mb(self) -> float:
        return self.peak_bytes / 2**20

    def __enter__(self) -> ProcessTreeRss:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ------------------------------------------------------------------------------------------- record
def write_record(path: str | os.PathLike[str], record: dict[str, Any]) -> Path:
    """Write ``record`` as JSON atomically: a temp file in the same folder, fsync, then rename, so a
    record under ``path`` is always complete."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target


@dataclass
class Recorder:
    """Collects a run's timings as the framework's hooks report them.

    Call :meth:`round_start` when round r begins (the first call fixes ``startup_s``),
    :meth:`trained` when its aggregation is done (→ ``round_s``), :meth:`evaluated` with an accuracy
    when the round's evaluation is done, and :meth:`round_end` when the round is over
    (→ ``round_eval_s``; equal to ``round_s`` plus the evaluation on evaluated rounds)."""

    start: float = SCRIPT_START
    startup_s: float | None = None
    round_s: list[float] = field(default_factory=list)
    round_eval_s: list[float] = field(default_factory=list)
    samples_per_round: list[int] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    _t: float | None = None

    def round_start(self) -> None:
        now = time.perf_counter()
        if self.startup_s is None:
            self.startup_s = now - self.start
        self._t = now

    def trained(self, samples: int) -> None:
        assert self._t is not None, "trained() before round_start()"
        self.round_s.append(time.perf_counter() - self._t)
        self.samples_per_round.append(int(samples))

    def evaluated(self, rnd: int, accuracy: float, loss: float | None = None) -> None:
        row: dict[str, float] = {"round": int(rnd), "accuracy": float(accuracy)}
        if loss is not None:
            row["loss"] = float(loss)
        self.evals.append(row)

    def round_end(self) -> None:
        assert self._t is not None, "round_end() before round_start()"
        self.round_eval_s.append(time.perf_counter() - self._t)
        self._t = None


def one_line(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return (text[0] if text else type(err).__name__)[:500]


def parse_args(
    modes: dict[str, str], argv: Sequence[str] | None = None, algorithms: Sequence[str] = ("fedavg",)
) -> argparse.Namespace:
    """The runners' common command line; ``modes`` maps a mode key to its description, the first
    being the default; ``algorithms`` the runner's algorithms (``--algorithm``, default fedavg)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--experiment", default=DEFAULT_EXPERIMENT, help="bundle directory (experiment.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", default=next(iter(modes)), choices=list(modes))
    p.add_argument("--out", required=True, help="the record (JSON), written atomically")
    p.add_argument(
        "--rounds", type=int, default=None, help="fewer rounds than the bundle's spec (smoke runs)"
    )
    p.add_argument(
        "--work-dir", default=None, help="scratch folder for the framework (default: beside --out)"
    )
    p.add_argument("--algorithm", default="fedavg", choices=list(algorithms))
    return p.parse_args(argv)


def main(
    modes: dict[str, str],
    run: Callable[[argparse.Namespace, Experiment, Recorder, dict[str, Any]], None],
    framework: str,
    argv: Sequence[str] | None = None,
    algorithms: Sequence[str] = ("fedavg",),
) -> int:
    """Parse the command line, load the bundle, sample RSS, call ``run(args, exp, rec, info)`` and
    write the record. ``run`` drives the framework for ``args.rounds`` rounds, reporting to ``rec``;
    it fills ``info`` as early as it can (``version``; ``mode``, ``notes`` if they differ from the
    mode's description) so that a failure's record still names them. Any exception becomes ``status: failed`` with its
    one-line error (the traceback goes to stderr); the exit code is 0 for ok, 1 for failed."""
    args = parse_args(modes, argv, algorithms)
    rec = Recorder()
    info: dict[str, Any] = {
        "framework": framework,
        "version": "unknown",
        "mode": modes[args.mode],
        "notes": "",
    }
    status, error = "ok", None
    sampler = ProcessTreeRss().start()
    try:
        exp = load_experiment(args.experiment)
        if args.rounds is None:
            args.rounds = int(exp.spec["rounds"])
        if args.seed not in exp.draws:
            raise ValueError(
                f"seed {args.seed} has no client draw in {args.experiment} (seeds {sorted(exp.draws)})"
            )
        if args.rounds > len(exp.draws[args.seed]):
            raise ValueError(
                f"--rounds {args.rounds} exceeds the bundle's {len(exp.draws[args.seed])} drawn rounds"
            )
        info["num_params"] = int(exp.spec.get("num_params", 0))
        run(args, exp, rec, info)
        if len(rec.round_s) != args.rounds:
            raise RuntimeError(f"{len(rec.round_s)} rounds were timed, {args.rounds} were asked")
    except BaseException as err:  # a record for every failure, KeyboardInterrupt included
        status, error = "failed", one_line(err)
        traceback.print_exc()
    peak = sampler.stop()
    record = {
        "framework": info["framework"],
        "version": info["version"],
        "mode": info["mode"],
        "mode_key": args.mode,
        "algorithm": args.algorithm,
        "seed": args.seed,
        "status": status,
        "error": error,
        "startup_s": rec.startup_s,
        "round_s": rec.round_s,
        "round_eval_s": rec.round_eval_s,
        "samples_per_round": rec.samples_per_round,
        "eval": rec.evals,
        "peak_rss_mb": peak,
        "num_params": int(info.get("num_params", 0)),
        "notes": info.get("notes", ""),
        # a server optimiser's hyper-parameters as the framework ran it (None for FedAvg)
        "server_params": info.get("server_params"),
        "rounds": args.rounds,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
    }
    write_record(args.out, record)
    return 0 if status == "ok" else 1
