"""Device-free checkpoints (issue 39): files name no device, and every read puts tensors on the reader's.

A CPU machine cannot write a CUDA tensor, but it can write the file a GPU run writes: ``torch.save``
records each storage's device through ``torch.serialization.location_tag``, so saving with that
patched to answer ``cuda:0`` gives the bytes a GPU run's checkpoint has (a plain ``torch.load`` of
it fails here exactly as on a CPU node). ``tests/fixtures/checkpoint_cuda/``, when present, is the
real thing (made on a GPU by ``tests/fixtures/make_checkpoint_cuda.py``).
"""

from __future__ import annotations

import ast
import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from hpcfl.comm import LocalComm
from hpcfl.config import load_config
from hpcfl.errors import RunDirError
from hpcfl.files import atomic_torch_save, host_copy, load_torch_file
from hpcfl.runner import run_experiment
from hpcfl.runner.checkpoint import load_checkpoint, placed_state, save_checkpoint
from hpcfl.runner.client_states import ClientStates
from tests.helpers import REPO, synthetic_config

FIXTURE = REPO / "tests" / "fixtures" / "checkpoint_cuda"
FIXTURE_CONFIG = REPO / "tests" / "fixtures" / "cuda_checkpoint.yaml"


def locations(path: Path) -> set[str]:
    """The device tags a ``torch.save`` file records for its storages."""
    seen: list[str] = []
    torch.load(path, map_location=lambda storage, loc: (seen.append(loc), storage)[1], weights_only=True)
    return set(seen)


def save_as_from(path: Path, obj: object, tag: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.save(obj)`` to ``path`` with every storage recorded as on device ``tag``."""
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: tag)
        torch.save(obj, path)


def retag(root: Path, tag: str, monkeypatch: pytest.MonkeyPatch) -> int:
    """Rewrite every ``.pt`` file under ``root`` as if written from tensors on ``tag``; the count."""
    files = sorted(root.rglob("*.pt"))
    for path in files:
        save_as_from(path, torch.load(path, map_location="cpu", weights_only=True), tag, monkeypatch)
        assert locations(path) == {tag}
    return len(files)


def tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors(v)]
    return []


def test_host_tensors_are_saved_as_they_are(tmp_path: Path) -> None:
    """On a CPU run nothing is copied (the same tensor objects reach ``torch.save``), and the file
    records the host only."""
    x = torch.arange(6.0)
    obj = {"x": x, "parts": [x[:2], (x[3:], 3)], "n": 1, "none": None}
    copy = host_copy(obj)
    assert copy["x"] is x and copy["parts"][0] is obj["parts"][0]
    assert copy["parts"][1][0] is obj["parts"][1][0]
    assert copy["n"] == 1 and copy["none"] is None
    atomic_torch_save(tmp_path / "a.pt", obj)
    assert locations(tmp_path / "a.pt") == {"cpu"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_file_written_from_gpu_tensors_names_no_device(tmp_path: Path) -> None:
    """Saved from host copies: the file records the host only, views of one GPU storage stay views of
    one storage in the file, the values are equal, and the run's own tensors stay on the GPU."""
    x = torch.arange(8.0, device="cuda")
    obj = {"x": x, "head": x[:3], "tail": x[5:].view(1, 3), "host": torch.ones(2)}
    atomic_torch_save(tmp_path / "a.pt", obj)
    assert locations(tmp_path / "a.pt") == {"cpu"}
    back = torch.load(tmp_path / "a.pt", map_location="cpu", weights_only=True)
    ptr = back["x"].untyped_storage().data_ptr()
    assert back["head"].untyped_storage().data_ptr() == ptr == back["tail"].untyped_storage().data_ptr()
    for name, value in obj.items():
        assert torch.equal(back[name], value.cpu()) and back[name].shape == value.shape, name
    assert obj["x"].device.type == "cuda"


def _checkpoint(tmp_path: Path) -> tuple[Path, dict, dict]:
    root = tmp_path / "checkpoints"
    server = {"x": torch.randn(10), "c": torch.randn(10), "steps": torch.zeros(2, dtype=torch.float64)}
    clients = {0: {"c": torch.randn(10)}, 2: {"c": torch.randn(10), "prev": None}}
    save_checkpoint(root, 3, server, clients, LocalComm(), extra={"clients": [0, 2], "stage": "main"})
    return root, server, clients


def test_a_checkpoint_loads_onto_the_device_it_is_asked_for(tmp_path: Path) -> None:
    """Written on the host, read onto another device (``meta`` plays it on a CPU): every tensor of the
    server and of every client lands on the target, whatever device wrote the file."""
    root, server, clients = _checkpoint(tmp_path)
    ckpt = load_checkpoint(root, [0, 1, 2], device="meta")
    assert ckpt is not None and ckpt.round == 3 and sorted(ckpt.clients) == [0, 2]
    loaded = tensors(ckpt.server) + tensors(ckpt.clients)
    assert len(loaded) == 5 and {t.device.type for t in loaded} == {"meta"}
    assert ckpt.clients[2]["prev"] is None and ckpt.server["steps"].dtype == torch.float64


def test_a_checkpoint_written_from_cuda_tensors_loads_on_the_cpu_and_is_not_called_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, server, clients = _checkpoint(tmp_path)
    assert retag(root, "cuda:0", monkeypatch) == 3
    server_file = root / "round_000003" / "server.pt"
    # the file is faithful: without map_location it fails here as on a CPU node
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(server_file, weights_only=True)
    ckpt = load_checkpoint(root, [0, 1, 2], device="cpu")
    assert ckpt is not None and ckpt.round == 3
    for name, value in server.items():
        assert ckpt.server[name].device.type == "cpu" and torch.equal(ckpt.server[name], value), name
    for k, state in clients.items():
        assert torch.equal(ckpt.clients[k]["c"], state["c"]), k
    # and through the one-line loader (hpcfl tct-stage2's θ_T1): read, not reported as damaged
    theta = load_torch_file(server_file, "rerun", device="cpu")
    assert torch.equal(theta["server"]["x"], server["x"])


def test_a_truly_damaged_file_is_still_called_damaged(tmp_path: Path) -> None:
    path = tmp_path / "theta.pt"
    atomic_torch_save(path, torch.randn(4))
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(RunDirError, match=r"theta.pt is damaged .*; rerun"):
        load_torch_file(path, "rerun", device="cpu")


@dataclasses.dataclass
class _State:
    x: torch.Tensor
    steps: torch.Tensor
    prev: torch.Tensor | None = None


def test_a_restored_state_puts_each_field_where_a_fresh_state_keeps_it() -> None:
    """Model vectors go to the rank's device, host bookkeeping (DP's step counts) stays on the host,
    a field a fresh state leaves unset goes to the given device; a tensor in place is not copied."""
    fresh = _State(x=torch.zeros(3, device="meta"), steps=torch.zeros(2, dtype=torch.float64))
    saved = {"x": torch.ones(3), "steps": torch.ones(2, dtype=torch.float64), "prev": torch.ones(3)}
    state = placed_state(fresh, saved, "meta")
    assert (state.x.device.type, state.steps.device.type, state.prev.device.type) == ("meta", "cpu", "meta")
    assert state.steps is saved["steps"]
    kept = placed_state(fresh, saved)  # no device: an unset field stays where it was loaded
    assert kept.prev is saved["prev"]
    with pytest.raises(TypeError):  # a field the state does not have is refused, as before
        placed_state(fresh, {**saved, "other": torch.ones(1)})


@dataclasses.dataclass
class _ClientState:
    c: torch.Tensor | None = None


def test_the_client_state_store_restores_onto_the_runs_device_not_the_writers(tmp_path: Path) -> None:
    """A store whose checkpoint map says its fields were written from ``cuda`` (rank 0's GPU, before
    issue 39 the device a read went back to) comes back on the reading run's device."""
    path = tmp_path / "cs.zarr"
    writer = ClientStates(lambda k: _ClientState(), num_clients=3, budget_bytes=0, path=path)
    writer.put(1, _ClientState(c=torch.arange(4.0)))
    cmap = {**writer.checkpoint_map(), "devices": {"c": "cuda"}}  # as a GPU run's map recorded it
    for device in ("cpu", "meta"):
        reader = ClientStates(
            lambda k: _ClientState(), num_clients=3, budget_bytes=0, path=path, device=device
        )
        reader.restore_map(cmap)
        c = reader.get(1).c
        assert c is not None and c.device.type == device
        if device == "cpu":
            assert torch.equal(c, torch.arange(4.0))
        assert reader.get(0).c is None  # never written: init(k)


def _resume(cfg: Path, run: Path, rounds: int) -> torch.Tensor:
    result = run_experiment(load_config(cfg, [f"rounds={rounds}", "device=cpu"]), run, resume=True)
    assert result.finished and result.rounds_done == rounds
    assert result.server.x.device.type == "cpu"
    return result.server.x


@pytest.mark.parametrize("memory", ["memory", "disk"])
def test_a_run_checkpointed_on_a_gpu_resumes_on_the_cpu_bit_identically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, memory: str
) -> None:
    """2 rounds, every checkpoint file rewritten as a GPU run writes it (``cuda:0``), resumed with
    ``device: cpu`` to 4: equal bit for bit to 4 uninterrupted rounds (SCAFFOLD: server and client
    states; in memory, per-client files; on disk, the client-state store and its slot map)."""
    cfg = synthetic_config(
        tmp_path,
        dataset_options={"n_train": 400, "n_test": 100, "seed": 3, "input_shape": [1, 8, 8]},
        client_state_memory=memory,
    )
    reference = run_experiment(load_config(cfg), tmp_path / "ref")
    run = tmp_path / "gpu"
    run_experiment(load_config(cfg, ["rounds=2"]), run)
    assert retag(run / "checkpoints", "cuda:0", monkeypatch) >= (1 if memory == "disk" else 5)
    assert torch.equal(_resume(cfg, run, 4), reference.server.x)


def _fixture_runs(dest: Path) -> list[Path]:
    """Two resumable copies of the fixture under ``dest``: as made (files on ``cuda``) and with every
    file written again from host tensors. The fixture is a whole run directory, or only its
    ``checkpoints/`` (the run's config is then ``tests/fixtures/cuda_checkpoint.yaml``)."""
    from hpcfl.config import dump_config

    runs = []
    for name in ("gpu", "host"):
        run = dest / name
        if (FIXTURE / "checkpoints").is_dir():
            shutil.copytree(FIXTURE, run)
        else:
            shutil.copytree(FIXTURE, run / "checkpoints")
            dump_config(load_config(FIXTURE_CONFIG), run / "config.yaml")
        runs.append(run)
    for path in runs[1].rglob("*.pt"):
        torch.save(torch.load(path, map_location="cpu", weights_only=True), path)
    return runs


@pytest.mark.skipif(
    not any((d / "LATEST").exists() for d in (FIXTURE, FIXTURE / "checkpoints")),
    reason="no GPU-made fixture yet",
)
def test_the_checkpoint_saved_on_a_gpu_resumes_on_the_cpu(tmp_path: Path) -> None:
    """The fixture made on a GPU (its files record ``cuda``) resumes on this CPU for one more round,
    bit-identical to the same checkpoint rewritten from host tensors: where the file says its
    tensors were changes nothing."""
    tags = set().union(*(locations(p) for p in FIXTURE.rglob("*.pt")))
    assert tags and all(t.startswith("cuda") for t in tags), tags
    gpu, host = _fixture_runs(tmp_path)
    done = int((gpu / "checkpoints" / "LATEST").read_text().strip().split("_")[1])
    cfg = gpu / "config.yaml"
    assert torch.equal(_resume(cfg, gpu, done + 1), _resume(cfg, host, done + 1))


def test_every_torch_load_in_hpcfl_says_where_and_keeps_weights_only() -> None:
    """A ``torch.load`` without ``map_location`` puts tensors back on the writer's device (rank 0's
    GPU, or none on a CPU node); one without ``weights_only=True`` unpickles arbitrary code."""
    missing = []
    for path in sorted((REPO / "hpcfl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "load"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
            ):
                kw = {k.arg: k.value for k in node.keywords}
                safe = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
                if "map_location" not in kw or not safe:
                    missing.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not missing, missing
