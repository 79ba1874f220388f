"""The peers' FedAvg experiment through pfl-research (``pfl`` 0.6.0), as its documentation shows a user.

pfl's simulation API: a ``FederatedDataset`` (a ``make_dataset_fn(user_id)`` and a user sampler), a
``PyTorchModel`` (the module plus a local optimizer factory and a central optimizer), a
``SimulatedBackend`` with a ``WeightByDatapoints`` postprocessor (pfl averages per user unless told
to weight by data points), ``FederatedAveraging().run(...)`` with ``NNAlgorithmParams`` and
``NNTrainHyperParams``, and callbacks for evaluation. Modes:

- ``simulated``: one process (pfl's default ``SimulatedBackend``, torch's own intra-op threads);
- ``torchrun-2``: pfl's multi-worker simulation on one machine, 2 workers under ``torchrun``
  (``torch.distributed`` with gloo on a CPU; torchrun gives each worker 1 thread). Each worker
  trains its half of the cohort; pfl all-reduces the summed statistics.

What the user chooses here, by pfl's public hooks: the client draw (the user sampler is any
callable returning a user id: it returns the bundle's draw in order, so rounds see hpcfl's clients;
in 2-worker mode pfl asks it once per worker per slot, so both workers stay in step), and the
shuffling (pfl's ``Dataset`` slices a user's data in a fixed order every epoch; ``make_dataset_fn``
hands it the client's samples permuted by hpcfl's per-(seed, round, client) generator, which is
hpcfl's shuffle each epoch with 1 local epoch). Evaluation of the global model on the full test set
after rounds 5, 10, ... and the last, through ``PyTorchModel.evaluate`` in a callback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_common as pc  # noqa: E402  (first: it notes the script's start time)

MODES = {
    "simulated": "SimulatedBackend, one process",
    "torchrun-2": "SimulatedBackend, 2 workers (torchrun, gloo, 1 thread each)",
}
WORKER_OUT = "PEERS_PFL_WORKER_OUT"  # set by the parent for its torchrun workers: where rank 0 writes


def _train(args, exp: pc.Experiment, rec: pc.Recorder, info: dict) -> None:
    """Build pfl's objects and run FedAvg for ``args.rounds`` rounds, timing through ``rec``."""
    import torch
    import torch.nn.functional as F
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.internal import ops as pfl_ops
    from pfl.internal.ops.selector import get_default_framework_module
    from pfl.metrics import Metrics, StringMetricName, Weighted
    from pfl.model.pytorch import PyTorchModel
    from pfl.version import __version__

    info["version"] = __version__
    spec, seed, rounds = exp.spec, args.seed, args.rounds
    per_round = int(spec["clients_per_round"])
    draws = exp.draws[seed][:rounds]

    class Net(pc.SimpleCNN):
        """hpcfl's simplecnn with the ``loss`` and ``metrics`` methods pfl's PyTorchModel calls."""

        def loss(self, x, y, eval=False):  # noqa: A002  (pfl's keyword)
            self.eval() if eval else self.train()
            return F.cross_entropy(self(x), y)

        @torch.no_grad()
        def metrics(self, x, y, eval=True):  # noqa: A002
            self.eval()
            logits = self(x)
            n = len(y)
            return {
                "loss": Weighted(float(F.cross_entropy(logits, y, reduction="sum")), n),
                "accuracy": Weighted(float((logits.argmax(1) == y).sum()), n),
            }

    net = Net(exp.input_shape, exp.num_classes)
    net.load_state_dict(pc.initial_model(seed, exp).state_dict())
    info["num_params"] = pc.num_params(net)

    class DrawSampler:
        """pfl's user-sampler interface (``callable() -> user_id``), returning the bundle's draw in order."""

        def __init__(self) -> None:
            self.flat = [(r, k) for r, ids in enumerate(draws) for k in ids]
            self.i, self.round = 0, 0

        def __call__(self) -> int:
            self.round, k = self.flat[self.i]
            self.i += 1
            return k

    sampler = DrawSampler()

    def make_dataset_fn(k: int) -> Dataset:
        x, y = exp.client_data(k)
        perm = torch.randperm(len(y), generator=pc.client_generator(seed, sampler.round, k))
        return Dataset(raw_data=(x[perm], y[perm]), user_id=str(k))

    train_data = FederatedDataset(make_dataset_fn, sampler)
    test_data = Dataset(raw_data=(exp.test_x, exp.test_y))
    eval_params = NNEvalHyperParams(local_batch_size=1000)
    model = PyTorchModel(
        model=net,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0),  # lr 1: FedAvg's plain mean
    )
    ops = get_default_framework_module()
    distributed = ops.distributed
    eval_at = pc.eval_rounds(rounds, int(spec["eval_every"]))
    samples = [sum(len(exp.clients[k]) for k in ids) for ids in draws]
    acc_name = StringMetricName("Central val | accuracy")

    class Trained(TrainingProcessCallback):
        """First in the list: the round's training and aggregation are done."""

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            rec.trained(samples[central_iteration])
            return False, Metrics()

    class CentralEval(TrainingProcessCallback):
        """The global model on the full test set (split over workers, counts all-reduced) after
        the evaluated rounds."""

        def __init__(self) -> None:
            self.part = test_data.get_worker_partition()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            if central_iteration + 1 not in eval_at:
                return False, Metrics()
            metrics = model.evaluate(self.part, lambda n: StringMetricName(f"Central val | {n}"), eval_params)
            return False, pfl_ops.all_reduce_metrics(metrics) if distributed.world_size > 1 else metrics

    class RoundEnd(TrainingProcessCallback):
        """Last in the list: the round, its evaluation included, is over; the next one starts."""

        def on_train_begin(self, *, model):
            rec.round_start()
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            if central_iteration + 1 in eval_at:
                rec.evaluated(central_iteration + 1, aggregate_metrics[acc_name].overall_value)
            rec.round_end()
            if central_iteration + 1 < rounds:
                rec.round_start()
            return False, Metrics()

    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=rounds,
            evaluation_frequency=rounds + 1,  # no per-user evaluation (pfl does it at iteration 0 only)
            train_cohort_size=per_round,
            val_cohort_size=0,
        ),
        backend=SimulatedBackend(
            training_data=train_data, val_data=None, postprocessors=[WeightByDatapoints()]
        ),
        model=model,
        model_train_params=NNTrainHyperParams(
            local_num_epochs=int(spec["local_epochs"]),
            local_learning_rate=float(spec["lr"]),
            local_batch_size=int(spec["batch_size"]),
        ),
        model_eval_params=eval_params,
        callbacks=[Trained(), CentralEval(), RoundEnd()],
    )
    info["world_size"] = distributed.world_size
    info["rank"] = distributed.global_rank


NOTES = (
    "pfl averages per user by default: WeightByDatapoints given; pfl's Dataset iterates a user's data in a "
    "fixed order, so make_dataset_fn permutes it with hpcfl's per-(seed, round, client) generator; the central "
    "optimizer is SGD lr 1 (the plain mean); per-user evaluation only at iteration 0 (pfl always evaluates there)."
)


def run(args, exp: pc.Experiment, rec: pc.Recorder, info: dict) -> None:
    info["notes"] = NOTES
    if args.mode == "simulated":
        _train(args, exp, rec, info)
        return
    # torchrun-2: two workers run this file; rank 0 writes its timings, this process reads them.
    work = Path(args.work_dir or Path(args.out).resolve().parent) / f"pfl-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    out = work / "rank0.json"
    wall_start = time.time() - (time.perf_counter() - pc.SCRIPT_START)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__).resolve()), *sys.argv[1:]]  # fmt: skip
    proc = subprocess.run(cmd, env={**os.environ, WORKER_OUT: str(out)}, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"torchrun exited {proc.returncode}: {_root_cause(proc.stderr or proc.stdout)}")
    got = json.loads(out.read_text())
    shutil.rmtree(work, ignore_errors=True)
    rec.startup_s = got["first_round_wall"] - wall_start
    rec.round_s, rec.round_eval_s = got["round_s"], got["round_eval_s"]
    rec.samples_per_round, rec.evals = got["samples_per_round"], got["eval"]
    info["version"], info["num_params"] = got["version"], got["num_params"]
    info["notes"] = f"{NOTES} {got['world_size']} workers, torch threads per worker {got['threads']}."


def _root_cause(text: str) -> str:
    """The failing worker as torchrun's summary names it (rank, exit code, signal), else the last
    error line a worker printed."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if "Root Cause (first observed failure):" in lines:
        cause = lines[lines.index("Root Cause (first observed failure):") :]
        fields = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in cause) if k.strip() in ("rank", "exitcode", "traceback")}  # fmt: skip
        return "; ".join(f"{k} {v}" for k, v in fields.items())
    errors = [ln for ln in lines if "Error" in ln and not ln.startswith("File ")]
    return errors[-1] if errors else (lines[-1] if lines else "no output")


def worker() -> int:
    """A torchrun worker: train, and on rank 0 write the timings for the parent."""
    import torch

    args = pc.parse_args(MODES)
    exp = pc.load_experiment(args.experiment)
    args.rounds = args.rounds or int(exp.spec["rounds"])
    rec, info = pc.Recorder(), {}
    first = {}
    start = rec.round_start

    def round_start() -> None:  # the wall clock of round 1's start, comparable across processes
        first.setdefault("wall", time.time())
        start()

    rec.round_start = round_start
    _train(args, exp, rec, info)
    if info["rank"] == 0:
        pc.write_record(os.environ[WORKER_OUT], {
            "first_round_wall": first["wall"], "round_s": rec.round_s, "round_eval_s": rec.round_eval_s,
            "samples_per_round": rec.samples_per_round, "eval": rec.evals, "version": info["version"],
            "num_params": info["num_params"], "world_size": info["world_size"], "threads": torch.get_num_threads(),
        })  # fmt: skip
    return 0


if __name__ == "__main__":
    if WORKER_OUT in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
        raise SystemExit(worker())
    raise SystemExit(pc.main(MODES, run, "pfl"))
