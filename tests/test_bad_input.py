"""Every bad input gives one clear line on stderr, a non-zero exit and no traceback."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from hpcfl.cli.main import main
from tests.helpers import REPO, mpiexec_cmd, run_cli, synthetic_config, write_config


def _fails_cleanly(capsys, argv: list[str], *fragments: str) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code != 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("hpcfl: error:"), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[-1], (fragment, lines[-1])
    return lines[-1]


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("dataset=fashon-mnist", ("unknown dataset", "did you mean 'fashion-mnist'")),
        ("model=simplecn", ("unknown model", "simplecnn")),
        ("algorithm=fedavgg", ("unknown algorithm", "fedavg")),
        ("partition=dirichlet:0.5", ("partition",)),
        ("partition=dir:0", ("0",)),
        ("partition=dir:-1", ("-1",)),
        ("partition=classes:11", ("11",)),
        ("partition=classes:1", ("not coverable",)),
        ("lr=-1", ("lr",)),
        ("validation=1.5", ("'validation' must be in [0, 1)",)),
        ("lrr=0.1", ("unknown config key 'lrr'", "did you mean 'lr'")),
        ("stage2.solverr=primal", ("stage2.solverr", "stage2.solver")),
        ("client_batch=0", ("client_batch", "auto or a positive integer")),
        ("client_batch=all", ("client_batch", "auto or a positive integer")),
        ("client_batch=2.5", ("client_batch", "auto or a positive integer")),
        ("client_threads=0", ("config key 'client_threads' must be > 0, got 0",)),
        ("checkpoint_every=0", ("'checkpoint_every' must be auto or a positive integer, got '0'",)),
        ("checkpoint_every=often", ("'checkpoint_every' must be auto or a positive integer, got 'often'",)),
        ("client_threads=2 client_batch=3", ("client_batch (3) and client_threads (2)", "set one")),
        ("client_threads=2 device=cuda", ("'client_threads' (2) is for the CPU", "client_batch")),
        ("params=[1]", ("config key 'params' must be a mapping of scaffold hyper-parameters, got [1]",)),
        ("params=5", ("config key 'params' must be a mapping of scaffold hyper-parameters, got 5",)),
        ("seed=1e30", ("config key 'seed' must be an integer in [0, 2**63 - 1], got 1e+30",)),
        ("seed=-1", ("config key 'seed' must be an integer in [0, 2**63 - 1], got -1",)),
        ("dataset_options.seed=1e30", ("synthetic seed must be an integer in [0, 2**63 - 1], got '1e30'",)),
        ("dataset_options.n_train=many", ("synthetic n_train must be an integer, got 'many'",)),
        ("dataset_options.n_test=2.5", ("synthetic n_test must be an integer, got 2.5",)),
        ("dataset_options.input_shape=7", ("synthetic input_shape must be three positive ints",)),
        ("entk.cuda_graph=maybe", ("config key 'entk.cuda_graph' must be true or false, got 'maybe'",)),
        ("entk.triton_autotune=2", ("config key 'entk.triton_autotune' must be true or false, got 2",)),
        ("entk.costs=missing.json", ("config key 'entk.costs' (", "missing.json): not a fitted-constants")),
        ("entk.costs=''", ("config key 'entk.costs' must be a file path or null, got ''",)),
        ("entk.cuda_grph=true", ("unknown config key 'entk.cuda_grph'", "did you mean 'entk.cuda_graph'")),
    ],
)
def test_bad_config_values(tmp_path, capsys, override, fragments):
    overrides = override.split(" ")  # several keys where the fault is their combination
    if override == "partition=classes:1":
        overrides.append("num_clients=3")  # 3 clients x 1 class cannot cover 10 classes
    cfg = synthetic_config(tmp_path)
    _fails_cleanly(
        capsys, ["run", str(cfg), "--run-dir", str(tmp_path / "r"), "--set", *overrides], *fragments
    )
    assert not (tmp_path / "r" / "DONE").exists()


@pytest.mark.parametrize("name", ["HPCFL_ENTK_CUDA_GRAPH", "HPCFL_TRITON_AUTOTUNE"])
def test_a_bad_entk_flag_in_the_environment(tmp_path, capsys, monkeypatch, name):
    """Issue 55: the variables that override ``entk:`` keys are validated like them."""
    monkeypatch.setenv(name, "maybe")
    cfg = synthetic_config(tmp_path)
    line = _fails_cleanly(capsys, ["run", str(cfg), "--run-dir", str(tmp_path / "r")])
    assert line == f"hpcfl: error: {name}='maybe': must be 1 or 0 (or true/false, yes/no, on/off)"
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_synthetic_sizes_from_yaml_strings_and_beyond_memory(tmp_path, capsys, monkeypatch):
    """YAML 1.1 reads ``n_train: 2e3`` as the string "2e3": it is the integer 2000 (the same data),
    and a size that cannot be held is refused before anything is allocated."""
    from hpcfl.data import synthetic

    assert torch.equal(synthetic.make_synthetic(n_train="2e3", n_test=10).train.x,
                       synthetic.make_synthetic(n_train=2000, n_test=10).train.x)  # fmt: skip
    cfg = tmp_path / "c.yaml"
    text = synthetic_config(tmp_path).read_text().replace("n_train: 2000", "n_train: 1e6")
    cfg.write_text(text)
    assert "n_train: 1e6" in text  # a string to YAML 1.1
    monkeypatch.setattr(synthetic, "memory_share", lambda fraction: 2**30)  # this rank may use 1 GiB
    monkeypatch.setattr(synthetic.np.random, "default_rng", None)  # nothing may be drawn
    _fails_cleanly(
        capsys,
        ["run", str(cfg), "--run-dir", str(tmp_path / "r")],
        "synthetic n_train=1000000, n_test=400 of 784 features need at least 5.8 GiB, more than the 1.0 GiB",
        "use smaller dataset_options sizes",
    )


def test_client_batch_reads_an_integer_in_any_spelling(tmp_path):
    """``client_batch: 2e3`` (a string to YAML 1.1) is the group size 2000, as every other integer
    key reads it (issue 51: it alone refused it)."""
    from hpcfl.config import load_config
    from hpcfl.units import parse_client_batch

    cfg = tmp_path / "c.yaml"
    cfg.write_text(synthetic_config(tmp_path).read_text() + "client_batch: 2e3\n")
    assert parse_client_batch(load_config(cfg).client_batch) == 2000
    assert parse_client_batch(" AUTO ") == "auto" and parse_client_batch(3) == 3


def test_params_and_a_section_of_the_algorithm_setting_one_key_twice_are_refused(tmp_path, capsys):
    """Issue 51: ``params:`` silently overrode the same key in the algorithm's own section (or a
    legacy one, TCT's ``stage2:``) of the same file. Both given with different values is one line;
    the same value, or different keys, is no conflict; ``--set`` still overrides the file."""
    from hpcfl.config import load_config

    cfg = synthetic_config(tmp_path, algorithm="fedprox", fedprox={"mu": 0.3}, params={"mu": 0.1})
    argv = ["run", str(cfg), "--run-dir", str(tmp_path / "r")]
    _fails_cleanly(capsys, argv, "config sets params.mu both in params: and in the fedprox: section")
    tct = synthetic_config(
        tmp_path, algorithm="tct", stage2={"lr": 0.001, "p": 50}, params={"stage2": {"lr": 0.002}}
    )
    _fails_cleanly(
        capsys, ["run", str(tct)], "config sets params.stage2.lr both in params: and in the stage2:"
    )
    same = synthetic_config(
        tmp_path, algorithm="fedprox", fedprox={"mu": 0.3, "weighting": "uniform"}, params={"mu": 0.3}
    )
    assert (load_config(same).params.mu, load_config(same).params.weighting) == (0.3, "uniform")
    assert load_config(same, ["params.mu=0.2"]).params.mu == 0.2


@pytest.mark.parametrize(
    ("section", "fragment"),
    [
        ({"algorithm": "fedprox", "fedprox": {"muu": 1}}, "unknown config key 'fedprox.muu' (did you mean 'fedprox.mu'?)"),
        ({"algorithm": "ditto", "ditto": {"lam": -1}}, "config key 'ditto.lam' (Ditto's λ) must be >= 0"),
        ({"algorithm": "fedprox", "fedprox": {"mu": -0.1}}, "config key 'fedprox.mu' (FedProx's μ) must be >= 0"),
        ({"algorithm": "tct", "stage2": {"pp": 1}}, "unknown config key 'stage2.pp' (did you mean 'stage2.p'?)"),
        ({"algorithm": "fedprox", "params": {"muu": 1}}, "unknown config key 'params.muu'"),
    ],
)  # fmt: skip
def test_an_error_in_the_algorithms_own_section_names_that_section(tmp_path, capsys, section, fragment):
    """Issue 51: an error in ``fedprox: {muu: 1}`` was reported as ``params.muu``, a key the user
    never wrote; it names the section written (``params:`` errors stay ``params.``)."""
    cfg = synthetic_config(tmp_path, **section)
    line = _fails_cleanly(capsys, ["run", str(cfg), "--run-dir", str(tmp_path / "r")], fragment)
    assert ("'params." in line) == ("params" in section)


def test_malformed_yaml(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1, 2\nlr: 0.1\n")
    _fails_cleanly(capsys, ["run", str(bad)], "malformed YAML", "line")


def test_unreadable_config(tmp_path, capsys):
    _fails_cleanly(capsys, ["run", str(tmp_path / "missing.yaml")], "not found")


def test_missing_data_files(tmp_path, capsys):
    cfg = write_config(
        tmp_path / "c.yaml", dataset="fashion-mnist", data_root=str(tmp_path / "empty"), download=False
    )
    _fails_cleanly(capsys, ["run", str(cfg), "--run-dir", str(tmp_path / "r")], "fashion-mnist")


def test_checksum_mismatch(tmp_path, capsys, data_root):
    root = tmp_path / "data"
    shutil.copytree(data_root / "fashion-mnist", root / "fashion-mnist")
    victim = root / "fashion-mnist" / "t10k-labels-idx1-ubyte.gz"
    victim.chmod(0o644)
    blob = bytearray(victim.read_bytes())
    blob[100] ^= 0xFF
    victim.write_bytes(bytes(blob))
    cfg = write_config(tmp_path / "c.yaml", dataset="fashion-mnist", data_root=str(root), download=False)
    _fails_cleanly(capsys, ["run", str(cfg), "--run-dir", str(tmp_path / "r")], "t10k-labels-idx1-ubyte.gz")


def test_finished_run_dir_is_refused_and_resume_with_other_config_too(tmp_path, capsys):
    cfg = synthetic_config(tmp_path, rounds=1)
    run = tmp_path / "r"
    assert main(["run", str(cfg), "--run-dir", str(run)]) == 0
    capsys.readouterr()
    _fails_cleanly(
        capsys,
        ["run", str(cfg), "--run-dir", str(run)],
        "already holds a finished run",
        "--resume",
        "--overwrite",
    )
    _fails_cleanly(
        capsys,
        ["run", str(cfg), "--run-dir", str(run), "--resume", "--set", "lr=0.5"],
        "different config",
        "lr",
    )
    assert main(["run", str(cfg), "--run-dir", str(run), "--overwrite"]) == 0


def test_nan_loss_names_round_and_client(tmp_path, capsys):
    cfg = synthetic_config(tmp_path, lr=1e6, momentum=0.0, algorithm="fedavg")
    _fails_cleanly(
        capsys,
        ["run", str(cfg), "--run-dir", str(tmp_path / "r")],
        "NaN",
        "round 1",
        "client",
        "lower the learning rate",
    )


@pytest.mark.mpi
def test_more_ranks_than_clients(tmp_path):
    cfg = synthetic_config(tmp_path, num_clients=2, partition="iid")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        mpiexec_cmd(3, "run", str(cfg), "--run-dir", str(tmp_path / "r")),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "3 ranks but only 2 clients" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_subprocess_bad_input_exit_code(tmp_path):
    proc = run_cli("run", str(synthetic_config(tmp_path)), "--set", "model=nope")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("hpcfl: error: unknown model 'nope'")
    assert "Traceback" not in proc.stderr


def test_set_params_empty_clears_the_config_files_params(tmp_path):
    """Issue 45 item 7: ``--set params={}`` drops the YAML's params (the algorithm's defaults apply),
    also when switching to another algorithm; any other ``--set params.k=v`` still merges."""
    from hpcfl.algorithms.fedprox import FedProxParams
    from hpcfl.config import load_config
    from hpcfl.registry import ALGORITHMS

    cfg = synthetic_config(tmp_path, algorithm="fedprox", params={"mu": 0.5, "weighting": "uniform"})
    assert load_config(cfg).params == FedProxParams(mu=0.5, weighting="uniform")
    assert load_config(cfg, ["params={}"]).params == FedProxParams()
    assert load_config(cfg, ["params.mu=0.2"]).params == FedProxParams(mu=0.2, weighting="uniform")
    assert load_config(cfg, ["algorithm=fedavg", "params={}"]).params == ALGORITHMS["fedavg"].Params()


def test_params_for_an_algorithm_without_hyper_parameters_is_one_line_without_an_empty_key_list(
    tmp_path, capsys
):
    cfg = synthetic_config(tmp_path, algorithm="fedprox", params={"mu": 0.5})
    argv = ["run", str(cfg), "--run-dir", str(tmp_path / "r"), "--set", "algorithm=fednova"]
    line = _fails_cleanly(capsys, argv, "fednova takes no hyper-parameters, got mu", "--set params={}")
    assert "valid keys" not in line
    assert main([*argv, "params={}", "rounds=1"]) == 0  # cleared: it runs


def test_a_section_named_after_an_algorithm_holds_its_params_for_its_runs_only(tmp_path, capsys):
    """Issue 45 item 7: configs/fmnist_sweep.yaml scopes TCT's params in a ``tct:`` section (as a
    grid's ``tct.stage2.p`` axis does): TCT's points get them, the FedAvg/SCAFFOLD points their
    defaults; a typo inside another algorithm's section is still one line."""
    from hpcfl.config import load_config
    from hpcfl.registry import ALGORITHMS

    sweep = REPO / "configs" / "fmnist_sweep.yaml"
    tct = load_config(sweep, ["algorithm=tct"]).params
    assert (tct.stage1.rounds, tct.stage2.p, tct.stage2.rounds, tct.stage2.local_steps) == (5, 2000, 5, 500)
    for algorithm in ("fedavg", "scaffold"):
        assert load_config(sweep, [f"algorithm={algorithm}"]).params == ALGORITHMS[algorithm].Params()
    cfg = synthetic_config(tmp_path, algorithm="fedavg", fedprox={"mu": 0.3}, params={})
    assert load_config(cfg, ["algorithm=fedprox"]).params.mu == 0.3
    assert load_config(cfg, ["algorithm=fedprox", "params.mu=0.2"]).params.mu == 0.2  # params: wins
    argv = ["run", str(sweep), "--run-dir", str(tmp_path / "r"), "--set", "tct.stage2.pp=3"]
    _fails_cleanly(capsys, argv, "unknown config key 'tct.stage2.pp'", "did you mean 'tct.stage2.p'")


@pytest.mark.parametrize("algorithm", ["fedadam", "fedyogi", "fedadagrad"])
@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("params.tau=1.9e19", "config key 'params.tau' must be <= 1.845e+19: τ² (the second moment's start"),
        ("params.server_lr=1e39", "config key 'params.server_lr' must be <= 3.403e+38"),
    ],
)
def test_an_adaptive_server_hyper_parameter_that_would_overflow_is_one_line(
    tmp_path, capsys, algorithm, override, fragment
):
    """Issue 61 item 7: τ ≥ ~1.9e19 made τ² = inf in float32 at start-up (a traceback); now one line.
    The largest τ allowed still trains (its v₋₁ is finite)."""
    cfg = synthetic_config(tmp_path, algorithm=algorithm, rounds=1)
    _fails_cleanly(capsys, ["run", str(cfg), "--run-dir", str(tmp_path / "r"), "--set", override], fragment)
    assert main(["run", str(cfg), "--run-dir", str(tmp_path / "ok"), "--set", "params.tau=1.8e19"]) == 0
