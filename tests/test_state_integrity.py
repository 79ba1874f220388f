"""Nothing silently wrong, part two (issue 26): a client-state store checked like the feature store.

A stopped SCAFFOLD run keeps its clients' control variates only in ``client_states_train.zarr``; a
deleted, truncated or bit-flipped chunk of either slot must stop the resume with one line naming
the client, the slot and the file, never be read as zeros, and ``--reset-client-states`` must let
the user go on without that client's state (recorded in metrics.jsonl).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from hpcfl.cli.main import main
from hpcfl.runner.client_states import ClientStateError, ClientStates
from tests.helpers import one_line_error, synthetic_config

CLIENT = 2  # the client whose chunk is damaged


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> dict[int, tuple[Path, Path]]:
    """Per slot s: (config, run dir) of a SCAFFOLD run with states on disk, stopped after s + 1
    rounds, so the newest checkpoint names slot s of every client (full participation)."""
    base = tmp_path_factory.mktemp("integrity")
    cfg = synthetic_config(base, rounds=3, client_state_memory="disk")
    out = {}
    for slot in (0, 1):
        run = base / f"slot{slot}"
        assert main(["run", str(cfg), "--run-dir", str(run), "--set", f"rounds={slot + 1}"]) == 0
        out[slot] = (cfg, run)
    return out


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest, symlinks=True)
    (dest / ".lock").unlink(missing_ok=True)
    return dest


def _losses(run: Path) -> list[tuple[float, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["test_loss"], r["local_loss"]) for r in rows]


def _chunk(run: Path, slot: int, field: str = "h") -> Path:
    return run / "client_states_train.zarr" / f"field_{field}" / "c" / str(slot) / str(CLIENT) / "0"


@pytest.mark.parametrize("slot", [0, 1])
@pytest.mark.parametrize("damage", ["delete", "truncate", "flip"])
def test_damaged_client_state_chunk_refuses_the_resume(stopped, tmp_path, capsys, slot, damage):
    cfg, src = stopped[slot]
    run = _copy(src, tmp_path / "run")
    chunk = _chunk(run, slot)
    if damage == "delete":
        chunk.unlink()
        problem = "is missing"
    elif damage == "truncate":
        size = chunk.stat().st_size
        os.truncate(chunk, size // 2)
        problem = f"has {size // 2} bytes, not {size}"
    else:
        raw = bytearray(chunk.read_bytes())
        raw[3] ^= 0x40  # the exponent byte of the first float32
        chunk.write_bytes(bytes(raw))
        problem = "fails its checksum"
    before = (run / "metrics.jsonl").read_text()
    err = one_line_error(capsys, ["run", str(cfg), "--run-dir", str(run), "--resume"])
    assert err == (
        f"hpcfl: error: client {CLIENT}'s state (slot {slot}) cannot be trusted: {chunk} {problem}; "
        f"resume with --reset-client-states {CLIENT} to re-initialise that client's state (or restore the file)"
    )
    assert (run / "metrics.jsonl").read_text() == before  # nothing trained on a damaged state


def test_deleted_presence_chunk_is_not_an_empty_state(stopped, tmp_path, capsys):
    """Without its presence flags a slot used to read as 'no fields': a fresh state, silently."""
    cfg, src = stopped[1]
    run = _copy(src, tmp_path / "run")
    flags = run / "client_states_train.zarr" / "present" / "c" / "1" / str(CLIENT) / "0"
    flags.unlink()
    err = one_line_error(capsys, ["run", str(cfg), "--run-dir", str(run), "--resume"])
    assert f"client {CLIENT}'s state (slot 1) cannot be trusted: {flags} is missing" in err


def test_every_damaged_client_is_named_at_once(stopped, tmp_path, capsys):
    cfg, src = stopped[0]
    run = _copy(src, tmp_path / "run")
    for chunk in sorted((run / "client_states_train.zarr" / "field_h" / "c" / "0").glob("*/0")):
        chunk.unlink()
    err = one_line_error(capsys, ["run", str(cfg), "--run-dir", str(run), "--resume"])
    assert err.startswith("hpcfl: error: 4 clients' stored states cannot be trusted (first: client 0's")
    assert err.endswith(
        "resume with --reset-client-states 0,1,2,3 to re-initialise them (or restore the files)"
    )


def test_reset_client_states_resumes_and_is_logged(stopped, tmp_path, capsys):
    cfg, src = stopped[1]
    run = _copy(src, tmp_path / "run")
    _chunk(run, 1).unlink()
    argv = ["run", str(cfg), "--run-dir", str(run), "--resume"]
    assert main([*argv, "--reset-client-states", str(CLIENT)]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert rows[2]["reset_client_states"] == [CLIENT]
    assert all("reset_client_states" not in r for r in rows[:2])
    # the same reset on an intact copy gives the same final state: the damaged slot was not read
    clean = _copy(src, tmp_path / "clean")
    assert main(["run", str(cfg), "--run-dir", str(clean), "--resume", "--reset-client-states", "2"]) == 0
    assert _losses(run) == _losses(clean)
    # and differs from a resume that keeps client 2's state (the reset really re-initialised it)
    kept = _copy(src, tmp_path / "kept")
    assert main(["run", str(cfg), "--run-dir", str(kept), "--resume"]) == 0
    assert (
        json.loads((kept / "metrics.jsonl").read_text().splitlines()[2])["test_loss"] != rows[2]["test_loss"]
    )


@pytest.mark.parametrize(
    ("value", "extra", "message"),
    [
        ("2,x", ["--resume"], "--reset-client-states takes client numbers separated by commas, got '2,x'"),
        ("7", ["--resume"], "--reset-client-states names clients outside 0..3: [7]"),
        ("2", [], "--reset-client-states applies to a resume; add --resume"),
    ],
)
def test_bad_reset_client_states_gives_one_line(stopped, tmp_path, capsys, value, extra, message):
    cfg, src = stopped[0]
    run = _copy(src, tmp_path / "run") if extra else tmp_path / "fresh"
    err = one_line_error(
        capsys, ["run", str(cfg), "--run-dir", str(run), *extra, "--reset-client-states", value]
    )
    assert err == f"hpcfl: error: {message}"


def test_memory_form_damaged_client_file_names_the_reset(tmp_path, capsys):
    """States in memory are checkpointed as one zip per client; when no older checkpoint is sound the
    error offers the reset of that client, and the reset resumes."""
    cfg = synthetic_config(tmp_path, rounds=3, client_state_memory="memory")
    run = tmp_path / "run"
    assert main(["run", str(cfg), "--run-dir", str(run), "--set", "rounds=2"]) == 0
    for d in (run / "checkpoints").glob("round_*"):
        (d / "clients" / f"client_{CLIENT}.pt").write_bytes(b"")
    err = one_line_error(capsys, ["run", str(cfg), "--run-dir", str(run), "--resume"])
    assert err.endswith(f"start over with --overwrite, or resume with --reset-client-states {CLIENT}")
    assert (
        main(["run", str(cfg), "--run-dir", str(run), "--resume", "--reset-client-states", str(CLIENT)]) == 0
    )
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["round"] == 3 and rows[-1]["reset_client_states"] == [CLIENT]


def test_nan_in_a_stored_state_is_not_blamed_on_the_learning_rate(tmp_path, capsys):
    """A state that holds NaN (here a memory-form checkpoint file rewritten as a valid zip) makes the
    client's loss NaN: the message names the state and the reset, not the learning rate."""
    cfg = synthetic_config(tmp_path, rounds=3, client_state_memory="memory")
    run = tmp_path / "run"
    assert main(["run", str(cfg), "--run-dir", str(run), "--set", "rounds=2"]) == 0
    path = run / "checkpoints" / "round_000002" / "clients" / f"client_{CLIENT}.pt"
    state = torch.load(path, weights_only=True)
    state["h"] = torch.full_like(state["h"], float("nan"))
    torch.save(state, path)
    err = one_line_error(capsys, ["run", str(cfg), "--run-dir", str(run), "--resume"])
    assert f"on client {CLIENT}, whose stored state already held NaN/inf when it was read" in err
    assert f"not the learning rate; resume with --reset-client-states {CLIENT}" in err


def test_resume_in_memory_of_a_disk_checkpoint_keeps_the_states(stopped, tmp_path, capsys):
    """client_state_memory is resumable: a run checkpointed with its states on disk, resumed with
    ``memory``, used to start every client's state from zero without a word. It resumes from the
    store and ends as the uninterrupted run does."""
    cfg, src = stopped[1]
    ref = tmp_path / "ref"
    assert main(["run", str(cfg), "--run-dir", str(ref)]) == 0
    run = _copy(src, tmp_path / "run")
    assert (
        main(["run", str(cfg), "--run-dir", str(run), "--resume", "--set", "client_state_memory=memory"]) == 0
    )
    assert _losses(run) == _losses(ref)


# the store on its own: damage found mid-run, and stores of version 1 (no CRCs) still read


@dataclasses.dataclass
class _State:
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None


def _states(path: Path) -> ClientStates:
    return ClientStates(lambda k: _State(), num_clients=3, budget_bytes=0, path=path)


def test_a_chunk_damaged_during_the_run_is_named_on_its_next_read(tmp_path):
    cs = _states(tmp_path / "cs.zarr")
    cs.put(1, _State(a=torch.arange(6.0), b=None))
    chunk = tmp_path / "cs.zarr" / "field_a" / "c" / "0" / "1" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[-1] ^= 0x01
    chunk.write_bytes(bytes(raw))
    with pytest.raises(
        ClientStateError, match=r"client 1's state \(slot 0\) cannot be trusted: .* fails its checksum"
    ):
        cs.get(1)
    # another rank's write is checked against the CRCs stored beside it
    other = _states(tmp_path / "cs.zarr")
    other.written_elsewhere(1)
    other._disk = True  # noqa: SLF001 - the other rank is in store mode too
    other._live[1] = 0  # noqa: SLF001
    with pytest.raises(ClientStateError, match="fails its checksum"):
        other.get(1)


def test_version_1_store_and_checkpoint_still_resume(tmp_path):
    cs = _states(tmp_path / "cs.zarr")
    state = _State(a=torch.arange(6.0), b=torch.ones(2, dtype=torch.float64))
    cs.put(2, state)
    cmap = cs.checkpoint_map()
    shutil.rmtree(tmp_path / "cs.zarr" / "crc32")  # a store written before the checksums
    for entry in cmap["clients"].values():
        entry.pop("crc32")
    fresh = _states(tmp_path / "cs.zarr")
    fresh.restore_map(cmap)
    got = fresh.get(2)
    assert torch.equal(got.a, state.a) and torch.equal(got.b, state.b)


def test_state_size_is_taken_from_the_state_not_the_upload(tmp_path):
    """A budget that holds one model-sized vector per client but not two keeps FedDyn's one-field
    states in memory and puts SCAFFOLD's two-field states on disk (the upload-based guess counted
    two vectors for every algorithm)."""
    cfg = synthetic_config(tmp_path, rounds=1, client_state_memory="disk")
    probe = tmp_path / "probe"
    assert main(["run", str(cfg), "--run-dir", str(probe)]) == 0
    vector = (probe / "client_states_train.zarr" / "field_h" / "c" / "0" / "0" / "0").stat().st_size
    budget = str(4 * vector * 3 // 2)  # 4 clients × 1.5 vectors
    for algorithm, on_disk in (("feddyn", False), ("scaffold", True)):
        run = tmp_path / algorithm
        argv = ["run", str(cfg), "--run-dir", str(run), "--set", f"algorithm={algorithm}"]
        assert main([*argv, f"client_state_memory={budget}"]) == 0
        assert (run / "client_states_train.zarr").exists() == on_disk, algorithm


@pytest.mark.mpi
@pytest.mark.slow
def test_damaged_state_under_mpi_gives_one_line_and_the_reset_resumes(tmp_path):
    """Partial participation on 2 ranks (states in the store, any rank trains any client): every
    rank checks the checkpoint's records, so all refuse alike, with one line; the reset resumes."""
    import subprocess

    from tests.conftest import REPO
    from tests.helpers import mpiexec_cmd

    cfg = synthetic_config(
        tmp_path,
        num_clients=6,
        clients_per_round=3,
        rounds=3,
        dataset_options={"n_train": 600, "n_test": 100, "seed": 3},
    )
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def mpi(*args: str) -> subprocess.CompletedProcess:
        argv = mpiexec_cmd(2, "run", str(cfg), "--run-dir", str(run), *args)
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)

    assert mpi("--set", "rounds=2").returncode == 0
    latest = max((run / "client_states_train.zarr" / "field_h" / "c").glob("*/*/0"))
    slot, client = int(latest.parts[-3]), int(latest.parts[-2])
    latest.unlink()  # some client's chunk; it may or may not be one the checkpoint names
    import torch as _torch

    cmap = _torch.load(sorted((run / "checkpoints").glob("round_*"))[-1] / "server.pt", weights_only=True)
    named = cmap["extra"]["client_map"]["clients"].get(client, {}).get("slot") == slot
    proc = mpi("--resume")
    if named:
        # every rank finds the same damage; rank 0 reports it (another rank may too, with the same
        # line, when the abort is slower than its grace period on a loaded node)
        causes = {ln.split(": ", 3)[-1] for ln in proc.stderr.splitlines() if ln.startswith("hpcfl: error:")}
        assert proc.returncode != 0 and len(causes) == 1, proc.stderr
        assert causes.pop().startswith(
            f"client {client}'s state (slot {slot}) cannot be trusted: {latest} is missing"
        )
        assert "Traceback" not in proc.stderr
        proc = mpi("--resume", "--reset-client-states", str(client))
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["round"] == 3
