"""What a run's bit-identity depends on, recorded beside its config (``determinism.json``).

hpcfl's results are a pure function of the config *and* of a few settings of the machine the
config does not fix: the torch threads each rank used (a CPU kernel's reduction order follows its
thread count, so 1 process with 2 threads and 2 ranks with 1 thread each differ in the last bits),
the ``reduction`` (with ``float32`` the round's sum also depends on the rank count), ``client_batch``
(the vectorised step rounds differently from the one-by-one loop), ``client_threads`` (a client then
trains on ``threads // client_threads`` torch threads), the device, and the eNTK path's
settings (``entk:``, each overridden by its environment variable, :mod:`hpcfl.entk.settings`): the
cost constants ``entk.costs`` / ``$HPCFL_ENTK_COSTS`` names (they choose each layer's form of TCT's
features), CUDA-graph replay and Triton autotuning, recorded with their sources and the eNTK method
the algorithm uses. ``threads`` is
resumable and may be left unset (then it is the node's cores shared by its ranks), so the config
alone cannot tell whether two runs should agree: every run writes what it actually used here, a
resume that uses something else says so in one note, and ``hpcfl report`` of runs with the same
config names the settings in which they differ.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcfl.files import atomic_write_text, read_yaml

if TYPE_CHECKING:  # `hpcfl report` reads records: no torch, no config (which imports every algorithm)
    from hpcfl.comm.base import Communicator
    from hpcfl.config import Config
    from hpcfl.entk.settings import EntkSettings

RECORD = "determinism.json"


def collect(
    cfg: Config,
    comm: Communicator,
    *,
    client_batch_used: int | None = None,
    device: str | None = None,
    entk: EntkSettings | None = None,
) -> dict[str, Any]:
    """This run's record (collective: every rank reports its thread count, host, node-local rank
    and device). ``client_batch_used``: the group size the setting resolved to (``auto`` chooses by
    device and memory); ``device``: the one this rank resolved ``device`` to; ``entk``: the eNTK
    settings the run holds in force (default: :func:`entk_settings` of ``cfg``). ``entk_costs``
    (the fitted constants) is recorded whenever a costs file is in force, the ``entk`` entry (every
    effective setting, its source, the method and whether the native CPU kernel ran,
    :func:`hpcfl.entk.native.status`) when the algorithm computes eNTK features or Jacobians.

    ``ranks`` (host, node-local rank, device per rank, and the GPUs SLURM made visible to it) is
    where a run says how it was laid over nodes; results never depend on it, so
    :func:`differences` ignores it."""
    import os
    import socket

    import torch

    from hpcfl.comm.deadline import CommDeadline

    where = {"host": socket.gethostname(), "local_rank": int(comm.local_rank), "device": device or cfg.device}
    if where["device"].startswith("cuda") and "CUDA_VISIBLE_DEVICES" in os.environ:
        where["cuda_visible_devices"] = os.environ["CUDA_VISIBLE_DEVICES"]  # the GPU SLURM bound
    every = comm.allgather((int(torch.get_num_threads()), where))
    # the deadline the communicator's collectives hold (resolved once, when it was made)
    deadline = getattr(comm, "deadline", None)
    if not isinstance(deadline, CommDeadline):  # a communicator of the caller's own
        deadline = CommDeadline.resolve(cfg.comm_timeout)
    record: dict[str, Any] = {
        "threads_per_rank": [t for t, _ in every],
        "ranks": [w for _, w in every],
        "reduction": cfg.reduction,
        "client_batch": str(cfg.client_batch),
        "client_threads": int(cfg.client_threads),
        "device": cfg.device,
    }
    # not a bit-identity setting: the collective deadline (hpcfl.comm.deadline), who set it, its bound
    record.update(deadline.record())
    if client_batch_used is not None:
        record["client_batch_used"] = int(client_batch_used)
    from hpcfl.entk import settings as entk_settings_module
    from hpcfl.entk.costs import fitted_record

    entk = entk if entk is not None else entk_settings(cfg)  # a bad file or flag: one line before any work
    with entk_settings_module.applied(entk):
        costs = fitted_record()
    if costs is not None:
        record["entk_costs"] = costs
    if entk.method is not None:
        from hpcfl.entk import native

        # only a CPU run builds and uses the kernel
        kernel = native.status(entk) if where["device"].startswith("cpu") else "off: not a CPU run"
        record["entk"] = {**entk_settings_module.record(entk), "native_kernel": kernel}
    return record


def entk_settings(cfg: Config) -> EntkSettings:
    """The eNTK settings a run of ``cfg`` uses: its ``entk:`` section with the environment's
    overrides, and the method its algorithm's params choose (:mod:`hpcfl.entk.settings`)."""
    from hpcfl.entk.settings import resolve

    return resolve(cfg.entk, method=cfg.params.entk_method())


def read_record(run_dir: Path) -> dict[str, Any] | None:
    """The record of a run directory, or None (runs of older versions have none)."""
    try:
        data = json.loads((Path(run_dir) / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_record(run_dir: Path, record: dict[str, Any]) -> None:
    """Write the record (rank 0), atomically."""
    atomic_write_text(Path(run_dir) / RECORD, json.dumps(record, sort_keys=True) + "\n")


def _threads(record: dict[str, Any]) -> str:
    per_rank = list(record.get("threads_per_rank", []))
    ranks = len(per_rank)
    if per_rank and len(set(per_rank)) == 1:
        return f"{per_rank[0]} thread(s) per rank on {ranks} rank(s)"
    return f"threads {per_rank} on {ranks} ranks"


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The settings in which two records differ so that their results need not be bit-identical,
    each as "<setting> <a> vs <b>". The rank count alone matters only with ``reduction: float32``."""
    out = []
    ta, tb = list(a.get("threads_per_rank", [])), list(b.get("threads_per_rank", []))
    float32 = "float32" in (a.get("reduction"), b.get("reduction"))
    if set(ta) != set(tb) or (float32 and len(ta) != len(tb)):
        out.append(f"threads {_threads(a)} vs {_threads(b)}")
    if a.get("client_threads", 1) != b.get("client_threads", 1) and _per_client(a) != _per_client(b):
        out.append(f"client_threads {a.get('client_threads', 1)} vs {b.get('client_threads', 1)}")
    for key in ("reduction", "client_batch", "device"):
        if key == "client_batch" and {"client_batch_used"} <= a.keys() & b.keys():
            if a["client_batch_used"] != b["client_batch_used"]:  # auto and 1 on a CPU are the same
                out.append(f"client_batch {_client_batch(a)} vs {_client_batch(b)}")
        elif a.get(key) != b.get(key):
            out.append(f"{key} {a.get(key)} vs {b.get(key)}")
    ca, cb = a.get("entk_costs"), b.get("entk_costs")
    if (ca or {}).get("fitted") != (cb or {}).get("fitted"):
        out.append(f"HPCFL_ENTK_COSTS {_costs(ca)} vs {_costs(cb)}")
    ea, eb = a.get("entk"), b.get("entk")
    if ea and eb and bool(ea.get("triton_autotune")) != bool(eb.get("triton_autotune")):
        # a tile size sets a conv gather's reduction order (CUDA graphs replay the same kernels)
        out.append(f"entk.triton_autotune {ea.get('triton_autotune')} vs {eb.get('triton_autotune')}")
    return out


def _per_client(record: dict[str, Any]) -> set[int]:
    """The torch threads a client's kernels ran on: each rank's threads shared by ``client_threads``."""
    share = int(record.get("client_threads", 1))
    return {max(1, int(t) // share) for t in record.get("threads_per_rank", [])}


def _costs(record: dict[str, Any] | None) -> str:
    return "unset" if not record else str(record.get("file"))


def _client_batch(record: dict[str, Any]) -> str:
    """``client_batch`` as set, with the group size it chose where that is not the setting itself."""
    setting, used = str(record.get("client_batch")), record.get("client_batch_used")
    return setting if used is None or setting == str(used) else f"{setting} ({used})"


def resume_note(run_dir: Path, now: dict[str, Any]) -> str | None:
    """The note a resume prints when it runs with other bit-identity settings than the run began
    with (None when they match or the run has no record)."""
    before = read_record(run_dir)
    if before is None:
        return None
    diffs = differences(now, before)
    if not diffs:
        return None
    return (
        f"hpcfl: note: resuming {run_dir} with other settings than it began with "
        f"({'; '.join(d.replace(' vs ', ', the run began with ', 1) for d in diffs)}): results stay "
        "valid but are not bit-identical to an uninterrupted run"
    )


def comparison_notes(run_dirs: list[Path]) -> list[str]:
    """For runs whose configs agree (resumable keys aside), one note per pair whose records differ:
    the runs should agree bit for bit only when these settings match."""
    runs = []
    for d in run_dirs:
        record = read_record(d)
        if record is not None and (Path(d) / "config.yaml").exists():
            cfg = read_yaml(Path(d) / "config.yaml")
            cfg.pop("name", None)
            runs.append((Path(d), cfg, record))
    notes: list[str] = []
    if len(runs) < 2:
        return notes
    from hpcfl.config import config_differences  # imports torch: only when there is a pair to compare

    for i, (da, ca, ra) in enumerate(runs):
        for db, cb, rb in runs[i + 1 :]:
            if config_differences(ca, cb):
                continue
            diffs = differences(ra, rb)
            if diffs:
                notes.append(
                    f"hpcfl: note: {da} and {db} share a config but ran with {'; '.join(diffs)}: "
                    "they are not expected to be bit-identical (docs/determinism.md)"
                )
    return notes
