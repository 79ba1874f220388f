"""The CUDA half of hpcfl, checked on a real GPU (``pytest -m gpu``; every test skips without one).

- the eNTK gather kernels compiled by Triton (not interpreted) equal their pure-torch references on
  odd shapes, for every input dtype they accept (float32, float64, float16, bfloat16), into fresh
  and strided half-precision outputs (the linear-CKA kernel's forward and gradients are checked on
  the GPU by ``tests/test_cka.py``, which runs on CUDA tensors wherever a GPU exists);
- the fused eNTK on CUDA equals the CPU ``vmap`` reference, float64, p < P and p = P, on simplecnn,
  resnet8, resnet18 (GroupNorm and BatchNorm) and vgg11;
- runs with ``device: cuda`` (FedAvg, SCAFFOLD, FedPVR, clipped FedDyn, NTK-FL, sample-level DP)
  equal the CPU run to float32 tolerance;
- ``MPIComm`` on CUDA tensors (2 ranks sharing one GPU), host-staged and CUDA-aware, equals the sum
  ``LocalComm`` would hold.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _float32_convolutions(monkeypatch):
    """cuDNN convolutions in true float32: PyTorch lets them use TF32 by default on Ampere and later
    (``torch.backends.cudnn.allow_tf32``), and the first H200 run measured what that does to a
    CUDA-vs-CPU comparison of a conv model: 1.9e-3 (FedAvg, simplecnn, 3 rounds) and 2.4e-3 (one
    DP-SGD client) relative, where the MLP runs agreed within 1e-4. These tests check hpcfl's code
    paths, so they compare float32 with float32; runs keep PyTorch's default (docs/gpus.md)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


#: tolerance of a compiled gather against the reference evaluated on the same (rounded) inputs
GATHER_TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}
DTYPES = list(GATHER_TOL)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _reference_in_float64(fn, *tensors: torch.Tensor, **kw) -> torch.Tensor:
    """``fn`` on float64 CPU copies of the inputs (index tensors unchanged): the exact value the
    kernel's float32 (or float64) accumulation approximates."""
    moved = [t.detach().cpu().double() if t.is_floating_point() else t.cpu() for t in tensors]
    return fn(*moved, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols", "n"), [(7, 11, 23), (3, 200, 150), (129, 67, 1001)])
def test_linear_gather_compiled_equals_reference(dtype, rows, cols, n) -> None:
    import triton_kernels as tk

    delta = torch.randn(37, rows, generator=_gen(1)).to(CUDA, dtype)
    act = torch.randn(37, cols, generator=_gen(2)).to(CUDA, dtype)
    sel = torch.randperm(rows * cols, generator=_gen(3))[:n].sort().values.to(CUDA)
    o, i = sel // cols, sel % cols
    got = tk.linear_gather_triton(delta, act, o, i)
    assert got.dtype == dtype and got.is_cuda
    ref = _reference_in_float64(tk.linear_gather_reference, delta, act, o, i)
    torch.testing.assert_close(got.double().cpu(), ref, **GATHER_TOL[dtype], msg="linear_gather_triton")
    half = torch.zeros(37, n + 5, dtype=torch.float16, device=CUDA)
    tk.linear_gather_triton(delta.t().contiguous().t(), act, o.int(), i.int(), out=half[:, 2 : n + 2])
    torch.testing.assert_close(
        half[:, 2 : n + 2].double().cpu(), ref.half().double(), rtol=2e-3, atol=2e-3, msg="half out view"
    )
    assert half[:, :2].abs().sum() == 0 and half[:, n + 2 :].abs().sum() == 0, "wrote outside its slice"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("n", [37, 700], ids=["distinct-windows", "shared-windows"])
def test_conv2d_gather_compiled_equals_reference(dtype, groups, n) -> None:
    import triton_kernels as tk

    batch, channels, out_channels, kh, kw = 5, 4, 6, 3, 2
    stride, padding, dilation = (2, 1), (1, 2), (1, 2)
    x = torch.randn(batch, channels, 13, 9, generator=_gen(4))
    h_out = (13 + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    w_out = (9 + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    delta = torch.randn(batch, out_channels, h_out, w_out, generator=_gen(5))
    per_out = channels // groups * kh * kw
    sel = torch.randperm(out_channels * per_out, generator=_gen(6))[:n].sort().values
    o, rem = sel // per_out, sel % per_out
    c_local, rem = rem // (kh * kw), rem % (kh * kw)
    ky, kx = rem // kw, rem % kw
    chan = (o // (out_channels // groups)) * (channels // groups) + c_local
    index = [t.to(CUDA) for t in (o, chan, ky, kx)]
    geometry = dict(stride=stride, padding=padding, dilation=dilation)
    d, xx = delta.to(CUDA, dtype), x.to(CUDA, dtype)
    got = tk.conv2d_gather_triton(d, xx, *index, **geometry)
    ref = _reference_in_float64(tk.conv2d_gather_reference, d, xx, *index, **geometry)
    tol = GATHER_TOL[dtype] if dtype != torch.float32 else dict(rtol=1e-4, atol=1e-4)  # sums of 40+ products
    torch.testing.assert_close(got.double().cpu(), ref, **tol, msg="conv2d_gather_triton")
    last = [t.contiguous(memory_format=torch.channels_last) for t in (d, xx)]
    got_last = tk.conv2d_gather_triton(*last, *index, **geometry)
    torch.testing.assert_close(got_last.double().cpu(), ref, **tol, msg="channels-last inputs")


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_gathers_compiled_equal_references(dtype) -> None:
    import triton_kernels as tk

    delta = torch.randn(3, 5, 37, generator=_gen(7)).to(CUDA, dtype)
    x = torch.randn(3, 5, 37, generator=_gen(8)).to(CUDA, dtype)
    mean = torch.randn(3, 5, generator=_gen(9)).to(CUDA, dtype)
    rstd = (torch.rand(5, generator=_gen(10)) + 0.5).expand(3, 5).to(CUDA, dtype)
    index = torch.tensor([4, 1, 3], device=CUDA)
    tol = GATHER_TOL[dtype] if dtype != torch.float32 else dict(rtol=1e-4, atol=1e-4)
    got_w = tk.norm_weight_gather_triton(delta, x, mean, rstd, index)
    ref_w = _reference_in_float64(tk.norm_weight_gather_reference, delta, x, mean, rstd, index)
    torch.testing.assert_close(got_w.double().cpu(), ref_w, **tol, msg="norm_weight_gather_triton")
    got_b = tk.channel_sum_gather_triton(delta, index)
    ref_b = _reference_in_float64(tk.channel_sum_gather_reference, delta, index)
    torch.testing.assert_close(got_b.double().cpu(), ref_b, **tol, msg="channel_sum_gather_triton")


ENTK_CASES = [
    pytest.param("simplecnn", (1, 28, 28), {}, id="simplecnn"),
    pytest.param("resnet8", (3, 32, 32), {"norm": "bn"}, id="resnet8-bn"),
    pytest.param("resnet18", (3, 32, 32), {"norm": "gn"}, id="resnet18-gn"),
    pytest.param("resnet18", (3, 32, 32), {"norm": "bn"}, id="resnet18-bn"),
    pytest.param("vgg11", (3, 32, 32), {"batch_norm": False}, id="vgg11"),
]


@pytest.mark.parametrize("full", [False, True], ids=["p<P", "p=P"])
@pytest.mark.parametrize(("name", "shape", "options"), ENTK_CASES)
def test_fused_entk_on_cuda_equals_cpu_reference(name, shape, options, full) -> None:
    """float64 on both sides, so 1e-7 is a real check of the compiled gathers and the CUDA plan."""
    from hpcfl.entk import entk_features, num_params
    from tests.test_entk import _assert_close, _model

    model = _model(name, shape, **options)  # float64, re-initialised head, randomised BN
    x = torch.randn(2, *shape, generator=_gen(11), dtype=torch.float64)
    total = num_params(model)
    p = total if full else min(20_000, total // 3)
    ref = entk_features(model, x, p=p, seed=7, method="vmap", dtype=torch.float64)
    got = entk_features(model.to(CUDA), x.to(CUDA), p=p, seed=7, method="fused", dtype=torch.float64)
    assert got.is_cuda
    _assert_close(got.cpu(), ref, f"{name} fused on CUDA vs vmap on CPU (p={p})", rtol=1e-7)


@pytest.mark.parametrize("name", ["char-lstm", "char-transformer"])
def test_text_entk_on_cuda_equals_cpu_reference(name: str) -> None:
    """The text models' eNTK features on CUDA (the LSTM's per-sample loop in eval mode, which cuDNN's
    RNN backward refuses: hpcfl turns cuDNN off for recurrent layers there; the Transformer's fused
    path) equal the CPU's, float64 on both sides."""
    from hpcfl.entk import entk_features, num_params
    from tests.test_entk import _assert_close
    from tests.test_entk_text import _codes, _text_model

    options = {"embed": 3, "hidden": 16, "layers": 2} if name == "char-lstm" else {"d_model": 8, "heads": 2}
    model = _text_model(name, 7, **options)
    x = _codes(4, 7)
    p = num_params(model) // 3
    ref = entk_features(model, x, p=p, seed=7, method="loop", dtype=torch.float64)
    got = entk_features(model.to(CUDA), x.to(CUDA), p=p, seed=7, dtype=torch.float64)
    assert got.is_cuda and torch.backends.cudnn.enabled  # cuDNN is back on afterwards
    _assert_close(got.cpu(), ref, f"{name} eNTK on CUDA vs the CPU loop (p={p})", rtol=1e-7)


#: algorithms whose ``device: cuda`` run is compared with the CPU run: (id, config keys, tolerance on
#: the final state relative to its largest entry). The runs are short (3 rounds of a few local steps):
#: float32 rounding of other kernels (and vectorised clients, ``client_batch: auto``) stays small.
#: simplecnn's convolutions are the exception: with TF32 off, the H200 run differed from the CPU's by
#: 7.5e-4 (1.9e-3 with TF32), while two CPU runs that only reorder the same float32 sums (client_batch
#: 1 vs 64) differ by 1.8e-5: cuDNN's convolution algorithms (FFT and Winograd kernels are among those
#: it picks, see benchmarks/results/entk_profile_cuda.csv) round differently from a direct sum, and 3
#: rounds of SGD amplify it. A device mix-up or a wrong step is orders of magnitude beyond 3e-3.
CUDA_RUNS = [
    pytest.param("fedavg", {"model": "simplecnn"}, 3e-3, id="fedavg"),
    pytest.param("scaffold", {}, 1e-4, id="scaffold"),
    pytest.param("fedpvr", {}, 1e-4, id="fedpvr"),
    pytest.param("feddyn", {"params": {"max_grad_norm": 10.0}}, 1e-4, id="feddyn-clipped"),
    pytest.param(
        "ntkfl",
        {
            "dataset_options": {"n_train": 300, "n_test": 100, "seed": 3},
            "num_clients": 6,
            "clients_per_round": 3,
            "params": {"grid": [20, 100, 400], "eta": 0.1},
        },
        1e-4,
        id="ntkfl",
    ),
]


@pytest.mark.parametrize(("algorithm", "keys", "tol"), CUDA_RUNS)
def test_run_on_cuda_equals_the_cpu_run(tmp_path: Path, algorithm: str, keys: dict, tol: float) -> None:
    """The same config, ``device: cuda`` vs ``cpu``: the final parameters agree to float32 rounding
    amplified over 3 rounds (``tol`` relative to the largest entry), and so do the logged test
    accuracies (within 1 point). The CUDA run uses the default ``client_batch: auto`` (vectorised
    groups where the algorithm allows), so this also checks that path on the GPU."""
    finals, acc = {}, {}
    for device in ("cpu", "cuda"):
        finals[device], acc[device] = _run(
            tmp_path / device, algorithm=algorithm, rounds=3, device=device, **keys
        )
    rel = float((finals["cuda"] - finals["cpu"]).abs().max() / finals["cpu"].abs().max())
    assert rel < tol, f"{algorithm}: cuda vs cpu final state differs by {rel:.2e} relative"
    assert acc["cuda"] and len(acc["cuda"]) == len(acc["cpu"])
    assert max(abs(a - b) for a, b in zip(acc["cuda"], acc["cpu"], strict=True)) <= 0.01, acc


def test_sample_level_dp_on_cuda_matches_the_cpu_step_and_trains(tmp_path: Path) -> None:
    """DP-SGD on CUDA: without noise one client's private local training equals the CPU's (the
    clipped per-sample sums and the step are the same maths; the noise on a GPU is drawn there, from
    one seed taken from the client's generator, so only its distribution matches the CPU's); with
    noise, a short run on CUDA learns as the CPU run does (test accuracy within 5 points)."""
    from hpcfl.models import build_model
    from hpcfl.training.flat import FlatModel
    from hpcfl.training.sgd import LocalSchedule
    from tests.helpers import dp_local_sgd

    torch.manual_seed(0)
    x = torch.randn(96, 1, 28, 28)
    y = torch.randint(0, 10, (96,))
    schedule = LocalSchedule(lr=0.1, batch_size=16, epochs=2, momentum=0.5)
    out = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(1)
        flat = FlatModel(build_model("simplecnn", (1, 28, 28), 10).to(device))
        result = dp_local_sgd(
            flat,
            x.to(device),
            y.to(device),
            schedule,
            torch.Generator().manual_seed(5),
            clip=1.0,
            noise_multiplier=0.0,
        )
        assert result.finite
        out[device] = flat.vector.cpu()
    rel = float((out["cuda"] - out["cpu"]).abs().max() / out["cpu"].abs().max())
    assert rel < 1e-4, rel
    privacy = {"level": "sample", "noise_multiplier": 0.5, "clip": 1.0}
    acc = {
        d: _run(tmp_path / d, algorithm="fedavg", rounds=3, device=d, privacy=privacy)[1][-1]
        for d in ("cpu", "cuda")
    }
    assert abs(acc["cuda"] - acc["cpu"]) <= 0.05, acc


def _run(where: Path, **keys) -> tuple[torch.Tensor, list[float]]:
    """A synthetic run's final server state (on the host) and its test accuracies, round by round."""
    import json

    from hpcfl.config import load_config
    from hpcfl.runner import run_experiment
    from tests.helpers import synthetic_config

    where.mkdir(parents=True, exist_ok=True)
    cfg = load_config(synthetic_config(where, **keys))
    final = run_experiment(cfg, where / "run").server.x.cpu()
    rows = [json.loads(line) for line in (where / "run" / "metrics.jsonl").read_text().splitlines() if line]
    return final, [r["test_accuracy"] for r in rows if "test_accuracy" in r]


@pytest.mark.mpi
def test_mpicomm_allreduce_of_cuda_tensors_equals_localcomm() -> None:
    """2 ranks on one GPU: a CUDA float32 and float64 allreduce, staged through the host and (when
    the MPI library is CUDA-aware) directly, equal the sum of every rank's tensor."""
    from tests.helpers import run_mpi_program

    run_mpi_program("cuda_allreduce.py", ranks=2, timeout=300)


# == TCT on the run's device (issue 39; branch tctdevice) =========================================
# Stage 2 (standardisation, closed form, primal solver, evaluation) runs where the run does: these
# check that it does, and that the CUDA results equal the CPU's to float tolerance.


def test_tct_run_on_cuda_equals_the_cpu_run(tmp_path: Path) -> None:
    """Both stages with ``device: cuda`` vs ``cpu``: stage 2's state lives on the GPU, θ_T1 is kept as
    a host copy, and the final W and every logged accuracy agree to float32 rounding (stage 1 and
    the eNTK features are float32, stage 2's closed form float64). ``hpcfl tct-stage2 --set
    device=cpu`` then re-solves the GPU run's stage 2 on the CPU from its GPU-made features."""
    import json

    from hpcfl.cli.main import main
    from hpcfl.runner import run_experiment
    from tests.test_tct import _tct_config

    finals, rows = {}, {}
    for device in ("cpu", "cuda"):
        (tmp_path / device).mkdir()
        cfg = _tct_config(tmp_path / device, device=device)
        server = run_experiment(cfg, tmp_path / device / "run").server
        assert server.x.device.type == device, f"stage 2's state is on {server.x.device}, not {device}"
        finals[device] = server.x.cpu()
        lines = (tmp_path / device / "run" / "metrics.jsonl").read_text().splitlines()
        rows[device] = [json.loads(line) for line in lines if line.strip()]
    theta = torch.load(tmp_path / "cuda" / "run" / "stage1_model.pt", weights_only=True)
    assert theta.device.type == "cpu", "θ_T1 must be saved as a host copy (device-free file)"
    rel = float((finals["cuda"] - finals["cpu"]).abs().max() / finals["cpu"].abs().max())
    assert rel < 1e-3, f"final W: CUDA vs CPU max relative difference {rel:.3e}"
    for key in ("test_accuracy", "train_accuracy"):
        acc = {d: [r[key] for r in rows[d] if key in r] for d in rows}
        assert acc["cuda"] and len(acc["cuda"]) == len(acc["cpu"]), key
        assert max(abs(a - b) for a, b in zip(acc["cuda"], acc["cpu"], strict=True)) <= 0.01, (key, acc)
    # the GPU run's stage 2 re-solved on the CPU, from the features the GPU made
    gpu_run = tmp_path / "cuda" / "run"
    assert main(["tct-stage2", str(gpu_run), "--set", "device=cpu"]) == 0
    redo = [
        json.loads(x) for x in (gpu_run / "stage2" / "device=cpu" / "metrics.jsonl").read_text().splitlines()
    ]
    first = [r["test_accuracy"] for r in rows["cuda"] if r.get("stage") == "stage2"]
    assert len(redo) == len(first)
    assert max(abs(r["test_accuracy"] - a) for r, a in zip(redo, first, strict=True)) <= 0.01, (redo, first)


def _stage2_clients(device: torch.device, K: int = 3, p: int = 40, C: int = 4):
    """Heterogeneous raw features (float64, drawn on the host) and labels, on ``device``."""
    g = torch.Generator().manual_seed(11)
    proj = torch.randn(p, C, generator=g, dtype=torch.float64)
    raw, labels = {}, {}
    for k in range(K):
        n = 20 + 15 * k  # 20 ≤ p + 1 (kernel form) ... 50 > p + 1 (covariance form)
        z = torch.randn(n, p, generator=g, dtype=torch.float64) * (1 + k) + 2 * torch.randn(
            p, generator=g, dtype=torch.float64
        )
        raw[k] = z.to(device)
        labels[k] = torch.argmax(z @ proj, dim=1).to(device)
    return raw, labels


@pytest.mark.parametrize("solver", ["closed_form", "primal"])
def test_tct_stage2_solvers_on_cuda_equal_the_cpu(solver: str) -> None:
    """Stage 2 alone, float64: federated moments, design matrices, λ_max, 4 SCAFFOLD rounds of the
    closed form (both its forms occur: n_k ≤ p + 1 and n_k > p + 1) or the primal solver, and the
    evaluation, on CUDA tensors vs CPU tensors: equal to float64 rounding, and on the GPU throughout."""
    from hpcfl.algorithms import ClientData
    from hpcfl.comm import LocalComm
    from hpcfl.tct.pipeline import _evaluator, linear_scores
    from hpcfl.tct.problem import LinearProblem, centred_one_hot, design_matrix, federated_moments
    from hpcfl.tct.solvers import ClosedFormSolver, PrimalSolver
    from hpcfl.tct.stage2 import Stage2, Stage2Params, auto_lr, spectrum
    from hpcfl.training.evaluate import JointCounts
    from tests.helpers import client_ctx, server_step

    C, out = 4, {}
    for name, device in (("cpu", torch.device("cpu")), ("cuda", CUDA)):
        raw, labels = _stage2_clients(device, C=C)
        p = next(iter(raw.values())).shape[1]
        moments = federated_moments(raw, LocalComm(), p=p, clients=len(raw), device=device)
        assert moments.mean.device.type == device.type
        problems = {
            k: LinearProblem(design_matrix(z, moments), centred_one_hot(labels[k], C), labels[k])
            for k, z in raw.items()
        }
        solvers = {
            k: ClosedFormSolver(pr) if solver == "closed_form" else PrimalSolver(pr)
            for k, pr in problems.items()
        }
        if solver == "closed_form":
            assert {s.form for s in solvers.values()} == {"kernel", "covariance"}
        every = spectrum(solvers, LocalComm())
        lr = auto_lr(every)
        shape = (p + 1, C)
        algo = Stage2(Stage2Params(lr=lr, local_steps=30), solvers, shape)
        server = algo.init_server(torch.zeros(shape[0] * shape[1], dtype=torch.float64, device=device))
        states = {k: algo.init_client(k, server) for k in solvers}
        for _ in range(4):
            total, weight = torch.zeros_like(server.x), 0.0
            for k, pr in problems.items():
                up, states[k] = algo.client_update(
                    server, states[k], ClientData(k, pr.z, pr.y), client_ctx(None)
                )
                assert up.sums["x"].device.type == device.type
                total += up.weight * up.sums["x"]
                weight += up.weight
            server = server_step(algo, server, total, weight)
        evaluate = _evaluator(problems, list(problems.values()), shape, LocalComm(), device)
        out[name] = dict(
            x=server.x.cpu(),
            lam=[every[k][0] for k in sorted(every)],
            scores=[v for pr in problems.values() for v in linear_scores(pr, server.x.view(shape))],
            metrics=evaluate(server, JointCounts()),
        )
    cpu, gpu = out["cpu"], out["cuda"]
    torch.testing.assert_close(gpu["x"], cpu["x"], rtol=1e-9, atol=1e-12, msg=f"{solver}: W, CUDA vs CPU")
    assert gpu["lam"] == pytest.approx(cpu["lam"], rel=1e-8), "λ_max, CUDA vs CPU"
    assert gpu["scores"] == pytest.approx(cpu["scores"], rel=1e-9), "per-client scores"
    assert gpu["metrics"] == pytest.approx(cpu["metrics"], rel=1e-9), "evaluation"
