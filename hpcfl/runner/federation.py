"""Everything one rank needs before the first round: data, partition, placement, model, algorithm.

Every rank computes the same partition and placement from the seed (no communication), then
keeps only the data of the clients it owns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hpcfl.algorithms import ALGORITHMS, Algorithm, ClientData, ServerState, Trainer
from hpcfl.comm import Communicator, place_clients
from hpcfl.config import Config
from hpcfl.data import Dataset, load_dataset, partition
from hpcfl.errors import ConfigError
from hpcfl.metrics.similarity import LayerSimilarity
from hpcfl.models import build_model
from hpcfl.runner.rounds import Evaluator, RoundPlan
from hpcfl.training.evaluate import evaluate
from hpcfl.training.flat import FlatModel
from hpcfl.training.sgd import LocalSchedule


@dataclass
class Federation:
    """The static part of a run as seen by one rank."""

    cfg: Config
    comm: Communicator
    device: torch.device
    dataset: Dataset
    parts: list[torch.Tensor]  # train indices of every client (all ranks know all of them)
    owned: list[int]  # the clients this rank trains
    flat: FlatModel
    algorithm: Algorithm
    trainer: Trainer
    clients: dict[int, ClientData]


def resolve_device(cfg: Config, comm: Communicator) -> torch.device:
    """CPU, or the GPU of this rank's local index (``cuda``) / the named GPU (``cuda:N``)."""
    if cfg.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("device: cuda was asked for but no CUDA GPU is visible; set device: cpu")
    if cfg.device == "cuda":
        return torch.device(f"cuda:{comm.local_rank % torch.cuda.device_count()}")
    return torch.device(cfg.device)


def schedule_of(cfg: Config) -> LocalSchedule:
    """The local SGD schedule the config describes."""
    return LocalSchedule(
        lr=cfg.lr,
        batch_size=cfg.batch_size,
        epochs=cfg.local_epochs,
        steps=cfg.local_steps,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
    )


def client_generator(seed: int, rnd: int, k: int) -> torch.Generator:
    """The RNG of client ``k`` in round ``rnd``: a pure function of (seed, round, client), so results
    do not depend on which rank trains the client or on whether the run was resumed."""
    state = np.random.SeedSequence([seed, rnd, k]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def model_evaluator(fed: Federation) -> Evaluator:
    """Test (and, when asked, train) accuracy and loss of the server model."""

    def evaluate_server(server: ServerState) -> dict[str, float]:
        fed.flat.load(server.x)
        model, ds = fed.flat.model, fed.dataset
        row: dict[str, float] = {}
        row["test_accuracy"], row["test_loss"] = evaluate(model, ds.test.x, ds.test.y, fed.comm)
        if fed.cfg.eval_train:
            row["train_accuracy"], row["train_loss"] = evaluate(model, ds.train.x, ds.train.y, fed.comm)
        return row

    return evaluate_server


def model_plan(fed: Federation) -> RoundPlan:
    """The round plan of a model-training federation (every algorithm but TCT's stage 2)."""
    return RoundPlan(
        algorithm=fed.algorithm,
        comm=fed.comm,
        data=fed.clients,
        trainer=fed.trainer,
        num_clients=len(fed.parts),
        generator=lambda rnd, k: client_generator(fed.cfg.seed, rnd, k),
        evaluate=model_evaluator(fed),
        eval_every=fed.cfg.eval_every,
        lr_hint=f" (lr is {fed.cfg.lr})",
        similarity=LayerSimilarity.for_federation(fed) if fed.cfg.cka_metrics else None,
    )


def make_algorithm(cfg: Config, flat: FlatModel) -> Algorithm:
    """Instantiate the configured algorithm with its hyper-parameter section."""
    cls = ALGORITHMS[cfg.algorithm]
    params = getattr(cfg, cfg.algorithm, None)
    if not isinstance(params, cls.Params):
        params = cls.Params()
    return cls(params, num_params=flat.num_params, state_size=flat.size)


def build_federation(cfg: Config, comm: Communicator, dataset: Dataset | None = None) -> Federation:
    """Load, partition and place; build the model from the seed (identical on every rank)."""
    device = resolve_device(cfg, comm)
    if dataset is None:
        dataset = load_dataset(cfg.dataset, cfg.data_root, download=cfg.download, **cfg.dataset_options)
    parts = partition(
        dataset.train.y,
        cfg.partition,
        cfg.num_clients,
        seed=cfg.seed,
        num_classes=dataset.num_classes,
        natural=dataset.natural_clients,
        min_size=cfg.min_client_size,
    )
    owned = place_clients([int(p.numel()) for p in parts], comm.size)[comm.rank]
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, dataset.input_shape, dataset.num_classes, **cfg.model_options).to(device)
    flat = FlatModel(model)
    clients = {
        k: ClientData(k=k, x=dataset.train.x[parts[k]].to(device), y=dataset.train.y[parts[k]].to(device))
        for k in owned
    }
    algorithm = make_algorithm(cfg, flat)
    return Federation(
        cfg=cfg,
        comm=comm,
        device=device,
        dataset=dataset,
        parts=parts,
        owned=owned,
        flat=flat,
        algorithm=algorithm,
        trainer=Trainer(flat, schedule_of(cfg)),
        clients=clients,
    )
