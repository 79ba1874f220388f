"""The algorithm contract, checked for every registered algorithm (built-ins and plugins alike).

Each algorithm runs a tiny synthetic federation (the MLP on 1×8×8 blobs, 3 of 4 clients per round,
3 rounds) with its own ``example_params``; nothing here lists algorithms, so a new one, built in or
plugged in, is checked without its author editing this file:

- its registry name and ``Params`` agree with the class;
- a run stopped after 2 rounds and resumed ends bit-identical to one uninterrupted run;
- killed with SIGKILL after round 3's metrics row (client states forced into the on-disk store,
  checkpoints every 2 rounds) and resumed, it ends bit-identical too;
- ``bytes_down`` is participants × the bytes of the server state's non-``server_only`` fields (of a
  field the exchange declares ``received``, the declared part only), and
  exactly the fields a client reads are downloaded (a server-only field set to NaN leaves the upload
  bit-identical; any other field changes it);
- its checkpoint loads with ``torch.load(weights_only=True)`` and restores its state dataclasses;
- 1 rank and 2 ranks (``mpiexec``) end bit-identical (float64 reduction);
- ``client_batch`` 3 equals one-by-one training (to 1e-5 relative where the algorithm declares a
  batched local task, bit for bit where it falls back);
- with system heterogeneity on (:data:`SYSTEM`: local steps drawn per participant and round, a
  quarter of the participants dropping out), a stopped and resumed run is bit-identical to an
  uninterrupted one, 1 and 2 ranks agree bit for bit, and the bytes are those of what arrived;
- under FULL participation with the same system section (:func:`full_config`: 12 clients, so the
  arrivals change how the round would be balanced over ranks; client states held in memory, as
  ``auto`` keeps them when each client keeps its rank), 1 and 2 ranks agree bit for bit: the final
  state, the clients' own models and every client state in the last checkpoint (a client trained
  on a rank that does not hold its state would silently start from a fresh one), and FedNova's sum
  of unequal-work uploads does not depend on the placement;
- a personalised algorithm's run evaluates each client's own model on its held-out share
  (``client_eval``), and those per-client accuracies are bit-identical across the resumes and ranks
  above as well;
- its final state matches the golden hash recorded for it and this CPU capability (a built-in's in
  ``tests/golden/contract_hashes.json``; a plugin's in ``hpcfl_contract_hashes.json`` beside the
  module that defines its class, a file the plugin owns and ships); record one with
  ``python tests/test_contract.py --record NAME`` (see :func:`_record` for other capabilities).

The subprocess parts run once for all algorithms (one ``mpiexec`` start; one process forking a
child per killed run), so the suite stays small.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcfl.algorithms import Algorithm, ClientContext, state_from_dict
from hpcfl.comm import LocalComm
from hpcfl.config import Config, config_from_dict
from hpcfl.registry import ALGORITHMS
from hpcfl.runner import RunResult, run_experiment
from tests.helpers import MPIEXEC, REPO, final_state, plugin_env, stop_after_rows, write_config

GOLDEN = REPO / "tests" / "golden" / "contract_hashes.json"
#: the file name of a plugin's own golden hashes, beside the module that defines its algorithm
PLUGIN_GOLDEN = "hpcfl_contract_hashes.json"
PROGRAMS = REPO / "tests" / "contract_programs"
NAMES = list(ALGORITHMS)

#: the tiny federation every algorithm runs (its params come from ``example_params``)
BASE: dict[str, Any] = dict(
    dataset="synthetic",
    dataset_options={"n_train": 240, "n_test": 60, "seed": 3, "input_shape": [1, 8, 8], "num_classes": 4},
    partition="dir:0.5",
    num_clients=4,
    clients_per_round=3,
    model="mlp",
    rounds=3,
    local_steps=2,
    lr=0.05,
    momentum=0.5,
    batch_size=16,
    seed=5,
    threads=1,
    progress=False,
    reduction="float64",
)


#: system heterogeneity for the contract runs: 1-3 local steps drawn per participant and round, and
#: each participant dropping out with probability 1/4 (seed 5: rounds 1 and 2 both lose participants)
SYSTEM: dict[str, Any] = {"work": {"kind": "uniform", "low": 1, "high": 3}, "dropout": {"probability": 0.25}}
HETERO = "+system"  # the suffix of a heterogeneous run's name
FULL = "+full"  # the suffix of a heterogeneous run under full participation (:func:`full_config`)


def example_params(cls: type[Algorithm]) -> Any:
    """The algorithm's ``example_params``, else its defaults."""
    return cls.example_params if cls.example_params is not None else cls.Params()


def contract_config(name: str, **extra: Any) -> dict[str, Any]:
    """The tiny run of algorithm ``name`` as a config dict (YAML-ready); a personalised algorithm's
    run also evaluates every client's own model on its held-out share (``client_eval``), so the
    checks below cover its personal models (kept in the client states) too."""
    cls = ALGORITHMS[name]
    params = Config(params=example_params(cls)).to_dict()["params"]
    judged = {"client_eval": 0.25} if cls.personalised else {}
    return {**BASE, "name": name, "algorithm": name, "params": params, **judged, **extra}


def sha256(x: torch.Tensor) -> str:
    return hashlib.sha256(x.contiguous().numpy().tobytes()).hexdigest()


def _accuracies(rows: list[dict]) -> list[float]:
    return [r["test_accuracy"] for r in rows if "test_accuracy" in r]


def _personal(run_dir: Path) -> list[list[float]]:
    """Every round's per-client accuracies of the clients' own models (``client_metrics.jsonl``
    of a personalised algorithm's run; empty for the others)."""
    path = run_dir / "client_metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [[c["personal_accuracy"] for _, c in sorted(r["clients"].items())] for r in rows]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def hetero_config(name: str, **extra: Any) -> dict[str, Any]:
    """The tiny run of ``name`` with system heterogeneity (:data:`SYSTEM`) on."""
    return contract_config(name, system=SYSTEM, **extra)


def full_config(name: str, **extra: Any) -> dict[str, Any]:
    """The run of ``name`` with :data:`SYSTEM` under FULL participation: 12 clients (480 samples),
    every one drawn each round, a quarter dropping out, plain local SGD (momentum 0: FedNova's
    step norms ‖a_k‖₁ are then the step counts 1-3, and the sums of its weighted uploads on 1 and 2
    ranks differed on this seed before issue 51). Which clients arrive changes every round, so a
    placement of the arrivals alone would move clients between ranks."""
    options = {**BASE["dataset_options"], "n_train": 480}
    return contract_config(
        name,
        system=SYSTEM,
        clients_per_round=None,
        num_clients=12,
        momentum=0.0,
        dataset_options=options,
        **extra,
    )


#: the config of each variant of the contract run, by its run-name suffix
VARIANTS = {"": contract_config, HETERO: hetero_config, FULL: full_config}


class Runs:
    """The reference run of every algorithm (in this process, memory store), computed once; with
    ``hetero``, its run with system heterogeneity on; with ``variant``, that of :data:`VARIANTS`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[str, RunResult] = {}

    def run(self, key: str, config: Callable[[], dict[str, Any]]) -> RunResult:
        """The run named ``key`` of the config ``config()`` makes, run in ``root / key`` once."""
        if key not in self._done:
            self._done[key] = run_experiment(config_from_dict(config()), self.root / key)
        return self._done[key]

    def reference(self, name: str, *, hetero: bool = False, variant: str = "") -> RunResult:
        suffix = HETERO if hetero else variant
        return self.run(name + suffix, lambda: VARIANTS[suffix](name))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("contract_reference"))


def stopped_and_resumed(cfg: Config, run_dir: Path) -> RunResult:
    """``cfg``'s run in ``run_dir`` stopped after its 2nd metrics row, then resumed to its end."""
    stopped = run_experiment(cfg, run_dir, stop=stop_after_rows(run_dir, 2))
    assert (stopped.rounds_done, stopped.finished) == (2, False)
    resumed = run_experiment(cfg, run_dir, resume=True)
    assert resumed.finished
    return resumed


def assert_same_records(run_dir: Path, reference: RunResult) -> None:
    """The run in ``run_dir`` logged ``reference``'s test accuracies and, for a personalised
    algorithm, its per-client accuracies, bit for bit."""
    assert _accuracies(_rows(run_dir)) == _accuracies(reference.metrics)
    assert _personal(run_dir) == _personal(reference.run_dir)


def assert_batched_matches(batched: torch.Tensor, reference: torch.Tensor, *, exact: bool) -> None:
    """``client_batch``'s final state equals one-by-one training's: bit for bit where ``exact`` (the
    participants were trained one by one anyway), else to 1e-5 relative."""
    if exact:
        assert torch.equal(batched, reference)
    else:
        rel = float((batched - reference).norm() / reference.norm())
        assert rel < 1e-5, rel


def two_rank_runs(tmp: Path, configs: dict[str, dict[str, Any]]) -> Path:
    """Every config of ``configs`` (by run name) run on 2 MPI ranks, in one ``mpiexec``; returns
    the folder holding their run directories (by name)."""
    (tmp / "runs.json").write_text(json.dumps(configs))
    argv = [
        MPIEXEC,
        "-n",
        "2",
        sys.executable,
        str(PROGRAMS / "ranks.py"),
        str(tmp / "runs.json"),
        str(tmp / "runs"),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, env=plugin_env(), timeout=600)
    assert proc.returncode == 0 and proc.stdout.count(": OK") == 2, proc.stdout + proc.stderr
    return tmp / "runs"


def test_every_builtin_and_the_example_plugin_are_covered() -> None:
    assert {
        "fedavg",
        "fedavgm",
        "fedadam",
        "fedyogi",
        "fedadagrad",
        "scaffold",
        "tct",
        "cp-ntkfl",
        "example_slr",
    } <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_name_and_params_agree_with_the_class(name: str) -> None:
    cls = ALGORITHMS[name]
    assert cls.name == name
    params = example_params(cls)
    assert type(params) is cls.Params and dataclasses.is_dataclass(params)
    assert config_from_dict(contract_config(name)).params == params  # survives the YAML round trip


def golden_file(cls: type[Algorithm]) -> Path | None:
    """Where the golden hashes of algorithm ``cls`` live: hpcfl's ``tests/golden`` for a built-in;
    for a plugin, :data:`PLUGIN_GOLDEN` beside the module that defines the class (the plugin owns
    and ships it), or None where that module has no file (a class defined in a notebook)."""
    if cls.name in ALGORITHMS.builtin_names() and ALGORITHMS[cls.name] is cls:
        return GOLDEN
    file = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return Path(file).resolve().with_name(PLUGIN_GOLDEN) if file else None


def _read_hashes(path: Path) -> dict[str, dict[str, str]]:
    return json.loads(path.read_text()) if path.is_file() else {}


def golden_hash(name: str, capability: str) -> str:
    """The golden hash of algorithm ``name`` for ``capability``; a missing one fails for a built-in
    (hpcfl records all of them) and skips for a plugin or a capability nobody recorded, saying how
    to record it and where it goes."""
    cls = ALGORITHMS[name]
    path = golden_file(cls)
    record = f"PYTHONPATH={REPO} python {REPO / 'tests' / 'test_contract.py'} --record {name}"
    if path is None:
        pytest.skip(
            f"plugin algorithm {name!r} is defined in {cls.__module__!r}, which has no file: "
            f"define it in a module to keep its golden hash beside it"
        )
    hashes = _read_hashes(path).get(name)
    if hashes is None and path == GOLDEN:
        pytest.fail(f"no golden hash for {name!r}: record it with {record}")
    if hashes is None:
        pytest.skip(
            f"plugin algorithm {name!r} has no golden hash: record it with {record} "
            f"(writes {path}, beside the plugin's module; ship that file with the plugin)"
        )
    if capability not in hashes:
        pytest.skip(f"no {name} hash for CPU capability {capability}: {record} (writes {path})")
    return hashes[capability]


@pytest.mark.parametrize("name", NAMES)
def test_golden_final_state(runs: Runs, name: str) -> None:
    expected = golden_hash(name, torch.backends.cpu.get_cpu_capability())
    assert sha256(runs.reference(name).server.x) == expected


def test_builtin_hashes_cover_avx2_and_avx512_and_hold_no_plugin() -> None:
    golden = _read_hashes(GOLDEN)
    assert set(golden) == set(ALGORITHMS.builtin_names())
    assert all({"AVX2", "AVX512"} <= set(hashes) for hashes in golden.values()), golden


def test_a_plugins_golden_hash_is_the_plugins_file_and_record_writes_only_there(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example plugin's hashes sit beside its module; ``--record`` of a plugin algorithm writes
    beside the plugin's module and leaves hpcfl's own golden file byte-identical."""
    from hpcfl.registry import register_algorithm

    example = golden_file(ALGORITHMS["example_slr"])
    assert example is not None and example.parent.name == "hpcfl_example" and example.is_file()
    assert {"AVX2", "AVX512"} <= set(_read_hashes(example)["example_slr"])

    (tmp_path / "my_method.py").write_text(
        "from hpcfl.algorithms.fedavg import FedAvg\n\n\nclass Mine(FedAvg):\n    name = 'contract_tmp'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_method  # type: ignore[import-not-found]

    register_algorithm(my_method.Mine)
    try:
        assert golden_file(my_method.Mine) == tmp_path / PLUGIN_GOLDEN
        with pytest.raises(pytest.skip.Exception, match="beside the plugin's module"):
            golden_hash("contract_tmp", "AVX2")
        before = GOLDEN.read_bytes()
        _record(["contract_tmp"])
        assert GOLDEN.read_bytes() == before
        capability = torch.backends.cpu.get_cpu_capability()
        recorded = _read_hashes(tmp_path / PLUGIN_GOLDEN)["contract_tmp"][capability]
        assert golden_hash("contract_tmp", capability) == recorded
        assert recorded == sha256(runs.reference("fedavg").server.x)  # FedAvg's steps, FedAvg's state
    finally:
        del ALGORITHMS._registered["contract_tmp"]


@pytest.mark.parametrize("name", NAMES)
def test_stopped_and_resumed_run_is_bit_identical(runs: Runs, tmp_path: Path, name: str) -> None:
    reference = runs.reference(name)
    resumed = stopped_and_resumed(config_from_dict(contract_config(name)), tmp_path / "stopped")
    assert torch.equal(resumed.server.x, reference.server.x)
    assert_same_records(tmp_path / "stopped", reference)


@pytest.mark.parametrize("name", NAMES)
def test_heterogeneous_stopped_and_resumed_run_is_bit_identical(
    runs: Runs, tmp_path: Path, name: str
) -> None:
    reference = runs.reference(name, hetero=True)
    resumed = stopped_and_resumed(config_from_dict(hetero_config(name)), tmp_path / "stopped")
    assert torch.equal(resumed.server.x, reference.server.x)
    assert _rows_without_timing(_rows(tmp_path / "stopped")) == _rows_without_timing(reference.metrics)


def _rows_without_timing(rows: list[dict]) -> list[dict]:
    """The rows' deterministic columns (accuracies, who trained, the work, the drops, the bytes)."""
    keep = ("test_accuracy", "participants", "work_steps", "stragglers", "dropped", "bytes_up", "bytes_down")
    return [{k: r[k] for k in keep if k in r} for r in rows]


@pytest.mark.parametrize("name", NAMES)
def test_heterogeneous_bytes_count_what_arrived(runs: Runs, name: str) -> None:
    """Under dropout ``bytes_up`` counts the uploads that arrived and ``bytes_down`` every drawn
    participant (the dropped ones downloaded before failing); a model-training stage records the
    work of each participant that arrived."""
    hetero, plain = runs.reference(name, hetero=True), runs.reference(name)
    nbytes = _download_nbytes(name, hetero.server)
    rows = [r for r in hetero.metrics if "dropped" in r]
    assert rows, f"{name}: no round recorded its system draw"
    assert any(r["dropped"] for r in rows), "the contract's SYSTEM drops no one: change its seed or p"
    for row in rows:
        arrived = row.get("participants", range(BASE["num_clients"]))
        assert not set(row["dropped"]) & set(arrived)
        if row.get("stage") == hetero.metrics[-1].get("stage"):  # the final server state's stage
            assert row["bytes_down"] == (len(arrived) + len(row["dropped"])) * nbytes
        assert len(row["work_steps"]) == len(arrived) and all(1 <= s <= 3 for s in row["work_steps"])
    # where every participant's upload has one size (no gathers of varying size, one stage), the
    # heterogeneous run's bytes_up are exactly the uploads that arrived
    per = {r["bytes_up"] / len(r.get("participants", range(4))) for r in plain.metrics}
    if len(per) == 1:
        (one,) = per
        for row in rows:
            assert row["bytes_up"] == len(row.get("participants", range(4))) * one


def _download_nbytes(name: str, server: Any) -> int:
    """What one participant of algorithm ``name`` downloads, from its declaration: every tensor
    field of ``server`` but the ``server_only`` ones, whole, except a field its exchange names in
    ``received``, of which the declared length (the first stage's algorithm declares it; the
    multi-stage built-ins declare none). A declaration must name a downloaded tensor field and at
    most its length."""
    from hpcfl.runner.federation import build_federation

    algo = build_federation(config_from_dict(contract_config(name, rounds=1)), LocalComm()).algorithm
    partial = {r.field: r.length for r in algo.exchange(server.x.dtype).received}
    fields = {f.name: getattr(server, f.name) for f in dataclasses.fields(server)}
    for field_name, length in partial.items():
        v = fields.get(field_name)
        assert isinstance(v, torch.Tensor) and field_name not in type(server).server_only, (
            f"{name}: received names {field_name!r}, not a downloaded tensor field of the server state"
        )
        assert 0 <= length <= v.numel(), f"{name}: received {length} of {field_name!r} ({v.numel()})"
    return server_nbytes(server, partial)


def server_nbytes(server: Any, partial: dict[str, int] | None = None) -> int:
    """The bytes of ``server``'s tensor fields but the ``server_only`` ones: whole, or the first
    ``partial[field]`` elements of a field named there."""
    partial = partial or {}
    fields = {f.name: getattr(server, f.name) for f in dataclasses.fields(server)}
    return sum(
        partial.get(f, v.numel()) * v.element_size()
        for f, v in fields.items()
        if f not in type(server).server_only and isinstance(v, torch.Tensor)
    )


@pytest.mark.parametrize("name", NAMES)
def test_bytes_down_are_the_fields_a_participant_receives(runs: Runs, name: str) -> None:
    nbytes = _download_nbytes(name, runs.reference(name).server)
    row = runs.reference(name).metrics[-1]
    participants = row.get("participants", range(BASE["num_clients"]))  # absent: everyone took part
    assert row["bytes_down"] == len(participants) * nbytes > 0


def _same(a: Any, b: Any) -> bool:
    """Bitwise equality of uploads (tensors, numbers, nested dicts / lists / tuples)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(map(_same, a, b))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and _same(vars(a), vars(b))
    return a == b


@pytest.mark.parametrize("name", NAMES)
def test_server_only_fields_are_exactly_those_clients_never_read(name: str) -> None:
    """One participant's upload from the first stage's server state after one round: NaN in a
    ``server_only`` field leaves it bit-identical; noise in any other field changes it (a field
    that is sent but never read should be ``server_only``; it would inflate ``bytes_down``)."""
    from hpcfl.runner.federation import build_federation, client_generator

    fed = build_federation(config_from_dict(contract_config(name, rounds=1)), LocalComm())
    algo = fed.algorithm
    server = algo.init_server(fed.flat.vector.clone())
    g = torch.Generator().manual_seed(0)
    for f in dataclasses.fields(server):  # every buffer non-trivial, as after some rounds
        v = getattr(server, f.name)
        if isinstance(v, torch.Tensor) and v.is_floating_point() and f.name != "x":
            setattr(server, f.name, v + 0.01 * torch.randn(v.shape, generator=g, dtype=v.dtype))

    def upload(state: Any) -> Any:
        ctx = ClientContext(0, (0, 1, 2), fed.population, fed.trainer, client_generator(BASE["seed"], 0, 0))
        client = algo.init_client(0, state)
        up, _ = algo.client_update(state, client, fed.client_data(0), ctx)
        return up.sums, up.gathered, up.weight

    base = upload(server)
    for f in dataclasses.fields(server):
        v = getattr(server, f.name)
        if not (isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()):
            continue
        if f.name in type(server).server_only:
            changed = dataclasses.replace(server, **{f.name: torch.full_like(v, float("nan"))})
            assert _same(upload(changed), base), f"{name}: server_only field {f.name!r} is read by clients"
        else:
            changed = dataclasses.replace(
                server, **{f.name: v + torch.randn(v.shape, generator=g, dtype=v.dtype)}
            )
            assert not _same(upload(changed), base), (
                f"{name}: field {f.name!r} is downloaded but no client reads it; declare it server_only"
            )


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_loads_weights_only_and_restores_the_states(runs: Runs, name: str) -> None:
    reference = runs.reference(name)
    ckpt = reference.run_dir / "checkpoints"
    latest = ckpt / (ckpt / "LATEST").read_text().strip()
    saved = torch.load(latest / "server.pt", weights_only=True)["server"]
    restored = state_from_dict(type(reference.server), saved)
    for f in dataclasses.fields(reference.server):
        assert _same(getattr(restored, f.name), getattr(reference.server, f.name)), f.name
    clients = sorted((latest / "clients").glob("*.pt")) if (latest / "clients").is_dir() else []
    for path in clients:
        data = torch.load(path, weights_only=True)
        assert isinstance(data, dict) and all(not callable(v) for v in data.values()), path.name


def _disk_config_files(tmp: Path) -> dict[str, str]:
    paths = {}
    for name in NAMES:
        cfg = contract_config(name, client_state_memory="disk", checkpoint_every=2)
        paths[name] = str(write_config(tmp / f"{name}.yaml", **cfg))
    return paths


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], dict[str, str]]:
    """Every algorithm's disk-store run, SIGKILLed right after its 3rd (last) metrics row."""
    tmp = tmp_path_factory.mktemp("contract_killed")
    configs = _disk_config_files(tmp)
    (tmp / "runs.json").write_text(json.dumps(configs))
    proc = subprocess.run(
        [sys.executable, str(PROGRAMS / "killed.py"), str(tmp / "runs.json"), str(tmp / "runs"), "3"],
        capture_output=True,
        text=True,
        env=plugin_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return tmp / "runs", configs, json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", NAMES)
def test_kill_9_with_states_on_disk_resumes_bit_identically(runs: Runs, killed, name: str) -> None:
    root, configs, ends = killed
    assert ends[name] == "killed", ends[name]
    run_dir = root / name
    assert not (run_dir / "DONE").exists() and len(_rows(run_dir)) == 3  # row 3 written, not checkpointed
    cfg = config_from_dict(contract_config(name, client_state_memory="disk", checkpoint_every=2))
    resumed = run_experiment(cfg, run_dir, resume=True)
    reference = runs.reference(name)
    assert torch.equal(resumed.server.x, reference.server.x)
    assert_same_records(run_dir, reference)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every algorithm's run on 2 MPI ranks (one mpiexec for all of them)."""
    runs = {name + suffix: config(name) for suffix, config in VARIANTS.items() for name in NAMES}
    return two_rank_runs(tmp_path_factory.mktemp("contract_ranks"), runs)


@pytest.mark.mpi
@pytest.mark.parametrize("name", NAMES)
def test_one_rank_and_two_ranks_are_bit_identical(runs: Runs, two_ranks: Path, name: str) -> None:
    reference = runs.reference(name)
    assert torch.equal(final_state(two_ranks / name), reference.server.x)
    assert_same_records(two_ranks / name, reference)


@pytest.mark.mpi
@pytest.mark.parametrize("name", NAMES)
def test_heterogeneous_one_rank_and_two_ranks_are_bit_identical(
    runs: Runs, two_ranks: Path, name: str
) -> None:
    reference = runs.reference(name, hetero=True)
    assert torch.equal(final_state(two_ranks / (name + HETERO)), reference.server.x)
    assert _rows_without_timing(_rows(two_ranks / (name + HETERO))) == _rows_without_timing(reference.metrics)


@pytest.mark.mpi
@pytest.mark.parametrize("name", NAMES)
def test_full_participation_with_dropout_one_rank_and_two_ranks_are_bit_identical(
    runs: Runs, two_ranks: Path, name: str
) -> None:
    """Dropouts under full participation (:func:`full_config`): the same final state, clients' own
    models, rows and client states on 1 and 2 ranks."""
    reference = runs.reference(name, variant=FULL)
    assert any(r.get("dropped") for r in reference.metrics), "full_config drops no one: change its seed"
    run_dir = two_ranks / (name + FULL)
    assert torch.equal(final_state(run_dir), reference.server.x)
    assert _personal(run_dir) == _personal(reference.run_dir)
    assert _rows_without_timing(_rows(run_dir)) == _rows_without_timing(reference.metrics)
    assert _client_files(run_dir).keys() == _client_files(reference.run_dir).keys()
    for k, saved in _client_files(reference.run_dir).items():
        assert _same(_client_files(run_dir)[k], saved), f"{name}: client {k}'s state differs on 2 ranks"


def _client_files(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Every client state the newest checkpoint of ``run_dir`` holds, by client id."""
    ckpt = run_dir / "checkpoints"
    folder = ckpt / (ckpt / "LATEST").read_text().strip() / "clients"
    files = sorted(folder.glob("client_*.pt")) if folder.is_dir() else []
    return {int(p.stem.split("_")[1]): torch.load(p, weights_only=True) for p in files}


@pytest.mark.parametrize("name", NAMES)
def test_client_batch_equals_one_by_one(runs: Runs, tmp_path: Path, name: str) -> None:
    reference = runs.reference(name).server.x
    batched = run_experiment(
        config_from_dict(contract_config(name, client_batch="3")), tmp_path / "b"
    ).server.x
    # nothing declared: trained one by one, bit for bit
    assert_batched_matches(batched, reference, exact=ALGORITHMS[name].local_task is Algorithm.local_task)


@pytest.mark.parametrize("name", NAMES)
def test_client_threads_equal_one_by_one_bit_for_bit(runs: Runs, tmp_path: Path, name: str) -> None:
    """``client_threads: 2`` (3 participants a round on 2 threads, each client on its own copy of the
    model) ends bit for bit where one-by-one training does: with ``threads: 1`` every client's kernels
    run on one thread either way. A method that declares no local task is trained one by one."""
    threaded = run_experiment(config_from_dict(contract_config(name, client_threads=2)), tmp_path / "t")
    assert torch.equal(threaded.server.x, runs.reference(name).server.x)
    assert _accuracies(threaded.metrics) == _accuracies(runs.reference(name).metrics)


@pytest.mark.parametrize("name", ["fedavg", "scaffold"])
def test_client_threads_share_the_ranks_torch_threads(runs: Runs, tmp_path: Path, name: str) -> None:
    """``threads: 2, client_threads: 2``: each client trains on 2 // 2 = 1 torch thread, so the run
    ends bit for bit where ``threads: 1`` one by one does, and the rank's 2 threads are back after it."""
    threaded = run_experiment(
        config_from_dict(contract_config(name, threads=2, client_threads=2)), tmp_path / "t"
    )
    assert torch.get_num_threads() == 2
    assert torch.equal(threaded.server.x, runs.reference(name).server.x)


@pytest.mark.parametrize("name", ["fedavg", "scaffold", "fednova"])
def test_client_threads_follow_each_participants_own_schedule(runs: Runs, tmp_path: Path, name: str) -> None:
    """Under ``system.work`` (1-3 local steps drawn per participant) a threaded client trains its own
    schedule: bit for bit the heterogeneous one-by-one run."""
    cfg = config_from_dict({**hetero_config(name), "client_threads": 2})
    threaded = run_experiment(cfg, tmp_path / "t")
    assert torch.equal(threaded.server.x, runs.reference(name, hetero=True).server.x)


def _record(names: list[str]) -> None:
    """Store this CPU capability's final-state hash of each named algorithm's contract run, in the
    file :func:`golden_file` names (a plugin's beside its own module, never hpcfl's tests/golden).

    The capability is ``torch.backends.cpu.get_cpu_capability()``. An AVX-512 machine records the
    AVX2 hashes of a machine without AVX-512 when PyTorch, oneDNN and MKL are all held to AVX2::

        ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
            PYTHONPATH=. python tests/test_contract.py --record all

    (held so, this machine reproduces the 7 hashes of ``final_state_hashes.json`` that were recorded
    on a real AVX2 machine; ``ATEN_CPU_CAPABILITY`` alone misses moon's and fedcka's).
    """
    import tempfile

    capability = torch.backends.cpu.get_cpu_capability()
    for name in names:
        path = golden_file(ALGORITHMS[name])
        if path is None:
            raise SystemExit(f"{name}: its class is not defined in a module file; nowhere to record it")
        with tempfile.TemporaryDirectory() as tmp:
            x = run_experiment(config_from_dict(contract_config(name)), Path(tmp) / "run").server.x
        golden = _read_hashes(path)
        golden.setdefault(name, {})[capability] = sha256(x)
        tmp_path = path.with_name(f".{path.name}.tmp")
        tmp_path.write_text(json.dumps(dict(sorted(golden.items())), indent=1) + "\n")
        tmp_path.replace(path)
        print(name, capability, golden[name][capability], path, flush=True)


if __name__ == "__main__":  # PYTHONPATH=. python tests/test_contract.py --record NAME [NAME ...] | all
    from tests.conftest import _example_plugin_on_path

    _example_plugin_on_path()
    args = sys.argv[1:]
    if not args or args[0] != "--record":
        raise SystemExit("usage: python tests/test_contract.py --record NAME [NAME ...] (or --record all)")
    _record(list(ALGORITHMS) if args[1:] == ["all"] else args[1:])
