"""Small helpers shared by tests: running the CLI in-process or as a real subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
#: the MPICH launcher beside this Python (the venv's mpich wheel), else the first on PATH (a GPU
#: image whose Python is not a venv of ours gets the wheel's bin/ on PATH)
MPIEXEC = (
    str(VENV_BIN / "mpiexec") if (VENV_BIN / "mpiexec").exists() else shutil.which("mpiexec") or "mpiexec"
)


def repo_env(**extra: str) -> dict[str, str]:
    """This process's environment with the checkout PREPENDED to ``PYTHONPATH`` (a dependency that
    came through ``PYTHONPATH``, as on the GPU image's /tmp/site, stays importable in the child)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def write_config(path: Path, **keys) -> Path:
    """Write a YAML config with the given keys."""
    path.write_text(yaml.safe_dump(keys, sort_keys=False))
    return path


def synthetic_config(tmp_path: Path, **overrides) -> Path:
    """A fast config: synthetic 1x28x28 data, the MLP, 4 non-IID clients."""
    keys = dict(
        name="synth",
        dataset="synthetic",
        dataset_options={"n_train": 2000, "n_test": 400, "seed": 3},
        partition="dir:0.5",
        num_clients=4,
        model="mlp",
        algorithm="scaffold",
        rounds=4,
        local_epochs=1,
        lr=0.05,
        momentum=0.5,
        batch_size=50,
        seed=7,
        threads=1,
        progress=False,
    )
    keys.update(overrides)
    return write_config(tmp_path / "cfg.yaml", **keys)


def hpcfl_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpcfl", *args]


def run_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python -m hpcfl ARGS`` as a user would, capturing output."""
    full_env = repo_env(**(env or {}))
    return subprocess.run(hpcfl_cmd(*args), capture_output=True, text=True, env=full_env, timeout=timeout)


def mpiexec_cmd(n: int, *args: str) -> list[str]:
    """``mpiexec -n N python -m hpcfl ARGS`` with the venv's MPICH launcher."""
    return [MPIEXEC, "-n", str(n), *hpcfl_cmd(*args)]


def run_mpi_program(name: str, ranks: int = 2, timeout: float = 120) -> str:
    """Run ``tests/mpi_programs/NAME`` on ``ranks`` MPI ranks; asserts every rank printed OK and
    returns its stdout."""
    proc = subprocess.run(
        [
            MPIEXEC,
            "-n",
            str(ranks),
            sys.executable,
            str(REPO / "tests/mpi_programs" / name),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=repo_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("OK") == ranks, proc.stdout
    return proc.stdout


def final_state(run_dir: Path) -> torch.Tensor:
    """The server state vector of the newest checkpoint of a run."""
    ckpt = run_dir / "checkpoints"
    latest = (ckpt / "LATEST").read_text().strip()
    return torch.load(ckpt / latest / "server.pt", weights_only=True)["server"]["x"]


def client_ctx(trainer, generator=None, *, rnd: int = 0):
    """A :class:`ClientContext` for calling ``client_update`` directly in a unit test."""
    from hpcfl.algorithms.base import ClientContext
    from hpcfl.algorithms.participation import Population

    return ClientContext(rnd, (0,), Population((1,)), trainer, generator or torch.Generator())


def simulate(
    algo,
    clients,
    trainer,
    rounds: int,
    *,
    server=None,
    states=None,
    comm=None,
    seed: int = 0,
    reduction: str = "float32",
    hook=None,
    drift=None,
):
    """Run ``rounds`` rounds of ``algo`` over in-memory ``clients`` (a list of ClientData) through
    the real round loop (:func:`hpcfl.runner.rounds.run_rounds`), on one process by default.

    Returns ``(server, states)``; client k's generator is ``torch.Generator()`` (seed 0) unless the
    algorithm's steps are deterministic anyway.
    """
    from hpcfl.algorithms import RoundPlan
    from hpcfl.algorithms.participation import Population
    from hpcfl.comm import LocalComm
    from hpcfl.runner.observers import Drift
    from hpcfl.runner.rounds import MemoryStates, run_rounds

    by_id = {c.k: c for c in clients}
    server = server if server is not None else algo.init_server(trainer.flat.vector if trainer else None)
    states = states if states is not None else MemoryStates(lambda k: algo.init_client(k, server))
    plan = RoundPlan(
        algorithm=algo,
        comm=comm or LocalComm(),
        data=by_id.__getitem__,
        trainer=trainer,
        population=Population(tuple(by_id[k].n for k in sorted(by_id))),
        generator=lambda rnd, k: torch.Generator(),
        evaluate=lambda s, joint: {},
        seed=seed,
        reduction=reduction,
        eval_every=10**9,
        observers=(Drift(drift, algo.num_params),) if drift is not None else (),
    )
    server, _ = run_rounds(plan, server, states, 0, rounds, hook=hook)
    return server, states


def server_step(algo, server, total, weight: float):
    """``algo.server_update`` on a hand-summed model upload (unit tests of the server step)."""
    from hpcfl.algorithms.base import Aggregate, ServerContext
    from hpcfl.algorithms.participation import Population

    ctx = ServerContext(0, (0,), Population((1,)), lambda t: t)
    return algo.server_update(server, Aggregate({"x": total}, weight, 1), ctx)[0]


def tiny_tct_config(tmp_path: Path, **stage2) -> Path:
    """A TCT run of seconds: synthetic data, 5 clients, 1 stage-1 round, p = 300, 2 stage-2 rounds."""
    return synthetic_config(
        tmp_path,
        algorithm="tct",
        partition="classes:2",
        num_clients=5,
        stage1={"rounds": 1},
        stage2={"p": 300, "rounds": 2, "local_steps": 20, "auto_lr": True, **stage2},
    )


def kill_after_rows(cfg: Path, run: Path, rows: int, timeout: float = 240) -> None:
    """Start ``hpcfl run CFG --run-dir RUN`` and SIGKILL it once metrics.jsonl holds ``rows`` rows;
    asserts it had not finished by then."""
    import signal
    import time

    proc = subprocess.Popen(hpcfl_cmd("run", str(cfg), "--run-dir", str(run)), env=repo_env())
    deadline = time.time() + timeout
    metrics = run / "metrics.jsonl"
    while time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= rows:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run / "DONE").exists(), "the run finished before it could be killed"


#: the example plugin distribution kept with the tests (tests/plugin_example/pyproject.toml)
PLUGIN_DIR = REPO / "tests" / "plugin_example"


def make_plugin_importable() -> Path:
    """Make the example plugin importable as an installed distribution without installing it:
    write its ``.dist-info`` (METADATA and the entry points of its pyproject.toml) beside its
    package, so that putting :data:`PLUGIN_DIR` on the path makes both the package and its entry
    points visible to ``importlib.metadata``. Returns the directory to put on the path."""
    import tomllib

    project = tomllib.loads((PLUGIN_DIR / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    lines = []
    for group, entries in project["entry-points"].items():
        lines += [f"[{group}]", *(f"{key} = {value}" for key, value in entries.items()), ""]
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        "entry_points.txt": "\n".join(lines),
    }
    info = PLUGIN_DIR / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    for file, text in files.items():
        path = info / file
        if not path.exists() or path.read_text() != text:
            tmp = path.with_name(f".{file}.{os.getpid()}")
            tmp.write_text(text)
            os.replace(tmp, path)
    return PLUGIN_DIR


def plugin_env(*extra: Path) -> dict[str, str]:
    """The environment of a subprocess that sees this checkout's hpcfl, the example plugin and
    ``extra`` directories (e.g. a broken plugin's)."""
    path = os.pathsep.join(str(p) for p in (REPO, make_plugin_importable(), *extra))
    return {**os.environ, "PYTHONPATH": path}


def one_line_error(capsys, argv: list[str], code: int | None = None) -> str:
    """Run ``hpcfl ARGV`` in this process; assert it failed (with exit status ``code`` where given)
    with one error line and no traceback, and return that line."""
    from hpcfl.cli.main import main

    rc = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc != 0 if code is None else rc == code, err
    assert lines and lines[-1].startswith("hpcfl: error:") and "Traceback" not in err, err
    assert len([ln for ln in lines if ln.startswith("hpcfl: error:")]) == 1, err
    return lines[-1]


def local_sgd(flat, x, y, schedule, generator, *, loss_fn=None, correction=None):
    """A client's plain local SGD in place, read at once: :func:`hpcfl.training.sgd.descend` along
    its :class:`~hpcfl.training.sgd.LocalSteps` (the reference the batched and DP paths are held to;
    the package's own entry point is :class:`hpcfl.algorithms.Trainer`)."""
    from hpcfl.training.sgd import LocalSteps, cross_entropy_loss, descend, read_result

    steps = LocalSteps(flat, x, y, schedule, generator, loss_fn or cross_entropy_loss)
    return read_result(*descend(flat, steps, correction))


def dp_local_sgd(flat, x, y, schedule, generator, *, clip, noise_multiplier, loss_fn=None, correction=None):
    """:func:`local_sgd` with DP-SGD's steps (:class:`hpcfl.privacy.sgd.DPSteps`: Poisson batches,
    clipped and noised gradients)."""
    from hpcfl.privacy.sgd import DPSteps
    from hpcfl.training.sgd import cross_entropy_loss, descend, read_result

    steps = DPSteps(
        flat,
        x,
        y,
        schedule,
        generator,
        loss_fn or cross_entropy_loss,
        clip=clip,
        noise_multiplier=noise_multiplier,
    )
    return read_result(*descend(flat, steps, correction))


def stop_after_rows(run_dir: Path, rows: int):
    """A :class:`hpcfl.runner.StopRequest` raised once the run has written ``rows`` metrics rows (as
    a signal arriving during that round would be)."""
    from hpcfl.runner import StopRequest

    class StopAfterRows(StopRequest):
        def __init__(self) -> None:
            super().__init__()
            self._metrics = run_dir / "metrics.jsonl"

        @property  # type: ignore[override]
        def requested(self) -> bool:
            return self._metrics.exists() and len(self._metrics.read_text().splitlines()) >= rows

        @requested.setter
        def requested(self, value: bool) -> None:
            pass

    return StopAfterRows()
