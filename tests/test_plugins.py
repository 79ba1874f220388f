"""Extension from outside: the example plugin (tests/plugin_example) through every command, the
``imports:`` config key, ``hpcfl.register_*``, and one line for a broken or clashing plugin."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hpcfl
from hpcfl.config import config_from_dict
from hpcfl.errors import ConfigError
from hpcfl.registry import ALGORITHMS, MODEL_SPECS
from tests.helpers import hpcfl_cmd, mpiexec_cmd, plugin_env, write_config

#: a run made only of the plugin's names (algorithm, model, dataset)
PLUGIN_RUN = dict(
    name="plugin",
    dataset="example_blobs",
    dataset_options={"n_train": 240, "n_test": 80, "seed": 1},
    partition="dir:0.5",
    num_clients=4,
    model="example_linear",
    algorithm="example_slr",
    params={"server_lr": 0.5},
    rounds=3,
    local_steps=5,
    lr=0.1,
    batch_size=16,
    seed=2,
    threads=1,
    progress=False,
)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _accuracies(run_dir: Path) -> list[float]:
    return [r["test_accuracy"] for r in _rows(run_dir) if "test_accuracy" in r]


def _run(argv: list[str], cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, env=env or plugin_env(), cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The plugin run in this process, through ``hpcfl.run_experiment``: every command must match."""
    run_dir = tmp_path_factory.mktemp("plugin_ref") / "run"
    hpcfl.run_experiment(config_from_dict(dict(PLUGIN_RUN)), run_dir)
    accuracies = _accuracies(run_dir)
    assert len(accuracies) == 3 and accuracies[-1] > 0.5  # 4 separable blobs: well above chance 0.25
    return accuracies


def test_plugin_names_are_listed_and_loaded_from_their_entry_points() -> None:
    assert "example_slr" in list(ALGORITHMS) and ALGORITHMS["example_slr"].name == "example_slr"
    assert ALGORITHMS["example_slr"].__module__ == "hpcfl_example.algorithm"
    model = hpcfl.build_model("example_linear", (1, 4, 4), 4)
    assert model(torch.zeros(2, 1, 4, 4)).shape == (2, 4)
    data = hpcfl.load_dataset("example_blobs", n_train=10, n_test=5)
    assert (len(data.train), len(data.test), data.num_classes) == (10, 5, 4)


def test_hpcfl_run_matches_run_experiment(tmp_path: Path, reference: list[float]) -> None:
    cfg = write_config(tmp_path / "plugin.yaml", **PLUGIN_RUN)
    proc = _run(hpcfl_cmd("run", str(cfg), "--run-dir", str(tmp_path / "run")))
    assert proc.returncode == 0, proc.stderr
    assert _accuracies(tmp_path / "run") == reference


def test_hpcfl_sweep_with_two_workers_runs_plugin_points(tmp_path: Path, reference: list[float]) -> None:
    cfg = write_config(tmp_path / "plugin.yaml", **PLUGIN_RUN)
    out = tmp_path / "sweep"
    proc = _run(
        hpcfl_cmd("sweep", str(cfg), "--out", str(out), "--grid", "params.server_lr=0.5,1.0", "-j", "2")
    )
    assert proc.returncode == 0, proc.stderr
    points = sorted(p.name for p in (out / "runs").iterdir())
    assert len(points) == 2, points
    half = next(p for p in points if "0.5" in p)
    assert _accuracies(out / "runs" / half) == reference


@pytest.mark.mpi
def test_mpiexec_two_ranks_matches_one(tmp_path: Path, reference: list[float]) -> None:
    cfg = write_config(tmp_path / "plugin.yaml", **PLUGIN_RUN)
    proc = _run(mpiexec_cmd(2, "run", str(cfg), "--run-dir", str(tmp_path / "run")))
    assert proc.returncode == 0, proc.stderr
    assert _accuracies(tmp_path / "run") == reference


def test_hpcfl_submit_local_executor_runs_the_plugin(tmp_path: Path, reference: list[float]) -> None:
    cfg = write_config(tmp_path / "plugin.yaml", **PLUGIN_RUN)
    run_dir = tmp_path / "run"
    proc = _run(hpcfl_cmd("submit", str(cfg), "--run-dir", str(run_dir), "--executor", "local", "--wait"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (run_dir / "DONE").exists() and _accuracies(run_dir) == reference


def _fake_distribution(root: Path, name: str, entry_points: str, module: str | None = None) -> Path:
    """A directory that, on the path, holds distribution ``name`` with ``entry_points`` (and the
    module source ``module`` as ``<name>_mod.py`` when given)."""
    info = root / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    if module is not None:
        (root / f"{name}_mod.py").write_text(textwrap.dedent(module))
    return root


def _one_line_error(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("entry_points", "module", "fragments"),
    [
        (
            "[hpcfl.algorithms]\nbroken = broken_dist_mod:Nope\n",
            "import a_module_that_is_not_there\n",
            (
                "plugin algorithm 'broken'",
                "'broken_dist'",
                "ModuleNotFoundError",
                "a_module_that_is_not_there",
            ),
        ),
        (
            "[hpcfl.algorithms]\nfedavg = broken_dist_mod:Mine\n",
            "",
            ("plugin algorithm 'fedavg'", "'broken_dist'", "clashes with the built-in"),
        ),
        (
            "[hpcfl.algorithms]\nbroken = broken_dist_mod:Mine\n",
            "class Mine:\n    name = 'broken'\n",
            ("plugin algorithm 'broken'", "'broken_dist'", "not a subclass"),
        ),
    ],
    ids=["import-error", "clash", "not-an-algorithm"],
)
def test_a_broken_plugin_is_one_line_naming_its_distribution(
    tmp_path: Path, entry_points: str, module: str, fragments: tuple[str, ...]
) -> None:
    dist = _fake_distribution(tmp_path / "site", "broken_dist", entry_points, module)
    cfg = write_config(tmp_path / "cfg.yaml", **{**PLUGIN_RUN, "algorithm": "broken", "params": {}})
    proc = _run(hpcfl_cmd("run", str(cfg), "--run-dir", str(tmp_path / "run")), env=plugin_env(dist))
    line = _one_line_error(proc)
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_imports_key_registers_a_module_that_is_not_installed(tmp_path: Path, reference: list[float]) -> None:
    """A script-style plugin beside the config, named in ``imports:``, is seen by ``hpcfl run``:
    the same algorithm as the example plugin's, registered under another name."""
    (tmp_path / "my_method.py").write_text(
        textwrap.dedent(
            """
            import hpcfl
            from hpcfl_example.algorithm import ServerLRFedAvg

            @hpcfl.register_algorithm
            class Mine(ServerLRFedAvg):
                name = "my_slr"
            """
        )
    )
    cfg = write_config(
        tmp_path / "cfg.yaml", **{**PLUGIN_RUN, "algorithm": "my_slr", "imports": ["my_method"]}
    )
    proc = _run(hpcfl_cmd("run", str(cfg), "--run-dir", str(tmp_path / "run")), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _accuracies(tmp_path / "run") == reference


def test_imports_key_failing_module_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "bad_method.py").write_text("raise RuntimeError('half-written')\n")
    cfg = write_config(tmp_path / "cfg.yaml", **{**PLUGIN_RUN, "imports": ["bad_method"]})
    line = _one_line_error(_run(hpcfl_cmd("run", str(cfg)), cwd=tmp_path))
    assert "config key 'imports'" in line and "'bad_method'" in line and "RuntimeError: half-written" in line


@pytest.mark.parametrize("value", ["my_module", [1]])
def test_imports_key_must_be_a_list_of_module_names(value) -> None:
    with pytest.raises(ConfigError, match="config key 'imports' must be a list of module names"):
        config_from_dict({"imports": value})


def test_register_refuses_builtin_names_and_non_algorithms() -> None:
    from hpcfl.algorithms import FedAvg

    with pytest.raises(ConfigError, match="'fedavg' is a built-in algorithm"):
        hpcfl.register_algorithm(FedAvg)
    with pytest.raises(ConfigError, match="is a built-in model"):
        hpcfl.register_model("mlp", lambda shape, classes: None)
    with pytest.raises(ConfigError, match="not a subclass of hpcfl.algorithms.Algorithm"):
        hpcfl.register_algorithm(int, "int_algo")  # type: ignore[arg-type]
    assert "int_algo" not in ALGORITHMS and "mlp" in MODEL_SPECS


def test_register_in_a_script_reaches_run_experiment(tmp_path: Path, reference: list[float]) -> None:
    """``register_model`` / ``register_dataset`` / ``register_algorithm`` under new names in this
    process give the same run as the entry points."""
    from hpcfl.registry import DATASET_SPECS

    plugin = ALGORITHMS["example_slr"]
    renamed = type("Renamed", (plugin,), {"name": "renamed_slr"})
    hpcfl.register_algorithm(renamed)
    hpcfl.register_model("renamed_linear", MODEL_SPECS["example_linear"].build)
    hpcfl.register_dataset(
        "renamed_blobs", DATASET_SPECS["example_blobs"].load, options=("n_train", "n_test", "seed")
    )
    cfg = {**PLUGIN_RUN, "algorithm": "renamed_slr", "model": "renamed_linear", "dataset": "renamed_blobs"}
    hpcfl.run_experiment(config_from_dict(cfg), tmp_path / "run")
    assert _accuracies(tmp_path / "run") == reference


#: client-level DP on the plugin's run: a client sample (q = 2/4), DP-FedAvg's clip and noise
PRIVATE_RUN = {
    **PLUGIN_RUN,
    "params": {"server_lr": 1.0},
    "clients_per_round": 2,
    "privacy": {"level": "client", "noise_multiplier": 1.0, "clip": 0.5},
}


def test_the_plugin_declares_client_level_dp_and_runs_as_dp_fedavg(tmp_path: Path) -> None:
    """Issue 43: DP support is the algorithm's declaration (``dp_levels``), so a plugin can have it.
    With η_g = 1 the example algorithm is FedAvg, so its DP run is DP-FedAvg's: the same clipped
    and noised rounds (same noise draws) give the same losses and the same ε per round."""
    assert ALGORITHMS["example_slr"].dp_levels == ("client",)
    hpcfl.run_experiment(config_from_dict(dict(PRIVATE_RUN)), tmp_path / "plugin")
    hpcfl.run_experiment(
        config_from_dict({**PRIVATE_RUN, "algorithm": "fedavg", "params": {}}), tmp_path / "fedavg"
    )
    plugin, fedavg = _rows(tmp_path / "plugin"), _rows(tmp_path / "fedavg")
    eps = [r["epsilon"] for r in plugin if "epsilon" in r]
    assert len(eps) == 3 and eps == sorted(eps) and eps == [r["epsilon"] for r in fedavg if "epsilon" in r]
    losses = [r["test_loss"] for r in plugin if "test_loss" in r]
    assert len(losses) == 3
    assert losses == pytest.approx([r["test_loss"] for r in fedavg if "test_loss" in r], rel=1e-5)
    with pytest.raises(ConfigError, match="privacy.level=sample does not support algorithm 'example_slr'"):
        config_from_dict({**PRIVATE_RUN, "privacy": {"level": "sample", "noise_multiplier": 1.0}})


def test_an_algorithm_that_declares_no_dp_is_refused_in_one_line() -> None:
    """An algorithm class without ``dp_levels`` (the contract's default) gets one line saying so."""
    undeclared = type("NoDP", (ALGORITHMS["example_slr"],), {"name": "nodp_slr", "dp_levels": ()})
    hpcfl.register_algorithm(undeclared)
    with pytest.raises(ConfigError) as err:
        config_from_dict({**PRIVATE_RUN, "algorithm": "nodp_slr"})
    text = str(err.value)
    assert "\n" not in text and "does not support algorithm 'nodp_slr'" in text
    assert "declares no differential-privacy support" in text and "use one of fedavg" in text


def test_the_example_algorithm_imports_only_from_hpcfl_algorithms_config_error_included() -> None:
    """Issue 45 item 7: a plugin's algorithm needs nothing but ``hpcfl.algorithms``: ConfigError,
    its one-line error for a bad hyper-parameter, is re-exported there (the same class)."""
    import ast

    import hpcfl.algorithms
    import hpcfl.errors
    from tests.helpers import PLUGIN_DIR

    tree = ast.parse((PLUGIN_DIR / "hpcfl_example" / "algorithm.py").read_text())
    sources = {
        n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and "hpcfl" in (n.module or "")
    }
    assert sources == {"hpcfl.algorithms"}
    assert hpcfl.algorithms.ConfigError is hpcfl.errors.ConfigError
    assert "ConfigError" in hpcfl.algorithms.__all__
    with pytest.raises(ConfigError, match="server_lr"):
        ALGORITHMS["example_slr"].Params(server_lr=2.0)


def _readme_robust_aggregation() -> str:
    """The plugins guide's robust-aggregation block (``robust_agg.py`` there, docs/plugins.md)."""
    import re

    from tests.helpers import REPO

    text = (REPO / "docs/plugins.md").read_text()
    section = text.split("\n## Robust aggregation (trimmed mean, median)\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return code


def test_readme_robust_aggregation_is_a_trimmed_mean_and_median_that_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 45 item 7: the plugins guide's trimmed-mean algorithm, run as written: its server step equals a
    sorted-and-cut reference (trim 0.5: torch's median for odd counts, the mean of the middle two for
    even ones) and ignores a wild model; trim 0 over a real run equals FedAvg with uniform weights
    (to float rounding: sorted vs unsorted summation), with every model gathered and counted."""
    import numpy as np

    from hpcfl.algorithms import Aggregate, ServerState, StateLayout
    from hpcfl.registry import ALGORITHMS as REG

    (tmp_path / "robust_agg.py").write_text(_readme_robust_aggregation())
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        # as the guide says: a config naming the module in imports: registers the algorithm
        base = dict(
            imports=["robust_agg"],
            dataset="synthetic",
            dataset_options={"n_train": 300, "n_test": 100, "seed": 3, "input_shape": [1, 8, 8], "num_classes": 4},
            partition="dir:0.5", num_clients=5, model="mlp", rounds=2, local_steps=3, lr=0.05,
            batch_size=16, seed=0, threads=1, progress=False,
        )  # fmt: skip
        robust = hpcfl.run_experiment(
            config_from_dict({**base, "algorithm": "trimmed_mean", "params": {"trim": 0.0}}), tmp_path / "t"
        )
        mean = hpcfl.run_experiment(
            config_from_dict({**base, "algorithm": "fedavg", "params": {"weighting": "uniform"}}),
            tmp_path / "f",
        )
        assert torch.allclose(robust.server.x, mean.server.x, rtol=1e-5, atol=1e-6)
        nbytes = robust.server.x.numel() * robust.server.x.element_size()
        assert [r["bytes_up"] for r in robust.metrics] == [5 * nbytes] * 2  # every model gathered

        cls = REG["trimmed_mean"]
        g = torch.Generator().manual_seed(0)
        for m in (5, 6):
            models = torch.randn(m, 50, generator=g)
            models[0] = 1e6  # one wild participant
            agg = Aggregate(sums={}, weight=float(m), count=m, gathered={"x": list(models)})
            layout = StateLayout.vector(50)
            for trim, cut in ((0.2, 1), (0.5, (m - 1) // 2)):
                algo = cls(cls.Params(trim=trim), layout=layout)
                state, metrics = algo.server_update(ServerState(x=torch.zeros(50)), agg, None)
                x = state.x
                ref = np.sort(models.numpy(), axis=0)[cut : m - cut].mean(axis=0)
                assert np.allclose(x.numpy(), ref, rtol=1e-6, atol=1e-6) and metrics["trimmed"] == 2 * cut
                assert x.abs().max() < 10  # the wild model is cut off
            if m % 2:
                median = (
                    cls(cls.Params(trim=0.5), layout=layout)
                    .server_update(ServerState(x=torch.zeros(50)), agg, None)[0]
                    .x
                )
                assert torch.equal(median, models.median(dim=0).values)
        with pytest.raises(ConfigError, match="params.trim"):
            cls.Params(trim=0.6)
    finally:
        REG._registered.pop("trimmed_mean", None)
        sys.modules.pop("robust_agg", None)
