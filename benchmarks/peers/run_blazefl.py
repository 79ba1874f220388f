"""The peers' FedAvg experiment through BlazeFL (``blazefl`` 3.0.0a1), as its documentation shows a user.

BlazeFL's pattern (its README and ``examples/quickstart-fedavg``): a ``PartitionedDataset`` the user
writes (``get_dataloader(type_, cid, batch_size, generator)``), a ``ModelSelector``, the contrib
``FedAvgBaseServerHandler`` and one of its three client trainers, and a short pipeline loop the user
writes (sample, downlink, ``local_process``, uplink, ``load``, summary). Modes, one per trainer:

- ``single-threaded``: ``FedAvgBaseClientTrainer`` (clients one after another, torch's own threads);
- ``multi-process-2``: ``FedAvgProcessPoolClientTrainer`` with ``num_parallels=2`` (a pool of
  processes per round, started with ``spawn`` as BlazeFL's examples do; uploads through shared
  memory), 1 torch thread per worker;
- ``multi-threaded-2``: ``FedAvgThreadPoolClientTrainer`` with ``num_parallels=2``, 1 torch thread
  per worker. BlazeFL documents this mode for free-threaded Python (3.14t); the Python here has the
  GIL (torch releases it inside its ops).

What the user chooses here: the client draw (``sample_clients`` is the handler's documented hook:
it returns the bundle's draw of the round), the data loader (in memory; a batch is gathered by
indexing the client's tensors with a ``BatchSampler`` over a ``RandomSampler`` seeded by hpcfl's
per-(seed, round, client) generator: the same permutation, and so the same batches, as hpcfl's
shuffle, the last partial batch kept), and the evaluation batch (the handler's ``batch_size`` is used
only for its test loader: 1000). Aggregation is BlazeFL's own, weighted by the samples each client
trained (``data_size``): FedAvg with sample weights. Evaluation: ``get_summary()`` (the global model
on the full test set) after rounds 5, 10, ... and the last.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_common as pc  # noqa: E402  (first: it notes the script's start time)
import torch  # noqa: E402
from blazefl.contrib import (  # noqa: E402
    FedAvgBaseClientTrainer,
    FedAvgBaseServerHandler,
    FedAvgPartitionType,
    FedAvgProcessPoolClientTrainer,
    FedAvgThreadPoolClientTrainer,
)
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset  # noqa: E402

MODES = {
    "single-threaded": "FedAvgBaseClientTrainer, one process",
    "multi-process-2": "FedAvgProcessPoolClientTrainer, 2 processes (spawn) x 1 thread",
    "multi-threaded-2": "FedAvgThreadPoolClientTrainer, 2 threads x 1 torch thread (GIL Python 3.13)",
}
EVAL_BATCH = 1000


class BundleDataset:
    """BlazeFL's ``PartitionedDataset`` over the bundle's tensors (in memory; BlazeFL's examples pickle
    each client's data to disk, which only adds I/O here). ``round`` is set by the pipeline before
    each round so a client's loader shuffles with hpcfl's generator of (seed, round, client)."""

    def __init__(self, exp: pc.Experiment, seed: int) -> None:
        self.train_x, self.train_y = exp.train_x, exp.train_y
        self.test_x, self.test_y = exp.test_x, exp.test_y
        self.clients = [torch.as_tensor(c, dtype=torch.int64) for c in exp.clients]
        self.seed, self.round = seed, 0

    def get_dataset(self, type_: FedAvgPartitionType, cid: int | None) -> TensorDataset:
        if type_ == FedAvgPartitionType.TEST:
            return TensorDataset(self.test_x, self.test_y)
        idx = self.clients[cid]
        return TensorDataset(self.train_x[idx], self.train_y[idx])

    def set_dataset(self, type_: FedAvgPartitionType, cid: int | None, dataset: TensorDataset) -> None:
        """Nothing to store: the data never change (the process-pool worker calls this)."""

    def get_dataloader(
        self,
        type_: FedAvgPartitionType,
        cid: int | None,
        batch_size: int | None,
        generator: torch.Generator | None,
    ) -> DataLoader:
        data = self.get_dataset(type_, cid)
        n = len(data)
        if type_ == FedAvgPartitionType.TEST:
            order = range(n)
        else:  # hpcfl's shuffle: randperm(n) from the client's generator (as RandomSampler draws it)
            order = RandomSampler(range(n), generator=pc.client_generator(self.seed, self.round, cid))
        sampler = BatchSampler(order, batch_size or n, drop_last=False)
        return DataLoader(data, sampler=sampler, batch_size=None)  # a batch = one indexing of the tensors


class Selector:
    """BlazeFL's ``ModelSelector``: hpcfl's simplecnn drawn after ``manual_seed(seed)`` (without
    touching the global RNG, as BlazeFL's example selector does)."""

    def __init__(self, seed: int, input_shape: tuple[int, int, int], num_classes: int) -> None:
        self.seed, self.input_shape, self.num_classes = seed, input_shape, num_classes

    def select_model(self, model_name: str) -> torch.nn.Module:
        with torch.random.fork_rng([]):
            torch.manual_seed(self.seed)
            return pc.SimpleCNN(self.input_shape, self.num_classes)


class DrawHandler(FedAvgBaseServerHandler):
    """The contrib FedAvg handler with the bundle's client draw per round."""

    draws: list[list[int]]

    def sample_clients(self) -> list[int]:
        return sorted(self.draws[self.round])


def run(args, exp: pc.Experiment, rec: pc.Recorder, info: dict) -> None:
    from importlib.metadata import version

    info["version"] = version("blazefl")
    spec, seed, rounds = exp.spec, args.seed, args.rounds
    common = dict(model_selector=Selector(seed, exp.input_shape, exp.num_classes), model_name="simplecnn")
    dataset = BundleDataset(exp, seed)
    handler = DrawHandler(
        **common,
        dataset=dataset,
        global_round=rounds,
        num_clients=exp.num_clients,
        sample_ratio=int(spec["clients_per_round"]) / exp.num_clients,
        device="cpu",
        batch_size=EVAL_BATCH,
        seed=seed,
    )
    handler.draws = exp.draws[seed]
    train = dict(
        **common,
        dataset=dataset,
        device="cpu",
        num_clients=exp.num_clients,
        epochs=int(spec["local_epochs"]),
        batch_size=int(spec["batch_size"]),
        lr=float(spec["lr"]),
        seed=seed,
    )
    if args.mode == "single-threaded":
        trainer = FedAvgBaseClientTrainer(**train)
    else:
        # one torch thread per worker: 2 workers share the 2 cores (spawned workers read the variable)
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        if args.mode == "multi-process-2":
            import torch.multiprocessing as mp

            mp.set_start_method("spawn", force=True)  # as BlazeFL's examples start their pool
            state_dir = (
                Path(args.work_dir or Path(args.out).resolve().parent) / f"blazefl-state-{os.getpid()}"
            )
            trainer = FedAvgProcessPoolClientTrainer(**train, state_dir=state_dir, num_parallels=2)
        else:
            trainer = FedAvgThreadPoolClientTrainer(**train, num_parallels=2)
    trainer.progress_fn = lambda it: it  # the contrib trainers wrap jobs in a tqdm bar: not timed here
    info["num_params"] = pc.num_params(handler.model)
    info["notes"] = (
        "BlazeFL's contrib FedAvg handler and trainer; client draw through sample_clients; in-memory "
        "PartitionedDataset whose loader shuffles with hpcfl's generator (batches gathered by indexing); "
        f"evaluation batch {EVAL_BATCH}; torch threads {torch.get_num_threads()}"
        + ("" if args.mode == "single-threaded" else " per worker")
        + (
            ". Multi-threaded mode runs with the GIL (no free-threaded Python here)."
            if "threaded-2" in args.mode
            else "."
        )
    )
    eval_at = pc.eval_rounds(rounds, int(spec["eval_every"]))
    while not handler.if_stop():  # BlazeFL's pipeline loop, as its examples write it
        rnd = handler.round  # 0-based
        rec.round_start()
        dataset.round = rnd
        sampled = handler.sample_clients()
        broadcast = handler.downlink_package()
        trainer.local_process(broadcast, sampled)
        uploads = trainer.uplink_package()
        for pack in uploads:
            handler.load(pack)
        rec.trained(sum(p.data_size for p in uploads))
        if rnd + 1 in eval_at:
            rec.evaluated(rnd + 1, handler.get_summary()["server_acc"])
        rec.round_end()
    if args.mode == "multi-process-2":
        shutil.rmtree(state_dir, ignore_errors=True)  # the per-client RNG states BlazeFL kept


if __name__ == "__main__":
    raise SystemExit(pc.main(MODES, run, "blazefl"))
