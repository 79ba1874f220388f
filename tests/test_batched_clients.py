"""Batched clients (``client_batch``): K clients trained as one vectorised step equal the same
clients trained one by one (float32, 1e-5 relative), whatever the group size; BatchNorm statistics
stay per client; a resumed batched run is bit-identical to an uninterrupted one."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from hpcfl.config import load_config
from hpcfl.models import build_model
from hpcfl.runner import run_experiment
from hpcfl.training.batched import ClientJob, LinearCorrection, batched_local_sgd
from hpcfl.training.flat import FlatModel
from hpcfl.training.sgd import LocalSchedule, cross_entropy_loss
from tests.helpers import local_sgd, synthetic_config

RTOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| over max |b|: the relative distance of two state vectors."""
    return float((a - b).abs().max() / b.abs().max())


def _sequential(flat: FlatModel, jobs: list[ClientJob], schedule: LocalSchedule) -> list[torch.Tensor]:
    out = []
    for j in jobs:
        flat.load(j.x0)
        result = local_sgd(flat, j.x, j.y, schedule, j.generator, correction=j.correction)
        assert result.finite
        out.append(flat.vector.clone())
    return out


def _jobs(flat: FlatModel, sizes: list[int], shape: tuple[int, ...], correction: str) -> list[ClientJob]:
    torch.manual_seed(1)
    P, dtype = flat.num_params, flat.vector.dtype
    jobs = []
    for k, n in enumerate(sizes):
        x0 = flat.vector.clone()
        x0[:P] += 0.01 * torch.randn(P)  # clients start from different states (as after a round)
        corr = None
        if correction == "linear":
            shift = 0.01 * torch.randn(P).to(dtype)
            corr = LinearCorrection(shift=shift, pull=0.1, anchor=flat.vector[:P].clone())
        elif correction == "closure":
            shift = 0.01 * torch.randn(P).to(dtype)

            def corr(w: torch.Tensor, d: torch.Tensor, shift: torch.Tensor = shift) -> None:
                d[: P // 2].sub_(shift[: P // 2])

        x = torch.randn(n, *shape).to(dtype)
        y = torch.randint(0, 10, (n,))
        jobs.append(ClientJob(x0, x, y, torch.Generator().manual_seed(100 + k), corr))
    return jobs


def _regenerate(jobs: list[ClientJob]) -> list[ClientJob]:
    """The same jobs with fresh generators (the first run consumed them)."""
    return [
        dataclasses.replace(j, generator=torch.Generator().manual_seed(100 + k)) for k, j in enumerate(jobs)
    ]


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("correction", [None, "linear", "closure"])
@pytest.mark.parametrize(
    ("model", "dtype"), [("mlp", torch.float32), ("mlp", torch.float64), ("resnet8", torch.float64)]
)
def test_batched_local_sgd_equals_each_client_alone(
    model: str, dtype: torch.dtype, correction: str | None, momentum: float
) -> None:
    """Unequal sizes (1, 2 and 4 steps with partial last batches, so clients stop at different
    steps and a step mixes batch sizes), momentum, vectorised and per-row corrections; resnet8 has
    BatchNorm: each client's running statistics must be its own.

    resnet8 is compared in float64 (to 1e-10): in float32 its clients of 5–8 samples of noise sit
    so close to a ReLU kink that the sequential run itself lands 1.4e-3 (relative) from the float64
    one for one case on an AVX2 CPU, depending on the thread count, so float32 equality there is a
    coin toss between two equally rounded results. The float32 bound is held by the MLP here and by
    the whole-run tests below (resnet8 included)."""
    shape = (1, 12, 12)
    torch.manual_seed(0)
    options = {"norm": "bn"} if model == "resnet8" else {}
    flat = FlatModel(build_model(model, shape, 10, **options).to(dtype))
    schedule = LocalSchedule(lr=0.05, batch_size=8, epochs=1, momentum=momentum, weight_decay=1e-4)
    jobs = _jobs(flat, [5, 16, 29], shape, correction)
    W, results = batched_local_sgd(flat, jobs, schedule, cross_entropy_loss)
    assert [r.steps for r in results] == [1, 2, 4]
    reference = _sequential(flat, _regenerate(jobs), schedule)
    rtol = RTOL if dtype == torch.float32 else 1e-10
    for i, ref in enumerate(reference):
        assert _rel(W[i], ref) < rtol, (i, _rel(W[i], ref))
        moved = W[i, flat.num_params :] - jobs[i].x0[flat.num_params :]
        if model == "resnet8":  # running statistics moved, each by its own client's batches
            assert moved.abs().max() > 0
    if model == "resnet8":
        P = flat.num_params
        assert _rel(W[0, P:], W[1, P:]) > 1e-3  # not shared between clients


def _config(tmp_path: Path, **keys):
    base = dict(
        num_clients=6,
        rounds=2,
        local_epochs=1,
        batch_size=32,
        dataset_options={"n_train": 600, "n_test": 100, "seed": 3},
        eval_every=2,
    )
    base.update(keys)
    return load_config(synthetic_config(tmp_path, **base))


# Every algorithm's client_batch equality (momentum 0.5, dir:0.5, partial participation) is checked
# by tests/test_contract.py; here the momentum × partition matrix on the two batched corrections
# the contract's setting does not reach: SCAFFOLD's one-model form (full participation) and FedPVR's
# per-row correction with its own momentum buffer.
CASES = [
    ("scaffold", {}),  # one_model (full participation)
    ("fedpvr", {}),  # momentum on the plain part only: a per-row correction with its own buffer
]


@pytest.mark.parametrize("momentum", [0.0, 0.5])
@pytest.mark.parametrize("partition", ["iid", "dir:0.5"])
@pytest.mark.parametrize(("algorithm", "extra"), CASES)
def test_runs_with_client_batch_equal_sequential(
    tmp_path: Path, algorithm: str, extra: dict, partition: str, momentum: float
) -> None:
    """N ∈ {1, 3, all}: the final parameters agree with sequential training to 1e-5 relative, on
    equal (iid) and unequal (dir:0.5) client sizes, with and without momentum."""
    finals = {}
    for n in ("1", "3", "6"):
        cfg = _config(
            tmp_path, algorithm=algorithm, partition=partition, momentum=momentum, client_batch=n, **extra
        )
        finals[n] = run_experiment(cfg, tmp_path / f"r{n}").server.x
    for n in ("3", "6"):
        assert _rel(finals[n], finals["1"]) < RTOL, (n, _rel(finals[n], finals["1"]))


def test_batchnorm_model_run_equals_sequential(tmp_path: Path) -> None:
    """resnet8 with BatchNorm: the running statistics in the state vector agree too. At lr 0.01:
    at 0.05 this net amplifies rounding so much that the sequential path alone differs by 8e-5
    between one and two threads."""
    finals = {}
    for n in ("1", "3"):
        cfg = _config(
            tmp_path,
            algorithm="fedavg",
            partition="dir:0.5",
            momentum=0.5,
            model="resnet8",
            model_options={"norm": "bn"},
            client_batch=n,
            rounds=1,
            lr=0.01,
        )
        finals[n] = run_experiment(cfg, tmp_path / f"r{n}").server.x
    assert _rel(finals["3"], finals["1"]) < RTOL


def test_algorithms_without_a_local_task_fall_back_with_one_line(tmp_path: Path, caplog) -> None:
    """MOON's local loss needs extra models per client: it trains one by one (bit-identical to
    client_batch 1) and says so once."""
    finals = {}
    with caplog.at_level(logging.WARNING, logger="hpcfl.runner"):
        for n in ("1", "3"):
            cfg = _config(
                tmp_path,
                algorithm="moon",
                model="cnn-proj",
                client_batch=n,
                rounds=2,
                dataset_options={"n_train": 240, "n_test": 60, "seed": 3, "input_shape": [1, 16, 16]},
            )
            finals[n] = run_experiment(cfg, tmp_path / f"r{n}").server.x
    assert torch.equal(finals["3"], finals["1"])
    lines = [r.getMessage() for r in caplog.records if "one by one" in r.getMessage()]
    assert len(lines) == 1 and "moon" in lines[0] and "previous" in lines[0], lines


def test_auto_on_the_cpu_trains_one_by_one_silently(tmp_path: Path, caplog) -> None:
    """Batching does not pay on the CPU (grouped convolutions): ``auto``, the default, is the
    sequential path there, bit for bit, with no line about it (determinism.json records the 1)."""
    finals = {}
    with caplog.at_level(logging.WARNING, logger="hpcfl.runner"):
        for n in ("1", "auto"):
            cfg = _config(tmp_path, algorithm="scaffold", client_batch=n)
            finals[n] = run_experiment(cfg, tmp_path / f"r{n}").server.x
    assert torch.equal(finals["auto"], finals["1"])
    assert not [r for r in caplog.records if "client_batch" in r.getMessage()]
    assert json.loads((tmp_path / "rauto" / "determinism.json").read_text())["client_batch_used"] == 1


def test_auto_is_resolved_once_and_the_executor_takes_the_result() -> None:
    """Issue 55: ``client_batch: auto`` is resolved in one place (:func:`resolve_client_batch`, once
    per run); the executor takes the resolved size and refuses a setting it would have to resolve."""
    from hpcfl.algorithms import Trainer
    from hpcfl.runner.executor import ClientExecutor, resolve_client_batch

    trainer = Trainer(FlatModel(build_model("mlp", (1, 28, 28), 10)), LocalSchedule(lr=0.1, batch_size=8))
    sample = torch.randn(1, 1, 28, 28)
    assert resolve_client_batch("auto", trainer, sample, 20) == 1  # the CPU: one by one
    assert resolve_client_batch("4", trainer, sample, 20) == 4
    assert ClientExecutor(4).size == 4
    for unresolved in ("auto", 0, True):
        with pytest.raises(ValueError, match="resolve_client_batch"):
            ClientExecutor(unresolved)  # type: ignore[arg-type]


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_resumed_batched_run_is_bit_identical(tmp_path: Path, store: str) -> None:
    """SCAFFOLD (client states, in memory or read ahead from the on-disk store) with momentum,
    groups of 4 over 6 clients (two groups of unequal size): 2 rounds, then a resume to 4, equals
    4 rounds in one go bit for bit."""
    keys = dict(
        algorithm="scaffold", partition="dir:0.5", momentum=0.5, client_batch="4", client_state_memory=store
    )
    whole = run_experiment(_config(tmp_path, rounds=4, **keys), tmp_path / "whole").server.x
    run_experiment(_config(tmp_path, rounds=2, **keys), tmp_path / "part")
    resumed = run_experiment(_config(tmp_path, rounds=4, **keys), tmp_path / "part", resume=True).server.x
    assert torch.equal(resumed, whole)


@pytest.mark.mpi
def test_two_ranks_each_batching_their_own_participants_equal_one_rank_sequential(tmp_path: Path) -> None:
    """Under MPI each rank batches the participants placed on it (here 3 of 6 per rank, SCAFFOLD's
    control-variate form with 4 of 6 sampled per round); the result equals sequential training on
    one process to 1e-5."""
    import os
    import subprocess

    from tests.helpers import REPO, final_state, mpiexec_cmd

    keys = dict(algorithm="scaffold", partition="dir:0.5", momentum=0.5, clients_per_round=4, rounds=3)
    one = run_experiment(_config(tmp_path, client_batch="1", **keys), tmp_path / "one").server.x
    cfg = synthetic_config(
        tmp_path,
        num_clients=6,
        local_epochs=1,
        batch_size=32,
        dataset_options={"n_train": 600, "n_test": 100, "seed": 3},
        eval_every=2,
        client_batch="3",
        **keys,
    )
    proc = subprocess.run(
        mpiexec_cmd(2, "run", str(cfg), "--run-dir", str(tmp_path / "two")),
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert _rel(final_state(tmp_path / "two"), one) < RTOL


def test_a_diverging_client_does_not_disturb_the_others() -> None:
    """A client whose loss is NaN (an inf in its samples) comes back not finite; the others in
    its vectorised step train exactly as they would alone."""
    shape = (1, 12, 12)
    torch.manual_seed(0)
    flat = FlatModel(build_model("mlp", shape, 10))
    schedule = LocalSchedule(lr=0.05, batch_size=8, epochs=1, momentum=0.9)
    jobs = _jobs(flat, [16, 16, 16], shape, "linear")
    jobs[1].x[3] = float("inf")
    W, results = batched_local_sgd(flat, jobs, schedule, cross_entropy_loss)
    assert [r.finite for r in results] == [True, False, True]
    fresh = _regenerate(jobs)
    reference = _sequential(flat, [fresh[0], fresh[2]], schedule)
    assert _rel(W[0], reference[0]) < RTOL and _rel(W[2], reference[1]) < RTOL


def test_client_footprint_counts_states_samples_and_activations() -> None:
    """What ``auto`` sizes GPU groups by, for the MLP (784 → 100 → ReLU → 10) at batch 8 and a
    client of 20 samples: 5 state vectors, the samples, and the leaf outputs of one batch twice."""
    from hpcfl.algorithms import Trainer
    from hpcfl.runner.executor import client_footprint

    flat = FlatModel(build_model("mlp", (1, 28, 28), 10))
    trainer = Trainer(flat, LocalSchedule(lr=0.1, batch_size=8))
    acts = 8 * (100 + 100 + 10)  # fc1, relu1, classifier
    assert client_footprint(trainer, torch.randn(1, 1, 28, 28), 20) == 4 * (
        5 * flat.size + 20 * 784 + 2 * acts
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batched_on_cuda_equals_sequential_on_cuda_and_auto_groups() -> None:
    """On a GPU: 8 simplecnn clients of unequal sizes with momentum and a linear correction, trained
    as one vectorised group, equal the same clients trained one by one on the same GPU (1e-5
    relative), and ``auto`` forms groups larger than one there."""
    from hpcfl.algorithms import Trainer
    from hpcfl.runner.executor import AUTO_MEMORY_SHARE, auto_client_batch

    torch.manual_seed(0)
    cpu = FlatModel(build_model("simplecnn", (1, 28, 28), 10))
    flat = FlatModel(build_model("simplecnn", (1, 28, 28), 10).cuda())
    schedule = LocalSchedule(lr=0.05, batch_size=16, epochs=2, momentum=0.9)
    jobs = []
    for j in _jobs(cpu, [40, 33, 64, 17, 40, 50, 8, 29], (1, 28, 28), "linear"):
        c = j.correction
        assert isinstance(c, LinearCorrection) and c.shift is not None and c.anchor is not None
        on_gpu = LinearCorrection(c.shift.cuda(), c.pull, c.anchor.cuda())
        jobs.append(dataclasses.replace(j, x0=j.x0.cuda(), x=j.x.cuda(), y=j.y.cuda(), correction=on_gpu))
    W, results = batched_local_sgd(flat, jobs, schedule, cross_entropy_loss)
    assert all(r.finite for r in results)
    for k, ref in enumerate(_sequential(flat, _regenerate(jobs), schedule)):
        assert _rel(W[k], ref) < RTOL, (k, _rel(W[k], ref))
    n, why = auto_client_batch(Trainer(flat, schedule), jobs[0].x[:1], 64, memory_share=AUTO_MEMORY_SHARE)
    assert n > 1, why


def test_a_non_finite_loss_is_reported_at_the_step_it_happened_on_both_paths() -> None:
    """Neither path reads the device during the round, yet both report a client whose loss turns
    non-finite as an early stop would: ``finite=False`` and the steps taken before it (the step
    whose mini-batch first holds the sample with an inf, found by replaying its generator)."""
    from hpcfl.training.sgd import batch_indices
    from tests.helpers import local_sgd

    shape = (1, 12, 12)
    torch.manual_seed(0)
    flat = FlatModel(build_model("mlp", shape, 10))
    schedule = LocalSchedule(lr=0.05, batch_size=4, epochs=2, momentum=0.9)
    jobs = _jobs(flat, [16, 16], shape, "linear")
    jobs[1].x[9] = float("inf")
    fresh = _regenerate(jobs)
    replay = batch_indices(16, schedule, _regenerate(jobs)[1].generator)
    expected = next(s for s, b in enumerate(replay) if 9 in b.tolist())
    _W, results = batched_local_sgd(flat, jobs, schedule, cross_entropy_loss)
    assert (results[1].finite, results[1].steps) == (False, expected)
    assert results[0].finite and results[0].steps == len(replay)
    flat.load(fresh[1].x0)
    alone = local_sgd(flat, fresh[1].x, fresh[1].y, schedule, fresh[1].generator)
    assert (alone.finite, alone.steps) == (False, expected)
