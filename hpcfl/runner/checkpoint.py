"""Round checkpoints that a run resumes from bit for bit.

Layout: ``checkpoints/round_000010/{server.pt, clients/client_3.pt, ...}`` plus ``checkpoints/LATEST``
naming the newest complete one. Each rank writes the clients it owns into a temporary directory;
rank 0 renames it and updates LATEST only after a barrier, so a crash mid-write leaves the previous
checkpoint as the latest. Client files are per client, so a run can resume on another rank count.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpcfl.comm.base import Communicator
from hpcfl.errors import RunDirError
from hpcfl.files import atomic_torch_save, atomic_write_text

KEEP = 2  # complete checkpoints kept on disk


@dataclass
class Checkpoint:
    """What a resumed run needs: the round count, the server state and its clients' states."""

    round: int
    server: dict[str, Any]
    clients: dict[int, dict[str, Any]]
    extra: dict[str, Any]


def _round_dir(root: Path, rnd: int) -> Path:
    return root / f"round_{rnd:06d}"


def save_checkpoint(
    root: Path,
    rnd: int,
    server: dict[str, Any],
    clients: dict[int, dict[str, Any]],
    comm: Communicator,
    extra: dict[str, Any] | None = None,
) -> None:
    """Collectively write the checkpoint after ``rnd`` completed rounds."""
    tmp = root / f".round_{rnd:06d}.tmp"
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "clients").mkdir(parents=True)
    comm.barrier()
    for k, state in clients.items():
        atomic_torch_save(tmp / "clients" / f"client_{k}.pt", state)
    if comm.rank == 0:
        atomic_torch_save(tmp / "server.pt", {"round": rnd, "server": server, "extra": extra or {}})
    comm.barrier()
    if comm.rank == 0:
        final = _round_dir(root, rnd)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        atomic_write_text(root / "LATEST", f"{final.name}\n")
        for old in sorted(root.glob("round_*"))[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
    comm.barrier()


def latest_round(root: Path) -> int | None:
    """The round of the newest complete checkpoint, or None."""
    marker = root / "LATEST"
    if not marker.exists():
        return None
    name = marker.read_text().strip()
    if not (root / name / "server.pt").exists():
        raise RunDirError(f"checkpoint {root / name} named by {marker} is missing; rerun with --overwrite")
    return int(name.split("_")[1])


def load_checkpoint(root: Path, client_ids: list[int]) -> Checkpoint | None:
    """Load the newest complete checkpoint (server + the given clients), or None if there is none."""
    rnd = latest_round(root)
    if rnd is None:
        return None
    d = _round_dir(root, rnd)
    head = torch.load(d / "server.pt", weights_only=True)
    clients = {}
    for k in client_ids:
        path = d / "clients" / f"client_{k}.pt"
        if not path.exists():
            raise RunDirError(f"checkpoint {d} has no state for client {k}; it belongs to another run")
        clients[k] = torch.load(path, weights_only=True)
    return Checkpoint(round=head["round"], server=head["server"], clients=clients, extra=head["extra"])
