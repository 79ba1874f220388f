"""The client-state store: exact round trips, the two-slot checkpoint protocol, memory vs store mode."""

from __future__ import annotations

import io
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor

from hpcfl.errors import ConfigError, StoreError
from hpcfl.node import available_memory_bytes
from hpcfl.runner.client_states import ClientStates, ClientStateStore, resolve_budget


@dataclass
class State:
    a: Tensor | None = None
    b: Tensor | None = None
    c: Tensor | None = None


def init(k: int) -> State:
    return State(c=torch.full((3,), k, dtype=torch.int64))


def bits(t: Tensor | None) -> bytes | None:
    return (
        None if t is None else t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    )


def same(x: State, y: State) -> bool:
    return all(
        (u is None and v is None)
        or (u is not None and v is not None and u.dtype == v.dtype and bits(u) == bits(v))
        for u, v in ((x.a, y.a), (x.b, y.b), (x.c, y.c))
    )


def through_checkpoint(cmap: dict) -> dict:
    """What torch.save + torch.load(weights_only) of a checkpoint gives back."""
    buf = io.BytesIO()
    torch.save(cmap, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def random_state(rng: random.Random, k: int, r: int) -> State:
    g = torch.Generator().manual_seed(1000 * r + k)
    fields = {
        "a": torch.randn(4, 5, generator=g),
        "b": torch.randn(6, generator=g, dtype=torch.float64),
        "c": torch.randint(-(2**62), 2**62, (3,), generator=g),
    }
    return State(**{n: v if rng.random() < 0.7 else None for n, v in fields.items()})


def test_store_round_trip_is_bitwise(tmp_path: Path) -> None:
    special = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf"), 1e-45, 3.4e38])
    nan_payload = torch.tensor([0x7FC00001, 0x7F800001, -1], dtype=torch.int32).view(torch.float32)
    fields = {
        "f32": ((2, 6), torch.float32),
        "f64": ((5,), torch.float64),
        "i64": ((), torch.int64),
        "bf16": ((6,), torch.bfloat16),
        "lazy": None,  # shape learned from the first write
        "never": None,
    }
    store = ClientStateStore.open(tmp_path / "s.zarr", num_clients=4, fields=fields, create=True)
    states = {
        0: {
            "f32": torch.stack([special, torch.cat([nan_payload, special[:3]])]),
            "f64": torch.tensor([-0.0, 1e-310, float("nan"), 2.0**-1074, -1.5], dtype=torch.float64),
            "i64": torch.tensor(-(2**63), dtype=torch.int64),
            "bf16": special.to(torch.bfloat16),
            "lazy": torch.arange(7, dtype=torch.int64) - 2**62,
            "never": None,
        },
        1: {
            "f32": torch.zeros(2, 6),
            "f64": None,
            "i64": torch.tensor(2**63 - 1),
            "bf16": None,
            "lazy": None,
        },
    }
    for slot in (0, 1):
        for k, s in states.items():
            store.write(k, slot, s if slot == 0 else {n: v if n != "f64" else None for n, v in s.items()})
    again = ClientStateStore.open(tmp_path / "s.zarr", num_clients=4, fields=fields, create=False)
    assert again.field_spec("lazy") == ((7,), torch.int64) and again.field_spec("never") is None
    for slot in (0, 1):
        for k, s in states.items():
            got = again.read(k, slot)
            assert set(got) == set(fields)
            for name in fields:
                want = s.get(name) if not (slot == 1 and name == "f64") else None
                assert bits(got[name]) == bits(want), (k, slot, name)
                if want is not None:
                    assert got[name].dtype == want.dtype and got[name].shape == want.shape
    assert all(v is None for v in again.read(3, 0).values())  # never written: all absent


def test_ranks_open_and_write_concurrently(tmp_path: Path) -> None:
    """Ranks (threads here) each create the store and lazily its fields, writing their own clients."""
    from concurrent.futures import ThreadPoolExecutor

    path, K = tmp_path / "s.zarr", 8

    def rank(r: int) -> None:
        store = ClientStateStore.open(path, num_clients=K, fields={"a": None, "b": None}, create=True)
        for k in range(r, K, 4):
            store.write(k, k % 2, {"a": torch.full((5,), float(k)), "b": torch.tensor(k) if k % 3 else None})

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(rank, range(4)))
    store = ClientStateStore.open(path, num_clients=K, fields={"a": None, "b": None}, create=False)
    for k in range(K):
        got = store.read(k, k % 2)
        assert torch.equal(got["a"], torch.full((5,), float(k)))
        assert (got["b"] is None) if k % 3 == 0 else int(got["b"]) == k


def test_store_refuses_mismatches(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    with pytest.raises(StoreError, match="no client-state store"):
        ClientStateStore.open(path, num_clients=3, fields={"a": None}, create=False)
    store = ClientStateStore.open(path, num_clients=3, fields={"a": ((4,), torch.float32)}, create=True)
    with pytest.raises(StoreError, match="shape"):
        store.write(0, 0, {"a": torch.zeros(5)})
    with pytest.raises(StoreError, match="float64"):
        store.write(0, 0, {"a": torch.zeros(4, dtype=torch.float64)})
    with pytest.raises(KeyError):
        store.write(0, 0, {"z": torch.zeros(4)})
    with pytest.raises(StoreError, match="another run"):
        ClientStateStore.open(path, num_clients=4, fields={"a": None}, create=True)
    with pytest.raises(StoreError, match="another run"):
        ClientStateStore.open(path, num_clients=3, fields={"a": None, "b": None}, create=True)
    # creating again is idempotent and keeps the data
    store.write(2, 1, {"a": torch.ones(4)})
    again = ClientStateStore.open(path, num_clients=3, fields={"a": None}, create=True)
    assert torch.equal(again.read(2, 1)["a"], torch.ones(4))


def test_slot_protocol_survives_a_crash_after_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "cs.zarr"
    rng = random.Random(0)
    cs = ClientStates(init, num_clients=8, budget_bytes=0, path=path)
    for k in range(5):  # round 1
        cs.put(k, random_state(rng, k, 1))
    expect = {k: cs.get(k) for k in range(8)}
    cmap = through_checkpoint(cs.checkpoint_map())
    for r, k in [(2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (3, 6)]:  # rounds after the checkpoint
        cs.put(k, random_state(rng, k, r))
    assert not same(cs.get(0), expect[0])
    # a write torn by the crash: client 3's field chunk lands, its presence flag does not
    store = ClientStateStore.open(path, num_clients=8, fields={"a": None, "b": None, "c": None}, create=False)
    store._array("b", ((6,), torch.float64))[1 - cmap["clients"][3]["slot"], 3] = np.full(6, np.nan)
    del cs, store  # "kill -9"

    resumed = ClientStates(init, num_clients=8, budget_bytes=0, path=path)
    resumed.restore_map(cmap)
    assert resumed.mode == "disk"
    for k in range(8):
        assert same(resumed.get(k), expect[k]), k
    assert same(resumed.get(6), init(6))  # first written after the checkpoint: as never written
    # training on after the resume writes the other slot again, the checkpoint's slot stays intact
    resumed.put(0, random_state(rng, 0, 9))
    fresh = ClientStates(init, num_clients=8, budget_bytes=0, path=path)
    fresh.restore_map(cmap)
    assert same(fresh.get(0), expect[0])


def test_never_written_client_reads_init(tmp_path: Path) -> None:
    for budget in (None, 0):
        cs = ClientStates(init, num_clients=5, budget_bytes=budget, path=tmp_path / "cs.zarr")
        cs.put(1, State(a=torch.ones(4, 5)))
        for k in (0, 2, 4):
            assert same(cs.get(k), init(k))
        cs.restore_map(through_checkpoint(cs.checkpoint_map()))
        assert same(cs.get(3), init(3)) and same(cs.get(1), State(a=torch.ones(4, 5)))
        with pytest.raises(IndexError):
            cs.get(5)


def test_memory_mode_is_a_dict() -> None:
    cs = ClientStates(init, num_clients=3, budget_bytes=None, path=None)
    s = State(a=torch.randn(4, 5))
    cs[2] = s
    assert cs[2] is s and cs.mode == "memory"
    assert cs.checkpoint_map([2])["clients"][2]["state"]["a"] is s.a
    with pytest.raises(ValueError, match="path"):
        ClientStates(init, num_clients=3, budget_bytes=10, path=None)


def test_disk_and_memory_give_identical_states(tmp_path: Path) -> None:
    K = 12
    per_state = 4 * 20 + 8 * 6 + 8 * 3
    facades = {
        "memory": ClientStates(init, num_clients=K, budget_bytes=None, path=None),
        "disk": ClientStates(init, num_clients=K, budget_bytes=0, path=tmp_path / "d.zarr"),
        "spill": ClientStates(init, num_clients=K, budget_bytes=3 * per_state, path=tmp_path / "s.zarr"),
    }
    maps: dict[str, dict] = {}
    rng = random.Random(0)
    for step in range(150):
        op = rng.random()
        if op < 0.7:
            k = rng.randrange(K)
            state = random_state(random.Random(step), k, step)
            for f in facades.values():
                f.put(k, state)
        elif op < 0.85:
            chosen = None if rng.random() < 0.5 else range(K)
            maps = {n: through_checkpoint(f.checkpoint_map(chosen)) for n, f in facades.items()}
        elif maps:
            for n, f in facades.items():
                f.restore_map(maps[n])
        ref = facades["memory"]
        for k in range(K) if op >= 0.7 or step % 10 == 0 else [rng.randrange(K)]:
            for name in ("disk", "spill"):
                assert same(facades[name].get(k), ref.get(k)), (step, name, k)
    assert facades["disk"].mode == "disk" and facades["spill"].mode == "disk"


def test_crash_at_every_write_resumes_bit_identical(tmp_path: Path) -> None:
    """Crash after each write (with the next write torn), resume from the last checkpoint, finish."""
    K, rounds, every = 3, 5, 2

    def update(s: State, r: int, k: int) -> State:
        g = torch.Generator().manual_seed(10 * r + k)
        a = torch.randn(4, 5, generator=g) if s.a is None else s.a * 0.5 + torch.randn(4, 5, generator=g)
        return State(a=a, b=None if (r + k) % 3 else torch.full((6,), float(r), dtype=torch.float64), c=s.c)

    def run(cs: ClientStates, start: int, crash_at: int | None, ckpt: list) -> int:
        writes = 0
        for r in range(start, rounds):
            for k in range(K):
                if crash_at is not None and writes == crash_at:
                    store = cs._open_store(k)
                    slot = 0 if cs._ckpt[k] < 0 else 1 - int(cs._ckpt[k])
                    store._array("a", ((4, 5), torch.float32))[slot, k] = np.full((4, 5), np.nan, np.float32)
                    return -1  # killed mid-write
                cs.put(k, update(cs.get(k), r, k))
                writes += 1
            if (r + 1) % every == 0:
                ckpt[:] = [r + 1, through_checkpoint(cs.checkpoint_map())]
        return writes

    reference = ClientStates(init, num_clients=K, budget_bytes=None, path=None)
    total = run(reference, 0, None, [])
    for crash_at in range(total):
        path = tmp_path / f"run{crash_at}.zarr"
        ckpt: list = [0, None]
        assert run(ClientStates(init, num_clients=K, budget_bytes=0, path=path), 0, crash_at, ckpt) == -1
        resumed = ClientStates(init, num_clients=K, budget_bytes=0, path=path)
        if ckpt[1] is not None:
            resumed.restore_map(ckpt[1])
        run(resumed, ckpt[0], None, [])
        for k in range(K):
            assert same(resumed.get(k), reference.get(k)), (crash_at, k)


_CHILD = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from tests.test_client_states import State, init, kill_round
    from hpcfl.runner.client_states import ClientStates
    from hpcfl.files import atomic_torch_save
    run_dir = Path(sys.argv[1])
    cs = ClientStates(init, num_clients=16, budget_bytes=0, path=run_dir / "cs.zarr")
    kill_round(cs, run_dir, 0, 10**9, save=atomic_torch_save)
    """
)


def kill_round(cs: ClientStates, run_dir: Path, start: int, stop: int, save) -> None:  # noqa: ANN001
    """The rounds of the kill -9 test: every client every round, a checkpoint every 3 rounds."""
    for r in range(start, stop):
        for k in range(cs.num_clients):
            g = torch.Generator().manual_seed(r * 100 + k)
            s = cs.get(k)
            a = (
                torch.randn(2000, generator=g)
                if s.a is None
                else s.a.mul(0.9).add(torch.randn(2000, generator=g))
            )
            cs.put(k, State(a=a, b=None, c=s.c))
        if (r + 1) % 3 == 0:
            save(run_dir / "ckpt.pt", {"round": r + 1, "clients": cs.checkpoint_map()})


def test_kill_9_then_resume_is_bit_identical(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ckpt.pt").exists():
            assert child.poll() is None and time.monotonic() < deadline, "child died before a checkpoint"
            time.sleep(0.02)
        time.sleep(random.Random(os.getpid()).uniform(0.05, 0.4))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    stop = ckpt["round"] + 4
    resumed = ClientStates(init, num_clients=16, budget_bytes=0, path=tmp_path / "cs.zarr")
    resumed.restore_map(ckpt["clients"])
    kill_round(resumed, tmp_path, ckpt["round"], stop, save=lambda *a: None)
    reference = ClientStates(init, num_clients=16, budget_bytes=None, path=None)
    kill_round(reference, tmp_path, 0, stop, save=lambda *a: None)
    for k in range(16):
        assert same(resumed.get(k), reference.get(k)), k


def _held_bytes(obj: object, seen: set[int] | None = None) -> int:
    """Bytes of tensors and arrays reachable through an object's attributes, dicts, lists and sets."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, Tensor):
        return obj.nbytes
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_held_bytes(v, seen) for v in obj.values())
    if isinstance(obj, list | tuple | set):
        return sum(_held_bytes(v, seen) for v in obj)
    if isinstance(obj, ClientStates | ClientStateStore):
        return sum(_held_bytes(v, seen) for v in vars(obj).values())
    return 0


def test_disk_mode_never_holds_all_states(tmp_path: Path) -> None:
    K, P, window = 2000, 10_000, 200
    cs = ClientStates(lambda k: State(), num_clients=K, budget_bytes=0, path=tmp_path / "cs.zarr")
    for k in range(K):
        if k == K - window:  # numpy / zarr allocations over the last clients: a few in flight, not all
            tracemalloc.start()
        s = cs.get(k)
        cs.put(k, State(a=torch.full((P,), float(k)), b=s.b, c=s.c))
        if k % 500 == 0:
            assert _held_bytes(cs) < 4 * K + 4 * P, k  # the slot maps and field names, no states
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    t0 = time.perf_counter()
    cs.checkpoint_map()
    flush_s = time.perf_counter() - t0
    for k in range(0, K, 7):
        a = cs.get(k).a
        assert a.shape == (P,) and float(a[0]) == float(k) and float(a[-1]) == float(k)
    assert cs.mode == "disk" and not cs._mem
    assert _held_bytes(cs) < 4 * K + 4 * P
    assert peak < 10 * P * 4, peak  # K x P floats went through; at most a few clients' worth was live
    assert flush_s < 10, flush_s


def test_decide_and_budget() -> None:
    assert ClientStates.decide(100, 10, budget=1000) == "memory"
    assert ClientStates.decide(101, 10, budget=1000) == "disk"
    assert ClientStates.decide(1, 1, budget=0) == "disk"
    assert available_memory_bytes() > 0
    assert resolve_budget("auto") <= available_memory_bytes() // 4 + 1
    assert ClientStates.decide(10**15, 10**6) == "disk"
    for bad in ("lots", -1, 1.5, True):
        with pytest.raises(ConfigError):
            resolve_budget(bad)  # type: ignore[arg-type]


def test_flush_without_syncfs_fsyncs_each_written_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hpcfl.runner.client_states as mod

    synced: list[Path] = []
    real = mod._fsync
    monkeypatch.setattr(mod, "_syncfs", lambda path: False)
    monkeypatch.setattr(
        mod, "_fsync", lambda p, directory=False: (synced.append(p), real(p, directory=directory))
    )
    cs = ClientStates(init, num_clients=5, budget_bytes=0, path=tmp_path / "cs.zarr")
    for k in (1, 3):
        cs.put(k, State(a=torch.ones(4, 5), b=torch.zeros((), dtype=torch.float64), c=None))
    cs.checkpoint_map()
    files = {p for p in synced if p.is_file()}
    assert len(files) == 2 * 4  # per client: the presence chunk, the CRC-32 chunk, a and b
    assert {p.relative_to(tmp_path / "cs.zarr").parts[0] for p in files} == {
        "present",
        "crc32",
        "field_a",
        "field_b",
    }
    synced.clear()
    cs.checkpoint_map()
    assert not synced  # nothing written since
