"""The peers' FedAvg experiment through FedLab (``fedlab`` 1.3.0), as its documentation shows a user.

FedLab's standalone simulation (its tutorials' pattern): a ``FedDataset`` the user writes
(``get_dataloader(id, batch_size)``), an ``SGDSerialClientTrainer`` (all clients one after another in
one process, ``setup_dataset`` / ``setup_optim(epochs, batch_size, lr)``), a ``SyncServerHandler``,
and a ``StandalonePipeline`` whose ``main`` the user overrides to evaluate. One mode:
``standalone`` (FedLab's only one-process mode; its other modes are cross-process deployments over
``torch.distributed``, a server process and client processes, not a way to parallelise a
simulation on one machine, and are not run here).

What the user changes, by the hooks FedLab's docs point to: ``sample_clients`` returns the bundle's
draw of the round (FedLab's own draws with Python's global ``random``); ``SyncServerHandler`` averages
the uploads unweighted, so the trainer's ``train`` adds the client's sample count to its upload and
the handler's ``global_update`` (whose docstring says to override it for another aggregation) passes
them to FedLab's own ``Aggregators.fedavg_aggregate`` as weights; the data loader is in memory and
shuffles with hpcfl's per-(seed, round, client) generator (a ``BatchSampler`` over a ``RandomSampler``:
the same permutation and batches as hpcfl, the last partial batch kept). Evaluation: FedLab's
``fedlab.utils.functional.evaluate`` of the handler's model on the full test set after rounds 5,
10, ... and the last.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_common as pc  # noqa: E402  (first: it notes the script's start time)

MODES = {"standalone": "SGDSerialClientTrainer + SyncServerHandler (standalone), one process"}
EVAL_BATCH = 1000


def run(args, exp: pc.Experiment, rec: pc.Recorder, info: dict) -> None:
    from importlib.metadata import version

    info["version"] = version("fedlab")
    import torch
    from fedlab.contrib.algorithm.basic_client import SGDSerialClientTrainer
    from fedlab.contrib.algorithm.basic_server import SyncServerHandler
    from fedlab.contrib.dataset.basic_dataset import FedDataset
    from fedlab.core.standalone import StandalonePipeline
    from fedlab.utils import Aggregators, SerializationTool
    from fedlab.utils.functional import evaluate
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

    spec, seed, rounds = exp.spec, args.seed, args.rounds
    eval_at = pc.eval_rounds(rounds, int(spec["eval_every"]))

    class BundleDataset(FedDataset):
        """The bundle's clients in memory; ``round`` is set before each round (hpcfl's shuffle)."""

        def __init__(self) -> None:
            super().__init__()
            self.num, self.round = exp.num_clients, 0
            self.clients = [torch.as_tensor(c, dtype=torch.int64) for c in exp.clients]

        def get_dataset(self, id, type="train"):  # noqa: A002  (FedLab's names)
            idx = self.clients[id]
            return TensorDataset(exp.train_x[idx], exp.train_y[idx])

        def get_dataloader(self, id, batch_size, type="train"):  # noqa: A002
            data = self.get_dataset(id, type)
            order = RandomSampler(range(len(data)), generator=pc.client_generator(seed, self.round, id))
            return DataLoader(data, sampler=BatchSampler(order, batch_size, drop_last=False), batch_size=None)

    class Trainer(SGDSerialClientTrainer):
        """FedLab's serial SGD trainer; the upload also carries the client's sample count."""

        def train(self, model_parameters, train_loader):
            return [
                *super().train(model_parameters, train_loader),
                torch.tensor(float(len(train_loader.dataset))),
            ]

    class Handler(SyncServerHandler):
        """FedLab's synchronous server with the bundle's draw and sample-weighted averaging."""

        def sample_clients(self):
            return sorted(exp.draws[seed][self.round])

        def global_update(self, buffer):
            params = [pack[0] for pack in buffer]
            weights = torch.stack([pack[1] for pack in buffer])
            SerializationTool.deserialize_model(self._model, Aggregators.fedavg_aggregate(params, weights))

    class Pipeline(StandalonePipeline):
        """FedLab's standalone loop, with the timing and the evaluation a user adds in ``main``."""

        def main(self):
            test = DataLoader(TensorDataset(exp.test_x, exp.test_y), batch_size=EVAL_BATCH)
            while self.handler.if_stop is False:
                rnd = self.handler.round  # 0-based
                rec.round_start()
                dataset.round = rnd
                sampled = self.handler.sample_clients()
                broadcast = self.handler.downlink_package
                self.trainer.local_process(broadcast, sampled)
                uploads = self.trainer.uplink_package
                for pack in uploads:
                    self.handler.load(pack)
                rec.trained(int(sum(float(pack[1]) for pack in uploads)))
                if rnd + 1 in eval_at:
                    _, acc = evaluate(self.handler.model, torch.nn.CrossEntropyLoss(), test)
                    rec.evaluated(rnd + 1, acc)
                rec.round_end()

    model = pc.initial_model(seed, exp)
    info["num_params"] = pc.num_params(model)
    dataset = BundleDataset()
    trainer = Trainer(model, exp.num_clients, cuda=False)
    trainer.setup_dataset(dataset)
    trainer.setup_optim(int(spec["local_epochs"]), int(spec["batch_size"]), float(spec["lr"]))
    handler = Handler(model, rounds, int(spec["clients_per_round"]) / exp.num_clients, cuda=False)
    info["notes"] = (
        "FedLab's standalone SerialClientTrainer and SyncServerHandler; draw through sample_clients; "
        "sample weights through an overridden train/global_update (FedLab averages unweighted by default); "
        f"in-memory FedDataset shuffled with hpcfl's generator; evaluation batch {EVAL_BATCH}; torch threads "
        f"{torch.get_num_threads()}. FedLab has no parallel mode for a one-machine simulation."
    )
    Pipeline(handler, trainer).main()


if __name__ == "__main__":
    raise SystemExit(pc.main(MODES, run, "fedlab"))
