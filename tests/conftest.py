"""Shared test set-up.

Triton kernels run under the interpreter when there is no GPU (TRITON_INTERPRET must be set
before triton is imported). Real datasets come from ``$HPCFL_DATA`` (CI points it at
``../shared/datasets``); tests that need them skip with a reason when it is unset.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers share the cores: OpenMP threads that spin while descheduled would slow both many
    # times over (tests/test_cpu_contention.py); decided before torch loads, never over a user's own
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:  # decide before anything imports triton
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

REPO = Path(__file__).resolve().parents[1]


def _example_plugin_on_path() -> None:
    """Put the example plugin (tests/plugin_example) on this process's path as if installed, so
    the registries list it and the contract suite covers it (subprocesses: helpers.plugin_env)."""
    import sys

    from tests.helpers import make_plugin_importable

    path = str(make_plugin_importable())
    if path not in sys.path:
        sys.path.append(path)
    from hpcfl.registry import ALGORITHMS, DATASET_SPECS, MODEL_SPECS

    for registry in (ALGORITHMS, MODEL_SPECS, DATASET_SPECS):
        registry.refresh()


_example_plugin_on_path()


def _default_data_root() -> Path | None:
    env = os.environ.get("HPCFL_DATA")
    if env:  # absolute now: tests change directory and symlink into the data (README runs it relative)
        return Path(os.path.abspath(Path(env).expanduser()))
    guess = REPO.parent / "shared" / "datasets"
    return guess if guess.is_dir() else None


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The directory holding the real datasets (MNIST, Fashion-MNIST, FEMNIST sample)."""
    root = _default_data_root()
    # the files, not the folder: a download that failed offline leaves its (empty) folder behind
    if root is None or not (root / "fashion-mnist" / "train-images-idx3-ubyte.gz").is_file():
        pytest.skip("real datasets not found: set HPCFL_DATA to the shared datasets directory")
    return root


@pytest.fixture(autouse=True)
def _no_other_work_on_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """What else runs on the machine is no test's business: a run in this process sees no other
    work on its cores (no oversubscription note that would depend on the load, no 0.3 s sample);
    tests/test_cpu_contention.py says how busy the cores are where it needs them busy."""
    import hpcfl.node

    monkeypatch.setattr(hpcfl.node, "busy_cores", lambda interval=0.3: None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``-n 2 --dist loadgroup``), every test on a real SLURM or the emulated
    nodes runs in one worker, in file order: they share one cluster per session and the host's
    namespaces, and mostly wait on SLURM and on deadlines, so the other worker trains beside them."""
    if not hasattr(config, "workerinput") and config.getoption("dist", "no") == "no":
        return
    for item in items:
        if item.get_closest_marker("slurm") or item.get_closest_marker("multinode"):
            item.add_marker(pytest.mark.xdist_group("cluster"))
