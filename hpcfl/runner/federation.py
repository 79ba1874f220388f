"""Everything one rank needs before the first round: data, partition, model, algorithm.

Every rank computes the same partition from the seed (no communication). Participants are placed
on ranks afresh every round, so any rank can train any client: each rank keeps the whole training
set in memory (it is loaded whole anyway; the cost per rank is the dataset, e.g. 188 MB for
Fashion-MNIST in float32) and slices a client's samples onto the device when it trains it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from hpcfl.algorithms import ALGORITHMS, Algorithm, ClientData, ServerState, Trainer
from hpcfl.algorithms.asynchronous import AsyncAlgorithm
from hpcfl.algorithms.clock import VirtualClock
from hpcfl.algorithms.participation import Participation, Population
from hpcfl.algorithms.stage_types import Evaluator, Observer, RoundPlan
from hpcfl.algorithms.system import SystemModel
from hpcfl.comm import Communicator, place_clients
from hpcfl.config import Config
from hpcfl.data import Dataset, load_dataset, parse_partition_spec, partition
from hpcfl.data.testset import run_test_set
from hpcfl.errors import ConfigError
from hpcfl.metrics.conformal import conformal_metrics
from hpcfl.metrics.drift import DriftDiversity
from hpcfl.metrics.similarity import LayerSimilarity
from hpcfl.models import build_model
from hpcfl.registry import MODEL_SPECS
from hpcfl.runner.client_eval import ClientEval, EvalSettings
from hpcfl.runner.executor import resolve_client_batch
from hpcfl.runner.heldout import HeldOut, HeldOutEval, hold_out
from hpcfl.runner.observers import Drift, LayerCKA
from hpcfl.runner.progress import EvalBar
from hpcfl.runner.shares import split_clients
from hpcfl.training.evaluate import JointCounts, accuracy_loss, shard_counts, shard_range, with_probs
from hpcfl.training.flat import FlatModel
from hpcfl.training.layout import StateLayout
from hpcfl.training.seeds import seeded_generator
from hpcfl.training.sgd import LocalSchedule
from hpcfl.units import parse_client_batch


@dataclass
class Federation:
    """The static part of a run as seen by one rank; stage code reads it as a
    :class:`~hpcfl.algorithms.stage_types.FederationView` (everything here but ``cfg`` and ``comm``)."""

    cfg: Config
    comm: Communicator
    device: torch.device
    dataset: Dataset
    parts: list[torch.Tensor]  # train indices of every client (all ranks know all of them)
    owned: list[int]  # the clients this rank trains under full participation (static placement)
    validation: torch.Tensor | None  # train indices held out from every client (cfg.validation), or None
    validation_parts: list[torch.Tensor] | None  # the same per client (``validation`` joins them)
    client_eval: list[torch.Tensor] | None  # each client's held-out share (cfg.client_eval), or None
    flat: FlatModel
    algorithm: Algorithm
    trainer: Trainer
    client_batch: int = 1  # participants per vectorised group: ``client_batch`` with ``auto`` resolved
    system: SystemModel | None = None  # unequal work and dropped participants (``system``), None when off
    clock: VirtualClock | None = None  # simulated time (``system.clock``), None when off
    heldout: HeldOut | None = None  # the clients that never train (``heldout_clients``), None when 0
    _cache: dict[int, ClientData] = field(default_factory=dict, repr=False)

    @property
    def population(self) -> Population:
        return Population(tuple(int(p.numel()) for p in self.parts))

    def client_data(self, k: int) -> ClientData:
        """Client ``k``'s training samples on the device (sliced from the resident training set).

        Under full participation of a synchronous algorithm the clients of the static placement are
        kept after their first use (they are the ones this rank trains every round); otherwise every
        client is sliced anew. Keeping them under partial participation made the process grow by a
        copy of the training set as clients were first drawn (issue 63's soak: 10,000 clients, 100 a
        round, RSS still growing after round 100) for no gain: a client drawn once in a hundred
        rounds is sliced in microseconds.
        """
        if k in self._cache:
            return self._cache[k]
        idx = self.parts[k]
        data = ClientData(
            k=k, x=self.dataset.train.x[idx].to(self.device), y=self.dataset.train.y[idx].to(self.device)
        )
        if k in self.owned and self._keeps_data():
            self._cache[k] = data
        return data

    def _keeps_data(self) -> bool:
        """Whether every owned client trains every round (full, synchronous participation)."""
        algo, count = self.algorithm, self.algorithm.participation.count
        return not isinstance(algo, AsyncAlgorithm) and (
            count is None or count >= len(self.parts)
        )  # Participation.full

    @property
    def clients(self) -> dict[int, ClientData]:
        """The data of the clients this rank owns under the static placement (feature extraction)."""
        return {k: self.client_data(k) for k in self.owned}

    @property
    def seed(self) -> int:
        return self.cfg.seed

    @property
    def reduction(self) -> str:
        return self.cfg.reduction

    @property
    def chosen_metrics(self) -> tuple[str, ...]:
        """The config keys of the optional round metrics turned on."""
        return tuple(k for k in ("cka_metrics", "drift_diversity") if getattr(self.cfg, k))

    @property
    def model_name(self) -> str:
        return self.cfg.model

    @property
    def flat_inputs(self) -> bool:
        return MODEL_SPECS[self.cfg.model].flat_inputs

    def build_model(self, input_shape: tuple[int, int, int]) -> torch.nn.Module:
        """The configured model for ``input_shape``, initialised from the run's seed, on the device."""
        torch.manual_seed(self.cfg.seed)
        model = build_model(
            self.cfg.model,
            input_shape,
            self.dataset.num_classes,
            vocab_size=self.dataset.vocab_size,
            **self.cfg.model_options,
        )
        return model.to(self.device)

    def model_plan(self) -> RoundPlan:
        return model_plan(self)

    def evaluation_sets(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The splits the server model is evaluated on (:func:`model_evaluator`), in row order: the
        test set, then the held-out validation samples and the training set where the config asks."""
        ds = self.dataset
        sets = {"test": (ds.test.x, ds.test.y)}
        if self.validation is not None:
            sets["val"] = (ds.train.x[self.validation], ds.train.y[self.validation])
        if self.cfg.eval_train:
            sets["train"] = (ds.train.x, ds.train.y)
        return sets

    def client_evaluation(
        self,
        score: Callable[[torch.Tensor, int], tuple[float, float]],
        place: Callable[[list[int]], list[int]],
        finetune: Callable[[torch.Tensor, int, int], torch.Tensor | None] | None,
    ) -> Observer | None:
        """:meth:`FederationView.client_evaluation`: a :class:`~hpcfl.runner.client_eval.ClientEval`
        over the given functions, with the config's sample, fine-tuning steps and seed."""
        if self.client_eval is None:
            return None
        ft = self.cfg.finetune_eval
        return ClientEval(
            score=score,
            held_sizes=[int(s.numel()) for s in self.client_eval],
            place=place,
            tune=None if finetune is None or ft.steps == 0 else lambda x, k, rnd: finetune(x, k, ft.steps),
            last_only=ft.rounds == "last",
            sample=self.cfg.client_eval_clients,
            seed=self.cfg.seed,
        )


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
        drop_last=cfg.drop_last,
    )


def client_generator(seed: int, rnd: int, k: int) -> torch.Generator:
    """The RNG of client ``k`` in round ``rnd``: a pure function of (seed, round, client), so results
    do not depend on which rank trains the client or on whether the run was resumed."""
    return seeded_generator(seed, rnd, k)


def _shard_size(n: int, comm: Communicator) -> int:
    start, stop = shard_range(n, comm.rank, comm.size)
    return stop - start


def model_evaluator(
    flat: FlatModel,
    comm: Communicator,
    sets: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    *,
    conformal_calibration: float | None = None,
    seed: int = 0,
    progress: bool = False,
) -> Evaluator:
    """Accuracy and loss of the server's reported model on each of ``sets`` (split → (x, y);
    ``"test"`` is required), and the test columns of any other model it names
    (:meth:`ServerState.evaluated`): every rank counts its shards of each, and ONE allreduce sums
    them with the observers' ``joint`` counts. The vectors are loaded into ``flat``, the working
    model. With ``conformal_calibration`` (a fraction of the test set, drawn from ``seed``) the test
    split also gets conformal coverage and set size. ``progress``: a bar over the samples scored,
    shown once an evaluation has taken a few seconds (:class:`~hpcfl.runner.progress.EvalBar`)."""
    test_y = sets["test"][1]
    conformal = conformal_calibration is not None
    shard = {name: _shard_size(len(y), comm) for name, (_, y) in sets.items()}  # this rank's samples

    def evaluate_server(server: ServerState, joint: JointCounts) -> dict[str, float]:
        models = server.evaluated()
        flat.load(models[""])
        model = flat.model
        bar = EvalBar(
            sum(shard[name] * (len(models) if name == "test" else 1) for name in shard), enabled=progress
        )
        own = {  # (split, model suffix): this rank's counts
            (name, ""): shard_counts(model, x, y, comm, probs=conformal and name == "test", tick=bar.tick)
            for name, (x, y) in sets.items()
        }
        for suffix, vec in models.items():
            if suffix:
                flat.load(vec)
                own["test", suffix] = shard_counts(model, *sets["test"], comm, tick=bar.tick)
        bar.close()
        summed = dict(zip(own, joint.reduce(comm, list(own.values())), strict=True))
        row: dict[str, float] = {}
        test = summed.pop(("test", ""))
        if conformal_calibration is not None:
            row["test_accuracy"], row["test_loss"], probs = with_probs(test, test_y.numel())
            row.update(
                conformal_metrics(probs, test_y, seed=seed, calibration_fraction=conformal_calibration)
            )
        else:
            row["test_accuracy"], row["test_loss"] = accuracy_loss(test)
        for (split, suffix), counts in summed.items():
            row[f"{split}_accuracy{suffix}"], row[f"{split}_loss{suffix}"] = accuracy_loss(counts)
        return row

    return evaluate_server


def divergence_settings(fed: Federation) -> tuple[tuple[str, float], ...]:
    """The settings besides ``lr`` a NaN model may come from, with their values: the algorithm's
    ``divergence_params`` and, under differential privacy, the clip (its noise scales with it)."""
    algo = fed.algorithm
    keys = [(f"params.{n}", float(getattr(algo.params, n))) for n in algo.divergence_params]
    if fed.cfg.privacy.enabled:
        keys.append(("privacy.clip", float(fed.cfg.privacy.clip)))
    return tuple(keys)


def model_plan(fed: Federation) -> RoundPlan:
    """The round plan of a model-training federation (every algorithm but TCT's stage 2)."""
    return RoundPlan(
        algorithm=fed.algorithm,
        comm=fed.comm,
        data=fed.client_data,
        trainer=fed.trainer,
        population=fed.population,
        generator=lambda rnd, k: client_generator(fed.cfg.seed, rnd, k),
        evaluate=model_evaluator(
            fed.flat,
            fed.comm,
            fed.evaluation_sets(),
            conformal_calibration=fed.cfg.conformal_calibration if fed.cfg.conformal else None,
            seed=fed.cfg.seed,
            progress=fed.cfg.progress and fed.comm.rank == 0,
        ),
        seed=fed.cfg.seed,
        reduction=fed.cfg.reduction,
        eval_every=fed.cfg.eval_every,
        learning_rate=("lr", fed.cfg.lr),
        divergence_settings=divergence_settings(fed),
        observers=chosen_observers(fed),
        client_batch=fed.client_batch,
        client_threads=fed.cfg.client_threads,
        system=fed.system,
        clock=fed.clock,
    )


def participation_of(cfg: Config) -> Participation:
    """The run's participation rule: ``clients_per_round``, or ``participation`` as a fraction."""
    count, trained = cfg.clients_per_round, cfg.num_clients - cfg.heldout_clients
    if cfg.participation is not None:
        count = max(1, round(cfg.participation * trained))
    if count is not None and count >= trained:
        count = None
    return Participation(count=count, weighting=cfg.participation_weighting)


def chosen_observers(fed: Federation) -> tuple[Observer, ...]:
    """The metrics the config asks for beyond the standard ones (:mod:`hpcfl.runner.observers`)."""
    chosen: list[Observer] = []
    if fed.cfg.cka_metrics:
        uploads_the_model(fed.algorithm, fed.flat.size, "cka_metrics", fed.cfg.algorithm)
        probe = LayerSimilarity.on_test_probe(
            fed.flat, fed.dataset.test.x, len(fed.parts), seed=fed.cfg.seed, device=fed.device
        )
        chosen.append(LayerCKA(probe))
    if fed.cfg.drift_diversity:
        uploads_the_model(fed.algorithm, fed.flat.size, "drift_diversity", fed.cfg.algorithm)
        chosen.append(Drift(DriftDiversity(fed.algorithm.layout), fed.algorithm.num_params))
    settings = EvalSettings.of(fed.cfg, fed.comm.rank, fed.comm.size)
    if fed.client_eval is not None:
        chosen.append(ClientEval.for_federation(fed, settings, fed.validation_parts))
    if fed.heldout is not None:
        chosen.append(HeldOutEval(fed, fed.heldout, settings))
    return tuple(chosen)


def uploads_the_model(algorithm: Algorithm, model_size: int, key: str, name: str) -> None:
    """Refuse ``key``, a metric of the participants' local models (``cka_metrics``,
    ``drift_diversity``), for an algorithm ``name`` whose upload is something else."""
    sums = algorithm.exchange().sums
    if not sums or sums[0].name != "x" or sums[0].length != model_size:
        raise ConfigError(
            f"{key} needs an algorithm whose upload is the local model; {name!r} "
            f"uploads something else: set {key}: false"
        )


def make_algorithm(cfg: Config, model: torch.nn.Module) -> Algorithm:
    """Instantiate the configured algorithm with its validated ``params``."""
    cls = ALGORITHMS[cfg.algorithm]
    params = cfg.params if isinstance(cfg.params, cls.Params) else cls.Params()
    return cls(params, layout=StateLayout.of_model(model), participation=participation_of(cfg))


#: The seed salt of ``validation``'s held-out shares ("val").
VALIDATION_SALT = 0x76616C


#: The seed salt of ``client_eval``'s held-out shares ("cev"), apart from validation's.
CLIENT_EVAL_SALT = 0x636576


def evaluation_notes(algorithm: Algorithm, client_eval: Sequence[torch.Tensor] | None) -> list[str]:
    """What the run's evaluation cannot show that a user would expect it to (one line each, printed
    when the run starts): a personalised algorithm judged by the server model only, and clients too
    small to hold a sample out (:func:`held_out_note`). ``client_eval``: each client's held-out
    share (``Federation.client_eval``), None without ``client_eval``."""
    notes = []
    if algorithm.personalised and client_eval is None:
        notes.append(
            f"hpcfl: note: {algorithm.name} is personalised, but without client_eval every figure judges the "
            "server model, not the clients' own models; set client_eval: 0.2 to score each client's "
            "model on its held-out share (personal_acc_*)"
        )
    held = held_out_note(client_eval)
    return [*notes, held] if held is not None else notes


def held_out_note(client_eval: Sequence[torch.Tensor] | None) -> str | None:
    """The note for ``client_eval`` clients too small to hold a sample out (:func:`split_clients`
    never takes a client's last training sample): their per-client figures are NaN and the
    summaries leave them out, which a table of NaN columns alone does not say. None when every
    evaluated client holds one out (or without ``client_eval``)."""
    if client_eval is None:
        return None
    empty = [k for k, share in enumerate(client_eval) if share.numel() == 0]
    if not empty:
        return None
    shown = ",".join(map(str, empty[:8])) + (",..." if len(empty) > 8 else "")
    return (
        f"hpcfl: note: client_eval: {len(empty)} of {len(client_eval)} clients have one training "
        f"sample and hold none out (clients {shown}): their per-client figures are NaN and the "
        "client_acc_*/personal_acc_* summaries leave them out; use fewer clients or a partition "
        "that gives each client at least 2 samples"
    )


def trained_writers(cfg: Config, heldout: HeldOut | None) -> list[int] | None:
    """The natural writers the run trains (partition ``natural``: the first ``num_clients`` writers
    less the held-out ones), None under any other partition: whose test shares a dataset that asks
    for it (:class:`~hpcfl.data.types.TestSelection`) tests the run on."""
    if parse_partition_spec(cfg.partition)[0] != "natural":
        return None
    held = set(heldout.ids) if heldout is not None else set()
    return [k for k in range(cfg.num_clients) if k not in held]


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
    parts, heldout = hold_out(parts, cfg)  # first: the other clients are the run's population
    dataset = run_test_set(dataset, trained_writers(cfg, heldout))
    validation = validation_parts = None
    if cfg.validation > 0:
        # per client, so the validation set follows the clients' label skew (as FedPVR's 1 % split
        # does) and each client's own share can judge its personal model (ClientEval)
        parts, validation_parts = split_clients(parts, cfg.validation, cfg.seed, salt=VALIDATION_SALT)
        validation = torch.cat(validation_parts)
    client_eval = None
    if cfg.client_eval > 0:  # drawn from what validation left: disjoint from it and from training
        parts, client_eval = split_clients(parts, cfg.client_eval, cfg.seed, salt=CLIENT_EVAL_SALT)
    owned = place_clients([int(p.numel()) for p in parts], comm.size)[comm.rank]
    torch.manual_seed(cfg.seed)
    model = build_model(
        cfg.model,
        dataset.input_shape,
        dataset.num_classes,
        vocab_size=dataset.vocab_size,
        **cfg.model_options,
    ).to(device)
    flat = FlatModel(model)
    schedule = schedule_of(cfg)
    population = Population(tuple(int(p.numel()) for p in parts))
    algorithm = make_algorithm(cfg, model).resolved(population, schedule, heterogeneous=cfg.system.enabled)
    trainer = Trainer(flat, schedule)
    if cfg.privacy.enabled:
        from hpcfl.privacy.build import make_private

        algorithm, trainer = make_private(cfg, algorithm, trainer, model, population)
    client_batch = resolve_client_batch(
        parse_client_batch(cfg.client_batch),
        trainer,
        dataset.train.x[:1].to(device),
        max(population.sizes, default=1),
        rank=comm.rank,
    )
    return Federation(
        cfg=cfg,
        comm=comm,
        device=device,
        dataset=dataset,
        parts=parts,
        owned=owned,
        validation=validation,
        validation_parts=validation_parts,
        client_eval=client_eval,
        flat=flat,
        algorithm=algorithm,
        trainer=trainer,
        client_batch=client_batch,
        system=SystemModel.of(cfg.system, cfg.seed, schedule, population.sizes),
        clock=VirtualClock.of(cfg.system.clock, cfg.seed, population.size),
        heldout=heldout,
    )
