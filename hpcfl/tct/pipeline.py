"""TCT stage 2 end to end on one rank: convexify, features, standardise, solve, evaluate.

Algorithm 2 of the TCT paper: replace the classifier by a fresh 1-output layer drawn from a fixed
seed (as the paper's code does; ``stage2.head: keep`` re-initialises the C-output one instead), take
per-sample features of the bootstrapped model (eNTK of that output, or the last-layer
representation of Table 12), standardise them with statistics from one allreduce, then run SCAFFOLD
(or a variant) over ψ = (φ, b) from zero with the round loop every algorithm uses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hpcfl.algorithms import (
    ClientData,
    FederationView,
    Observer,
    RoundPlan,
    ServerState,
    StageInput,
    StagePlan,
)
from hpcfl.algorithms.participation import Population
from hpcfl.algorithms.tct_params import Stage2Section
from hpcfl.comm.base import Communicator
from hpcfl.errors import StoreError
from hpcfl.features import FeatureMeta, FeatureStoreReader, open_feature_store
from hpcfl.files import atomic_torch_save, load_torch_file
from hpcfl.tct.features import (
    HELD_OUT_STORE,
    check_features_fit,
    convexified_model,
    ensure_store,
    feature_meta,
    test_shards,
)
from hpcfl.tct.problem import (
    FeatureMoments,
    LinearProblem,
    centred_one_hot,
    design_matrix,
    federated_moments,
)
from hpcfl.tct.solvers import ClosedFormSolver, LocalSolver, PrimalSolver
from hpcfl.tct.stage2 import Stage2, Stage2Params, auto_lr, check_stability, spectrum
from hpcfl.training.evaluate import JointCounts

log = logging.getLogger("hpcfl.tct")


@dataclass
class Stage2Setup:
    """The convexified problem as one rank holds it, ready for rounds."""

    plan: RoundPlan
    shape: tuple[int, int]  # (p + 1, C)
    dtype: torch.dtype
    lr: float  # η2 actually used (differs from the config with auto_lr)
    lambda_max: dict[int, float]
    device: torch.device  # the run's device (fed.device), where the problems live

    def initial_server(self) -> ServerState:
        """ψ₀ = 0 (Algorithm 2), on the run's device."""
        x = torch.zeros(self.shape[0] * self.shape[1], dtype=self.dtype, device=self.device)
        return self.plan.algorithm.init_server(x)


def _dtype(cfg2: Stage2Section) -> torch.dtype:
    # The closed form is derived and decomposed in float64; the primal reference follows the
    # feature dtype's precision class (float32 unless asked otherwise) to stay a cheap reference.
    return torch.float64 if cfg2.solver == "closed_form" else torch.float32


def prepare_stage2(
    fed: FederationView,
    comm: Communicator,
    theta: torch.Tensor,
    run_dir: Path,
    cfg2: Stage2Section,
    *,
    extract: bool = True,
    stop: Callable[[], bool] | None = None,
) -> Stage2Setup:
    """Everything before stage 2's first round, collectively on every rank: TCT's stage-2 recipe
    (Algorithm 2's setup), one named step each.

    With ``extract=False`` the feature stores must already be complete and match (tct-stage2).
    ``stop()`` is polled during the extraction (see :func:`hpcfl.tct.features.ensure_store`).
    """
    # 1. convexify: a copy of the bootstrapped model with a fresh 1-output head from a fixed seed
    fed.flat.load(theta)
    model = convexified_model(fed.flat.model, cfg2)
    meta = feature_meta(model, cfg2)
    # 2. features: the eNTK features of every owned client and test shard, in Zarr (reused when complete)
    stores = _extract_features(fed, comm, run_dir, cfg2, model, meta, extract=extract, stop=stop)
    # 3. moments: standardise with ONE allreduce of (Σz, Σz², n) over all clients' training features
    problems, moments = _training_problems(fed, comm, stores, cfg2, meta)
    test, held = _evaluation_problems(fed, stores, moments, cfg2)
    # 4. solver: each client's local solver, and the stability check before any round is spent
    solvers, every, lr = _local_solvers(problems, cfg2, comm)
    # 5. server state: the stage-2 algorithm and its round plan, ψ₀ = 0 (Stage2Setup.initial_server)
    return _stage2_setup(fed, comm, problems, test, held, solvers, every, lr, meta.p, cfg2)


@dataclass
class _FeatureStores:
    """Stage 2's features as this rank reads them: the training and test stores, the held-out
    shares' store (``client_eval``; None without it), and which clients and test shards it owns."""

    train: FeatureStoreReader
    test: FeatureStoreReader
    held: FeatureStoreReader | None
    held_ids: list[int]  # this rank's clients with a held-out share
    owned: list[int]  # this rank's clients
    shards: list[int]  # this rank's test shards
    num_clients: int


def _extract_features(
    fed: FederationView,
    comm: Communicator,
    run_dir: Path,
    cfg2: Stage2Section,
    model: torch.nn.Module,
    meta: FeatureMeta,
    *,
    extract: bool,
    stop: Callable[[], bool] | None,
) -> _FeatureStores:
    """z = S(∂f(x; θ)/∂θ) of every sample this rank owns, written once into the run's stores
    (features.zarr, features_test.zarr, the held-out store), or, with ``extract=False``, the
    existing stores checked against ``meta``; the images are done with when this returns."""
    ds = fed.dataset
    K = len(fed.parts)
    shards = test_shards(ds.test.y.numel(), K, comm)
    items = {k: (d.x, d.y) for k, d in fed.clients.items()}  # this rank's clients, on the device
    held = _held_out_items(fed, list(items))  # client_eval's held-out shares of this rank's clients
    if not extract:
        for name in ("features.zarr", "features_test.zarr", *((HELD_OUT_STORE,) if held is not None else ())):
            open_feature_store(run_dir / name, expect=meta)  # StoreError names what differs
    else:  # the disk must hold the stores before the first row is written
        error = None
        if comm.rank == 0:
            try:
                check_features_fit(fed, run_dir, note=False)  # the run said it before stage 1
            except StoreError as err:
                error = str(err)
        error = comm.bcast(error)
        if error is not None:
            raise StoreError(error)
    every_client = list(range(K))
    ensure_store(run_dir / "features.zarr", meta, items, every_client, model, cfg2, comm, stop=stop)
    test_items = {s: (ds.test.x[a:b], ds.test.y[a:b]) for s, (a, b) in shards.items()}
    ensure_store(run_dir / "features_test.zarr", meta, test_items, every_client, model, cfg2, comm, stop=stop)
    if held is not None and extract:
        assert fed.client_eval is not None
        with_share = [k for k, share in enumerate(fed.client_eval) if share.numel()]
        ensure_store(run_dir / HELD_OUT_STORE, meta, held, with_share, model, cfg2, comm, stop=stop)
    return _FeatureStores(
        train=open_feature_store(run_dir / "features.zarr", expect=meta),
        test=open_feature_store(run_dir / "features_test.zarr", expect=meta),
        held=open_feature_store(run_dir / HELD_OUT_STORE, expect=meta) if held is not None else None,
        held_ids=list(held) if held is not None else [],
        owned=list(items),
        shards=list(shards),
        num_clients=K,
    )


def _training_problems(
    fed: FederationView, comm: Communicator, stores: _FeatureStores, cfg2: Stage2Section, meta: FeatureMeta
) -> tuple[dict[int, LinearProblem], FeatureMoments | None]:
    """Each owned client's least-squares problem on standardised features (bias as a constant
    feature, targets one-hot − 1/C), and the federation's moments that standardised them (one
    allreduce; None with ``normalize: false``)."""
    device = fed.device  # stage 2 runs where the run does; the stores decode on the host
    raw = {k: _read_to(stores.train, k, device) for k in stores.owned}
    moments = (
        federated_moments(
            {k: z for k, (z, _) in raw.items()}, comm, p=meta.p, clients=stores.num_clients, device=device
        )
        if cfg2.normalize
        else None
    )
    # each client's raw block is freed as soon as its design matrix exists: the device then holds
    # the design matrices and one raw block, not both sets (at p = 1e5, 24 GB of float32 features
    # beside 48 GB of float64 ones for Fashion-MNIST's 60,000 samples)
    problems: dict[int, LinearProblem] = {}
    for k in list(raw):
        z, y = raw.pop(k)
        problems[k] = _problem(z, y, moments, cfg2, fed.dataset.num_classes)
        del z
    return problems, moments


def _evaluation_problems(
    fed: FederationView, stores: _FeatureStores, moments: FeatureMoments | None, cfg2: Stage2Section
) -> tuple[list[LinearProblem], dict[int, LinearProblem]]:
    """The test shards' problems and the held-out shares' (``client_eval``), standardised like the
    training ones."""
    C = fed.dataset.num_classes
    test = [_problem(*_read_to(stores.test, s, fed.device), moments, cfg2, C) for s in stores.shards]
    held = {}
    if stores.held is not None:
        held = {k: _problem(*_read_to(stores.held, k, fed.device), moments, cfg2, C) for k in stores.held_ids}
    return test, held


def _problem(
    z: torch.Tensor, y: torch.Tensor, moments: FeatureMoments | None, cfg2: Stage2Section, num_classes: int
) -> LinearProblem:
    dtype = _dtype(cfg2)
    return LinearProblem(design_matrix(z, moments, dtype=dtype), centred_one_hot(y, num_classes, dtype), y)


def _local_solvers(
    problems: dict[int, LinearProblem], cfg2: Stage2Section, comm: Communicator
) -> tuple[dict[int, LocalSolver], dict[int, tuple[float, int]], float]:
    """Each client's solver (the closed form, or the primal M-step reference), every client's
    (λ_max, n_k) from all ranks, and η2 (the configured one, or half the largest stable rate); a
    diverging η2 is refused here, before any round is spent."""
    solvers: dict[int, LocalSolver] = {
        k: ClosedFormSolver(pr) if cfg2.solver == "closed_form" else PrimalSolver(pr, loss=cfg2.loss)
        for k, pr in problems.items()
    }
    every = spectrum(solvers, comm)
    lr = auto_lr(every) if cfg2.auto_lr else cfg2.lr
    if cfg2.loss == "mse":
        check_stability(every, lr)
    if cfg2.auto_lr and comm.rank == 0:
        log.info("stage2.auto_lr: η2 = %.4g (half the largest stable rate)", lr)
    return solvers, every, lr


def _stage2_setup(
    fed: FederationView,
    comm: Communicator,
    problems: dict[int, LinearProblem],
    test: list[LinearProblem],
    held: dict[int, LinearProblem],
    solvers: dict[int, LocalSolver],
    every: dict[int, tuple[float, int]],
    lr: float,
    p: int,
    cfg2: Stage2Section,
) -> Stage2Setup:
    """The stage-2 algorithm (SCAFFOLD/FedAvg over the linear problems, ψ of shape (p + 1, C)) and
    the round plan the runner drives it with."""
    shape = (p + 1, fed.dataset.num_classes)
    algo = Stage2(Stage2Params(lr=lr, local_steps=cfg2.local_steps, variant=cfg2.variant), solvers, shape)
    data = {k: ClientData(k, pr.z, pr.y) for k, pr in problems.items()}
    plan = RoundPlan(
        algorithm=algo,
        comm=comm,
        data=data.__getitem__,  # stage 2's clients stay on the rank that extracted their features
        trainer=None,
        population=Population(tuple(n for _, n in (every[k] for k in range(len(fed.parts))))),
        # host: stage 2 is deterministic full-batch and draws nothing; the loop still asks for a generator
        generator=lambda rnd, k: torch.Generator(),
        seed=fed.seed,
        reduction=fed.reduction,
        evaluate=_evaluator(problems, test, shape, comm, fed.device),
        eval_every=1,
        learning_rate=("stage-2 η", lr),
        observers=_client_evaluation(fed, problems, held, solvers, shape, lr),
        # dropped participants (their stage-2 uploads missing) as in stage 1; a stage-2 client's work is
        # the configured M closed-form steps, so ``system.work`` does not change it
        system=fed.system,
    )
    return Stage2Setup(
        plan=plan,
        shape=shape,
        dtype=_dtype(cfg2),
        lr=lr,
        lambda_max={k: v[0] for k, v in every.items()},
        device=fed.device,
    )


def _read_to(store: FeatureStoreReader, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Array ``k`` of a feature store (features, labels), decoded on the host and moved to ``device``
    in one block each: stage 2 works on the run's device."""
    z, y = store.read_client(k)
    return z.to(device), y.to(device)


STAGE1_MODEL = "stage1_model.pt"  # θ_T1, the bootstrapped model stage 2 is built from


def keep_stage1_model(entry: StageInput) -> None:
    """Stage 1 is done: keep θ_T1 in the run directory (stage 2 and ``hpcfl tct-stage2`` start from it)."""
    assert entry.previous is not None
    if entry.comm.rank == 0:  # a host copy: the file opens on any device (tct-stage2 on a login node)
        atomic_torch_save(entry.run_dir / STAGE1_MODEL, entry.previous.x.cpu())
    entry.comm.barrier()


def enter_stage2(entry: StageInput) -> StagePlan:
    """TCT's stage 2 as the runner enters it: the convexified problem built from θ_T1, the previous
    stage's final model (or, resuming inside stage 2, the one kept in the run directory)."""
    fed, run_dir = entry.fed, entry.run_dir
    if entry.previous is not None:
        theta = entry.previous.x
    else:
        # the same advice from tct-stage2 and a resume: once stage 1 is done only --overwrite writes
        # θ_T1 again (a resume pointed at by tct-stage2 answered "rerun with --overwrite": a runaround)
        fix = "stage 2 cannot resume without it; rerun the run with --overwrite (stage 1 is trained again)"
        theta = load_torch_file(run_dir / STAGE1_MODEL, fix, device=fed.device)
    # a sweep reads the run's features as they are (a damaged store is named, not recomputed), except
    # after stage2.rounds: 0, where the run stopped before computing them
    extract = not entry.sweep or not (run_dir / "features.zarr").exists()
    stage2 = fed.algorithm.params.stage2  # type: ignore[attr-defined]  # TCTParams
    setup = prepare_stage2(fed, entry.comm, theta, run_dir, stage2, stop=entry.stop, extract=extract)
    setup.plan.stage_index = entry.stage_index
    server = setup.initial_server()
    algo = setup.plan.algorithm
    return StagePlan(plan=setup.plan, server=server, init_client=lambda k: algo.init_client(k, server))


def _held_out_items(
    fed: FederationView, owned: list[int]
) -> dict[int, tuple[torch.Tensor, torch.Tensor]] | None:
    """{client: (x, labels)} of the held-out shares (``client_eval``) of the clients this rank owns
    (``owned``: those whose training features it extracts), empty shares left out; None without
    client_eval. Host tensors: the extraction moves each block to the model's device."""
    if fed.client_eval is None:
        return None
    train = fed.dataset.train
    return {
        k: (train.x[fed.client_eval[k]], train.y[fed.client_eval[k]])
        for k in owned
        if fed.client_eval[k].numel()
    }


def linear_scores(pr: LinearProblem, w: torch.Tensor) -> tuple[float, float]:
    """Accuracy of argmax(Z̃W) on one problem and its mean squared error ½‖Z̃W − Y‖² / n (stage 2's
    test columns, for one client); one host read."""
    out = pr.z @ w.to(pr.z.dtype)
    correct = (out.argmax(1) == pr.labels).sum()
    loss = 0.5 * ((out - pr.y) ** 2).sum(1).sum()
    correct, loss = torch.stack([correct.double(), loss.double()]).tolist()  # exact in float64
    return correct / pr.n, loss / pr.n


def _client_evaluation(
    fed: FederationView,
    problems: dict[int, LinearProblem],
    held: dict[int, LinearProblem],
    solvers: dict[int, LocalSolver],
    shape: tuple[int, int],
    lr: float,
) -> tuple[Observer, ...]:
    """Per-client evaluation of the linear model W on each client's held-out share (its eNTK features,
    computed and standardised as the training and test features are), by the rank that owns the client.

    Fine-tuning (``finetune_eval.steps`` S): S local steps of the client's own stage-2 solver from W
    (h = 0: plain local gradient steps on its squared loss) at stage 2's η2, not at
    ``finetune_eval.lr``: that rate is the network's, and the linear model's stable rates are bounded
    by the clients' λ_max (:func:`hpcfl.tct.stage2.check_stability`), where stage 2's own η2 lies.
    """

    def score(x: torch.Tensor, k: int) -> tuple[float, float]:
        return linear_scores(held[k], x.view(shape))

    def finetune(x: torch.Tensor, k: int, steps: int) -> torch.Tensor | None:
        w0 = x.view(shape).to(problems[k].z.dtype)
        w = solvers[k].local_steps(w0, torch.zeros_like(w0), lr, steps)
        if not torch.isfinite(w).all():  # host: evaluation reads per evaluated client
            return None
        return w

    obs = fed.client_evaluation(score, lambda ids: [k for k in ids if k in problems], finetune)
    return () if obs is None else (obs,)


def _evaluator(problems, test_problems, shape, comm, device):
    """Train/test accuracy of argmax(Z̃W) and the mean squared error, one allreduce.

    The counts are summed on ``device`` (the problems' device) and copied to the host once per
    evaluation, where they join the observers' host table (:class:`JointCounts`) in one allreduce.
    """

    def evaluate_linear(server: ServerState, joint: JointCounts) -> dict[str, float]:
        stats = torch.zeros(6, dtype=torch.float64, device=device)  # test, train: correct, loss sum, n
        for offset, group in ((0, test_problems), (3, list(problems.values()))):
            for pr in group:
                w = server.x.view(shape).to(pr.z.dtype)
                out = pr.z @ w
                stats[offset] += (out.argmax(1) == pr.labels).sum()
                stats[offset + 1] += 0.5 * ((out - pr.y) ** 2).sum(1).sum()
                stats[offset + 2] += pr.n
        # host: one copy per evaluation, the counts join the observers' host table
        (stats,) = joint.reduce(comm, [stats.cpu()])
        return {
            "test_accuracy": float(stats[0] / stats[2]),
            "test_loss": float(stats[1] / stats[2]),
            "train_accuracy": float(stats[3] / stats[5]),
            "train_loss": float(stats[4] / stats[5]),
        }

    return evaluate_linear
