"""FedCKA and MOON: FedAvg at μ = 0, the regularisers against direct re-implementations, truncated
forwards, the activation cache, checkpoint/resume of the previous local model, CKA metric rows."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpcfl.algorithms import ClientData, FedAvg, FedCKA, Moon, Trainer
from hpcfl.algorithms.fedcka import FedCKAParams, cka_regulariser
from hpcfl.algorithms.moon import MoonParams
from hpcfl.algorithms.reference import FrozenModel, References
from hpcfl.config import load_config
from hpcfl.errors import ConfigError
from hpcfl.metrics import fedcka_loss
from hpcfl.metrics.gram import gram
from hpcfl.metrics.layers import LayerTap, block_outputs, first_layers
from hpcfl.models import build_model
from hpcfl.runner import run_experiment
from hpcfl.training import FlatModel, LocalSchedule
from hpcfl.training.layout import StateLayout
from tests.helpers import client_ctx, final_state, server_step, synthetic_config

SHAPE = (3, 16, 16)  # the smallest input cnn-proj takes


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread is fastest, and steady on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(name: str = "cnn-proj", shape: tuple[int, int, int] = SHAPE, **options) -> nn.Module:
    torch.manual_seed(0)
    return build_model(name, shape, 4, **options)


def _clients(K: int = 3, n: int = 40, shape: tuple[int, int, int] = SHAPE) -> list[ClientData]:
    g = torch.Generator().manual_seed(1)
    return [
        ClientData(
            k, torch.randn(n + 8 * k, *shape, generator=g), torch.randint(0, 4, (n + 8 * k,), generator=g)
        )
        for k in range(K)
    ]


def _federate(algo_cls, params, rounds: int) -> list[torch.Tensor]:
    """``rounds`` full rounds over three clients, as the runner does them; the server state after each."""
    flat = FlatModel(_model())
    trainer = Trainer(flat, LocalSchedule(lr=0.05, batch_size=16, momentum=0.9))
    algo = algo_cls(params, layout=StateLayout.of_model(flat.model))
    server = algo.init_server(flat.vector)
    clients = _clients()
    states = {c.k: algo.init_client(c.k, server) for c in clients}
    out = []
    for rnd in range(rounds):
        total, weight = torch.zeros_like(server.x), 0.0
        for c in clients:
            gen = torch.Generator().manual_seed(100 * rnd + c.k)
            up, states[c.k] = algo.client_update(server, states[c.k], c, client_ctx(trainer, gen))
            total += up.weight * up.sums["x"]
            weight += up.weight
        server = server_step(algo, server, total, weight)
        out.append(server.x)
    return out


@pytest.mark.parametrize(
    ("algo_cls", "params"),
    [(FedCKA, FedCKAParams(mu=0.0)), (Moon, MoonParams(mu=0.0))],
    ids=["fedcka", "moon"],
)
def test_mu_zero_equals_fedavg_exactly(algo_cls, params):
    assert torch.equal(_federate(algo_cls, params, 2)[-1], _federate(FedAvg, FedAvg.Params(), 2)[-1])


@pytest.mark.parametrize(
    ("algo_cls", "params"),
    [(FedCKA, FedCKAParams(mu=5.0)), (Moon, MoonParams(mu=5.0))],
    ids=["fedcka", "moon"],
)
def test_regulariser_changes_the_update_from_round_two(algo_cls, params):
    fedavg = _federate(FedAvg, FedAvg.Params(), 2)
    reg = _federate(algo_cls, params, 2)
    assert torch.equal(reg[0], fedavg[0])  # round 1: w_prev = w_global, zero regulariser gradient
    assert (reg[1] - fedavg[1]).abs().max() > 1e-6


def test_first_round_reports_loss_plus_mu_log2():
    flat = FlatModel(_model())
    trainer = Trainer(flat, LocalSchedule(lr=0.05, batch_size=16, steps=2))
    data = _clients(K=1)[0]
    x0 = flat.vector.clone()
    out = {}
    for cls, params in (
        (FedAvg, FedAvg.Params()),
        (FedCKA, FedCKAParams(mu=3.0)),
        (Moon, MoonParams(mu=2.0)),
    ):
        algo = cls(params, layout=StateLayout.of_model(flat.model))
        server = algo.init_server(x0)
        up, state = algo.client_update(server, algo.init_client(0, server), data, client_ctx(trainer))
        out[cls.name] = up.metrics["loss"]
        if cls is not FedAvg:
            assert torch.equal(state.prev, up.sums["x"])
    assert out["fedcka"] == pytest.approx(out["fedavg"] + 3.0 * math.log(2.0), rel=1e-12)
    assert out["moon"] == pytest.approx(out["fedavg"] + 2.0 * math.log(2.0), rel=1e-12)


def _one_step_setup():
    """A working model, distinct global and previous states, one batch, one SGD step."""
    flat = FlatModel(_model())
    g = torch.Generator().manual_seed(5)
    x_global = flat.vector.clone()
    x_prev = x_global + 0.05 * torch.randn(x_global.shape, generator=g)
    data = ClientData(0, torch.randn(24, *SHAPE, generator=g), torch.randint(0, 4, (24,), generator=g))
    sched = LocalSchedule(lr=0.1, batch_size=24, steps=1, momentum=0.9, weight_decay=1e-4)
    return flat, x_global, x_prev, data, sched


def _reference_step(flat: FlatModel, x_global, x_prev, data, sched, reg_fn) -> torch.Tensor:
    """Plain PyTorch: three full models, the loss written out, one torch.optim.SGD step."""
    local, glob, prev = (copy.deepcopy(flat.model) for _ in range(3))
    for model, state in ((local, x_global), (glob, x_global), (prev, x_prev)):
        FlatModel(model).load(state)
    glob.eval()
    prev.eval()
    opt = torch.optim.SGD(
        local.parameters(), lr=sched.lr, momentum=sched.momentum, weight_decay=sched.weight_decay
    )
    local.train()
    (F.cross_entropy(local(data.x), data.y) + reg_fn(local, glob, prev, data.x)).backward()
    opt.step()
    return FlatModel(local).vector.clone()


def test_fedcka_step_matches_a_direct_implementation():
    flat, x_global, x_prev, data, sched = _one_step_setup()
    mu = 4.0

    def reg(local, glob, prev, x):
        def acts(model):
            outs = {}
            hooks = [dict(model.named_modules())[n].register_forward_hook(
                lambda m, i, o, n=n: outs.setdefault(n, o)) for n in ("pool1", "pool2")]  # fmt: skip
            model(x)
            for h in hooks:
                h.remove()
            return [outs["pool1"], outs["pool2"]]

        with torch.no_grad():
            a_g, a_p = acts(glob), acts(prev)
        return mu * fedcka_loss(acts(local), a_g, a_p)  # local forward runs twice: same values

    expected = _reference_step(flat, x_global, x_prev, data, sched, reg)
    algo = FedCKA(FedCKAParams(mu=mu), layout=StateLayout.of_model(flat.model))
    server = algo.init_server(x_global)
    state = algo.init_client(0, server)
    state.prev = x_prev
    up, new_state = algo.client_update(
        server, state, data, client_ctx(Trainer(flat, sched), torch.Generator())
    )
    torch.testing.assert_close(up.sums["x"], expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(new_state.prev, up.sums["x"])
    assert algo.layer_names(flat.model) == ["pool1", "pool2"]


def test_moon_step_matches_a_direct_implementation():
    flat, x_global, x_prev, data, sched = _one_step_setup()
    mu, tau = 2.0, 0.5

    def reg(local, glob, prev, x):
        z = local.forward_with_repr(x)[1]
        with torch.no_grad():
            z_g, z_p = glob.forward_with_repr(x)[1], prev.forward_with_repr(x)[1]
        logits = torch.stack([F.cosine_similarity(z, z_g, -1), F.cosine_similarity(z, z_p, -1)], 1) / tau
        return mu * F.cross_entropy(logits, torch.zeros(x.shape[0], dtype=torch.long))

    expected = _reference_step(flat, x_global, x_prev, data, sched, reg)
    algo = Moon(MoonParams(mu=mu, temperature=tau), layout=StateLayout.of_model(flat.model))
    server = algo.init_server(x_global)
    state = algo.init_client(0, server)
    state.prev = x_prev
    up, _ = algo.client_update(server, state, data, client_ctx(Trainer(flat, sched), torch.Generator()))
    torch.testing.assert_close(up.sums["x"], expected, rtol=1e-5, atol=1e-6)


def test_fedcka_regulariser_has_first_layer_gradient_and_none_when_prev_is_global():
    model = _model()
    size = FlatModel(copy.deepcopy(model)).size
    glob, prev = FrozenModel(model, size), FrozenModel(model, size)
    with torch.no_grad():
        for q in prev.model.parameters():
            q.add_(0.05 * torch.randn_like(q))
    x = torch.randn(16, *SHAPE)
    layers = ["pool1", "pool2"]
    with torch.no_grad(), LayerTap(glob.model, layers) as tap_g, LayerTap(prev.model, layers) as tap_p:
        a_g = tap_g.forward(glob.prepare(x))[1]
        a_p = tap_p.forward(prev.prepare(x))[1]
    with LayerTap(model, layers) as tap:
        _, acts = tap.forward(x)
        cka_regulariser(acts, a_g, a_p, debiased=False).backward()
    assert model.conv1.weight.grad.abs().sum() > 0
    model.zero_grad()
    with LayerTap(model, layers) as tap:
        _, acts = tap.forward(x)
        loss = cka_regulariser(acts, a_g, a_g, debiased=False)
        loss.backward()
    assert loss.item() == pytest.approx(math.log(2.0))
    assert model.conv1.weight.grad.abs().max() < 1e-9


@pytest.mark.parametrize("debiased", [False, True])
def test_shared_gram_path_matches_fedcka_loss(debiased):
    g = torch.Generator().manual_seed(3)
    local = [
        torch.randn(12, 4, 5, 5, generator=g, requires_grad=True),
        torch.randn(12, 7, generator=g, requires_grad=True),
    ]
    glob = [torch.randn(12, 4, 5, 5, generator=g), torch.randn(12, 7, generator=g)]
    prev = [a + 0.3 * torch.randn(a.shape, generator=g) for a in glob]
    ours = cka_regulariser(local, glob, prev, debiased=debiased)
    ref = fedcka_loss([a.detach().requires_grad_() for a in local], glob, prev, debiased=debiased)
    grads = torch.autograd.grad(ours, local)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    ref_local = [a.detach().requires_grad_() for a in local]
    ref_grads = torch.autograd.grad(fedcka_loss(ref_local, glob, prev, debiased=debiased), ref_local)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


MODELS = [
    ("cnn-proj", SHAPE, {}),
    ("simplecnn", (1, 12, 12), {}),
    ("resnet8", SHAPE, {"norm": "bn"}),
    ("resnet8", SHAPE, {"norm": "gn"}),
    ("vgg11", SHAPE, {"batch_norm": True}),
    ("mlp", (1, 8, 8), {}),
]


@pytest.mark.parametrize(("name", "shape", "options"), MODELS, ids=lambda v: str(v))
def test_truncated_forward_equals_full_forward_and_skips_later_layers(name, shape, options):
    model = _model(name, shape, **options).eval()
    layers = first_layers(model, 2)
    x = torch.randn(6, *shape)
    calls = []
    model.classifier.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad(), LayerTap(model, layers) as full, LayerTap(model, layers, truncate=True) as cut:
        out, expected = full.forward(x)
        cut.forward(x)  # the first call runs in full and learns where to stop
        calls.clear()
        out_cut, got = cut.forward(x)
    assert out is not None and out_cut is None
    assert calls == [] or "classifier" in layers  # nothing after the last tapped layer ran
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    frozen = FrozenModel(model, FlatModel(copy.deepcopy(model)).size)  # channels-last copy on CPU
    with torch.no_grad(), LayerTap(frozen.model, layers, truncate=True) as tap:
        for _ in range(2):
            got = tap.forward(frozen.prepare(x))[1]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class _Swallowing(nn.Module):
    """A forward that catches every exception: it cannot be cut short."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.relu1, self.classifier = nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            h = self.relu1(self.fc1(x))
        except Exception:
            h = self.relu1(self.fc1(x))
        return self.classifier(h)


def test_untruncatable_forward_falls_back_to_full_forwards_and_says_so(caplog):
    model = _Swallowing()
    x = torch.randn(3, 5)
    with torch.no_grad(), LayerTap(model, ["relu1"], truncate=True) as tap, caplog.at_level("INFO"):
        expected = tap.forward(x)[1][0]
        for _ in range(3):
            out, (act,) = tap.forward(x)
    assert out is not None and torch.equal(act, expected) and not tap.truncate
    assert sum("could not be cut" in r.message for r in caplog.records) == 1  # once, not per call


def test_block_outputs_name_fedckas_layers():
    assert block_outputs(_model())[:2] == ["pool1", "pool2"]
    assert len(block_outputs(_model())) == 7  # the 7 layers of FedCKA's Table 4
    assert first_layers(_model("simplecnn", (1, 12, 12)), 2) == ["relu1", "relu2"]
    assert first_layers(_model("resnet8", SHAPE), 2) == ["relu1", "layer1.0"]  # stem, first block
    assert first_layers(_model("vgg11", SHAPE), 2) == ["encoder.2", "encoder.5"]
    with pytest.raises(ConfigError, match="has only 2 layers"):
        first_layers(_model("mlp", (1, 8, 8)), 3)


def test_frozen_copy_loads_flat_states():
    model = _model()
    flat = FlatModel(model)
    frozen = FrozenModel(model, flat.size)
    state = flat.vector + 0.1
    frozen.load(state)
    flat.load(state)
    x = torch.randn(5, *SHAPE)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(frozen.model(frozen.prepare(x)), model(x), rtol=1e-5, atol=1e-5)
    assert all(not p.requires_grad for p in frozen.model.parameters())


def test_cached_representations_equal_per_batch_ones():
    flat = FlatModel(_model())
    layers = ["pool1", "pool2"]

    def represent(m):
        tap = LayerTap(m, layers, truncate=True)
        return lambda x: tap.forward(x)[1]

    refs = References(flat.model, flat.size, represent, cache_bytes=2**30)
    x = torch.randn(50, *SHAPE)
    prev = flat.vector + 0.05
    idx = torch.tensor([3, 41, 7, 0, 49])
    refs.begin(flat.vector, prev, x, visits=50, chunk=16)  # one pass: no cache
    assert not refs.cached
    direct = refs.batch(x[idx], idx)
    refs.begin(flat.vector, prev, x, visits=100, chunk=16)  # two passes: cache
    assert refs.cached
    cached = refs.batch(x[idx], idx)
    for a, b in zip(direct[0] + direct[1], cached[0] + cached[1], strict=True):
        torch.testing.assert_close(a.flatten(1), b, rtol=1e-5, atol=1e-5)
    refs.cache_bytes = 10.0  # too small: falls back to per-batch forwards
    refs.begin(flat.vector, prev, x, visits=100, chunk=16)
    assert not refs.cached


def test_unknown_layer_name_is_a_config_error_in_round_one():
    flat, x_global, _, data, sched = _one_step_setup()
    params = FedCKAParams(mu=1.0, layers=["pool1", "poo2"])
    algo = FedCKA(params, layout=StateLayout.of_model(flat.model))
    server = algo.init_server(x_global)
    with pytest.raises(ConfigError, match="did you mean 'pool2'"):
        algo.client_update(server, algo.init_client(0, server), data, client_ctx(Trainer(flat, sched)))
    with pytest.raises(ConfigError, match="fedcka.layers"):
        load_config(None, ["algorithm=fedcka", "fedcka.layers=pool1"])
    with pytest.raises(ConfigError, match="moon.temperature"):
        load_config(None, ["algorithm=moon", "params.temperature=0"])


def test_gram_backward_and_tiny_debiased_batches():
    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(gram, (x,))
    tiny = [torch.randn(3, 6, requires_grad=True)]
    loss = cka_regulariser(tiny, [torch.randn(3, 6)], [torch.randn(3, 6)], debiased=True)
    assert loss.item() == pytest.approx(math.log(2.0)) and not loss.requires_grad


def _synthetic(tmp_path: Path, algorithm: str, rounds: int, **extra) -> Path:
    return synthetic_config(
        tmp_path,
        dataset_options={"n_train": 600, "n_test": 100, "seed": 3, "input_shape": list(SHAPE)},
        model="cnn-proj",
        algorithm=algorithm,
        num_clients=3,
        rounds=rounds,
        local_epochs=2,  # E > 1: the cached path
        batch_size=32,
        **extra,
    )


@pytest.mark.parametrize("algorithm", ["fedcka", "moon"])
def test_previous_model_survives_checkpoint_and_resume_bit_identically(tmp_path, algorithm):
    reference = run_experiment(load_config(_synthetic(tmp_path, algorithm, 3)), tmp_path / "ref")
    run = tmp_path / "run"
    first = run_experiment(load_config(_synthetic(tmp_path, algorithm, 2)), run)
    assert first.rounds_done == 2
    client_files = sorted((run / "checkpoints" / "round_000002" / "clients").glob("client_*.pt"))
    prevs = [torch.load(f, weights_only=True)["prev"] for f in client_files]
    assert len(prevs) == 3 and all(p is not None and p.shape == first.server.x.shape for p in prevs)
    resumed = run_experiment(load_config(_synthetic(tmp_path, algorithm, 3)), run, resume=True)
    assert torch.equal(resumed.server.x, reference.server.x)
    assert torch.equal(final_state(run), reference.server.x)


def test_cka_metric_rows_appear_when_asked_and_change_nothing(tmp_path):
    plain = run_experiment(load_config(_synthetic(tmp_path, "fedavg", 3, eval_every=2)), tmp_path / "plain")
    cfg = load_config(_synthetic(tmp_path, "fedavg", 3, eval_every=2, cka_metrics=True))
    run = run_experiment(cfg, tmp_path / "cka")
    assert torch.equal(run.server.x, plain.server.x)
    rows = [json.loads(line) for line in (tmp_path / "cka" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [2, 3]
    for row in rows:
        cka = row["cka"]
        assert list(cka) == ["pool1", "pool2", "relu3", "relu4", "relu5", "projection", "classifier"]
        assert all(len(v) == 3 and all(-1e-6 <= c <= 1 + 1e-6 for c in v) for v in cka.values())
        assert min(cka["pool1"]) > 0.9  # the first layer stays close to the global model's
    assert "cka" not in json.loads((tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()[0])
