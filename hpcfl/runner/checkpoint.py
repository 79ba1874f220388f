"""Round checkpoints that a run resumes from bit for bit.

Layout: ``checkpoints/round_000010/{server.pt, clients/client_3.pt, ...}`` plus ``checkpoints/LATEST``
naming the newest complete one. Each rank writes the clients it owns into a temporary directory;
after a barrier rank 0 points LATEST at it and renames it into place, so a crash mid-write leaves
the previous checkpoint as the latest, and a crash between the two is rolled forward on resume.
Client files are per client, so a run can resume on another rank count. The files name no device
(:func:`hpcfl.files.atomic_torch_save` writes host copies and :func:`load_checkpoint` maps every
tensor to the loading rank's device), so a run resumes on another rank→GPU assignment or a CPU node.
"""

from __future__ import annotations

import shutil
import sys
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpcfl.comm.base import Communicator
from hpcfl.errors import RunDirError
from hpcfl.files import atomic_torch_save, atomic_write_text, read_torch
from hpcfl.runner.checkpoint_check import ExpectedStates, client_problem, head_problem, read_saved

KEEP = 2  # complete checkpoints kept on disk


@dataclass
class Checkpoint:
    """What a resumed run needs: the round count, the server state and its clients' states."""

    round: int
    server: dict[str, Any]
    clients: dict[int, dict[str, Any]]
    extra: dict[str, Any]


def placed_state(fresh: Any, data: Mapping[str, Any], device: torch.device | str | None = None) -> Any:
    """A state of ``type(fresh)`` from saved ``data`` (a dict of its fields), each tensor where this run keeps it.

    A field goes to the device of the same field of ``fresh``, a state as this run initialises it
    (so host bookkeeping such as DP's step counts stays on the host while the model vectors are on
    the rank's GPU); a field ``fresh`` leaves unset goes to ``device`` (the rank's), or stays where
    it was loaded when ``device`` is None (:func:`load_checkpoint` maps it to the rank's device).
    Where the file's tensors were written plays no part. A tensor already in place is kept, not copied.
    """
    placed = dict(data)
    for name, value in data.items():
        like = getattr(fresh, name, None)
        target = like.device if isinstance(like, torch.Tensor) else device
        if isinstance(value, torch.Tensor) and target is not None:
            placed[name] = value.to(target)
    return type(fresh)(**placed)


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
        _remove(tmp)  # a link planted here would take the checkpoint outside the run directory
        (tmp / "clients").mkdir(parents=True)
    comm.barrier()
    for k, state in clients.items():
        atomic_torch_save(tmp / "clients" / f"client_{k}.pt", state)
    if comm.rank == 0:
        atomic_torch_save(tmp / "server.pt", {"round": rnd, "server": server, "extra": extra or {}})
    comm.barrier()
    if comm.rank == 0:
        final = _round_dir(root, rnd)
        _remove(final)
        # LATEST first: a crash before the rename leaves it naming a complete .tmp, which
        # latest_round rolls forward (the other order left checkpoints without a LATEST)
        atomic_write_text(root / "LATEST", f"{final.name}\n")
        tmp.rename(final)
        for old in sorted(root.glob("round_*"))[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
    comm.barrier()


def _remove(path: Path) -> None:
    """Delete ``path``: a link or file itself (never what a link points to), a directory with its tree."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def _complete_rounds(root: Path) -> list[int]:
    """Rounds of the checkpoint directories present (renamed into place only once complete)."""
    rounds = []
    for d in root.glob("round_*"):
        try:
            rounds.append(int(d.name.split("_")[1]))
        except (IndexError, ValueError):
            continue
    return sorted(rounds)


def latest_round(root: Path) -> int | None:
    """The round of the newest complete checkpoint (as ``LATEST`` names it), or None."""
    marker = root / "LATEST"
    if not marker.exists():
        rounds = _complete_rounds(root)
        if rounds:  # checkpoints without LATEST: never silently start again from round 0
            newest = _round_dir(root, rounds[-1]).name
            raise RunDirError(
                f"{marker} is missing although {root} holds checkpoints, so the newest complete one "
                f"cannot be checked; if {newest} is it, restore it with: echo {newest} > {marker}"
            )
        return None
    name = marker.read_text().strip()
    try:
        rnd = int(name.split("_")[1])
    except (IndexError, ValueError):
        raise RunDirError(f"{marker} is damaged (it names {name!r}); rerun with --overwrite") from None
    staged = root / f".{name}.tmp"
    if (
        not (root / name / "server.pt").exists()
        and not staged.is_symlink()
        and (staged / "server.pt").exists()
    ):
        # LATEST is written after every rank's files are in place, so the staged copy is complete
        try:
            staged.rename(root / name)
        except OSError:
            pass  # another rank rolled it forward first
    if not (root / name / "server.pt").exists():
        raise RunDirError(f"checkpoint {root / name} named by {marker} is missing; rerun with --overwrite")
    return rnd


def _damage(d: Path, client_ids: list[int], expect: ExpectedStates | None = None) -> str | None:
    """What is wrong with the files of checkpoint ``d`` (every rank checks all, so all agree), or None.

    ``torch.save`` writes a zip whose records carry CRC-32s: a truncated, emptied or bit-flipped file
    fails ``testzip`` before any of it is trusted. An intact file that is not this run's (objects
    ``weights_only`` refuses, another layout, another algorithm's or model's states: ``expect``) is
    named with the mismatch (:mod:`hpcfl.runner.checkpoint_check`).
    """
    damage = _zip_damage(d, d / "server.pt")
    if damage is not None:
        return damage
    head, problem = read_saved(d / "server.pt")
    if problem is None:
        problem = head_problem(head, expect)
    if problem is not None:
        return f"{(d / 'server.pt').relative_to(d.parent)} is not this run's: {problem}"
    saved = head["extra"].get("clients")
    if saved is not None:  # only the clients that had a state were saved
        client_ids = sorted(set(client_ids) & set(saved))
    for path in [d / "clients" / f"client_{k}.pt" for k in client_ids]:
        damage = _zip_damage(d, path)
        if damage is not None:
            return damage
        if expect is not None:  # the client files' content: only where the runner says what it is
            state, problem = read_saved(path)
            if problem is None:
                problem = client_problem(state, head["extra"].get("stage"), expect)
            if problem is not None:
                return f"{path.relative_to(d.parent)} is not this run's: {problem}"
    return None


def _zip_damage(d: Path, path: Path) -> str | None:
    """What is wrong with one ``torch.save`` file of checkpoint ``d``, or None."""
    if not path.exists():
        return f"{path.relative_to(d.parent)} is missing"
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        return f"{path.relative_to(d.parent)} is damaged ({err.__class__.__name__})"
    if bad is not None:
        return f"{path.relative_to(d.parent)} is damaged (checksum mismatch in {bad})"
    return None


def load_checkpoint(
    root: Path,
    client_ids: list[int],
    *,
    device: torch.device | str,
    all_clients: list[int] | None = None,
    reset: Sequence[int] = (),
    expect: ExpectedStates | None = None,
) -> Checkpoint | None:
    """Load the newest sound checkpoint (server + the given clients), or None if there is none.

    Every tensor comes back on ``device``, the loading rank's (``Federation.device``), whatever
    device the files were written from: checkpoints are written from host copies and read with
    ``map_location``, so a run resumes on another rank→GPU assignment or on a CPU node.

    A damaged newest checkpoint (checked by :func:`_damage` over ``all_clients``, default
    ``client_ids``) falls back to the older complete one with a note on stderr; when none is sound
    the error names the damaged file and the fix. The files of the clients in ``reset``
    (``--reset-client-states``) are neither checked nor loaded: those clients start again.
    ``expect``: this run's states (:func:`~hpcfl.runner.checkpoint_check.expected_states`); a
    checkpoint of another run is then treated as a damaged one (its files' layout is always checked).
    """
    rnd = latest_round(root)
    if rnd is None:
        return None
    dropped = set(reset)
    client_ids = [k for k in client_ids if k not in dropped]
    checked = sorted(k for k in (all_clients if all_clients is not None else client_ids) if k not in dropped)
    candidates = [r for r in _complete_rounds(root) if r <= rnd][::-1] or [rnd]
    first_damage = None
    for r in candidates:
        d = _round_dir(root, r)
        damage = _damage(d, checked, expect)
        if damage is None:
            if (
                first_damage is not None
                and "client_map" in read_torch(d / "server.pt", device="cpu")["extra"]  # metadata
            ):
                raise RunDirError(
                    f"cannot resume: {first_damage}, and the older checkpoint {d.name} cannot be used because "
                    f"the client states on disk have moved on since; start over with --overwrite{_reset_hint(first_damage)}"
                )
            if first_damage is not None:
                print(
                    f"hpcfl: note: the newest checkpoint is damaged ({first_damage}); "
                    f"resuming from the older complete checkpoint {d.name}",
                    file=sys.stderr,
                )
            return _load(d, client_ids, device)
        first_damage = first_damage or damage
    raise RunDirError(
        f"cannot resume: {first_damage}, and no older complete checkpoint is sound; "
        f"start over with --overwrite{_reset_hint(first_damage)}"
    )


def _reset_hint(damage: str | None) -> str:
    """For a damaged client file: how to resume without that client's state."""
    name = Path((damage or "").split(" ")[0]).name
    if name.startswith("client_") and name.endswith(".pt"):
        return f", or resume with --reset-client-states {name[len('client_') : -len('.pt')]}"
    return ""


def _load(d: Path, client_ids: list[int], device: torch.device | str) -> Checkpoint:
    head = read_torch(d / "server.pt", device=device)
    saved = head["extra"].get("clients")  # ids whose state was saved (clients never trained have none)
    wanted = client_ids if saved is None else sorted(set(client_ids) & set(saved))
    clients = {k: read_torch(d / "clients" / f"client_{k}.pt", device=device) for k in wanted}
    return Checkpoint(round=head["round"], server=head["server"], clients=clients, extra=head["extra"])
