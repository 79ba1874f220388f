"""``hpcfl list`` (issue 45 item 7): the registered names with their origin, and ``--schema``: every
config key with its default as YAML that is itself a valid config."""

from __future__ import annotations

import pytest
import yaml

from hpcfl.cli.main import main
from hpcfl.config import Config, config_from_dict
from hpcfl.registry import ALGORITHMS, DATASET_SPECS, MODEL_SPECS


def test_list_names_every_registered_name_with_where_it_comes_from(capsys) -> None:
    assert main(["list"]) == 0
    listed: dict[str, dict[str, str]] = {}
    for line in capsys.readouterr().out.splitlines():
        if not line.startswith(" "):
            block = listed.setdefault(line.rstrip(":"), {})
        else:
            name, origin = line.split(None, 1)
            block[name] = origin
    assert {kind: list(names) for kind, names in listed.items()} == {
        "algorithms": list(ALGORITHMS),
        "models": list(MODEL_SPECS),
        "datasets": list(DATASET_SPECS),
    }
    assert listed["algorithms"]["fedavg"] == listed["models"]["mlp"] == "built in"
    plugin = (
        "plugin, distribution hpcfl-example"  # the example plugin (tests/conftest.py puts it on the path)
    )
    assert listed["algorithms"]["example_slr"] == listed["models"]["example_linear"] == plugin
    assert listed["datasets"]["example_blobs"] == plugin


@pytest.mark.parametrize("algorithm", ["fedprox", "tct", "example_slr"])
def test_schema_is_the_default_config_of_the_algorithm_and_a_valid_config(capsys, algorithm: str) -> None:
    assert main(["list", "--schema", algorithm]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == Config(algorithm=algorithm).to_dict()
    assert printed["params"] == Config(params=ALGORITHMS[algorithm].Params()).to_dict()["params"]
    assert config_from_dict(printed).to_dict() == printed  # a file to start from, as printed


def test_schema_of_an_unknown_algorithm_is_one_line(capsys) -> None:
    assert main(["list", "--schema", "fedprx"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("hpcfl: error: unknown algorithm 'fedprx'")
    assert "did you mean 'fedprox'" in err[0]


def test_schema_of_a_plugin_registered_through_imports(capsys, tmp_path, monkeypatch) -> None:
    """Issue 51: a plugin registered by a module (a config's ``imports:``) had no schema; ``--imports
    MODULE`` imports it first, from the working directory as a run does, and the printed config
    keeps the import, so it runs as it is. Without it, the unknown name says how."""
    import sys

    (tmp_path / "mine_51.py").write_text(
        "import dataclasses\n\nimport hpcfl\nfrom hpcfl.algorithms import FedAvg\n\n\n"
        "@dataclasses.dataclass(frozen=True)\nclass P(FedAvg.Params):\n    boost: float = 1.5\n\n\n"
        "@hpcfl.register_algorithm\nclass Mine(FedAvg):\n    name = 'mine_51'\n    Params = P\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["list", "--schema", "mine_51"]) != 0
    assert "--imports MODULE" in capsys.readouterr().err
    try:
        assert main(["list", "--schema", "mine_51", "--imports", "mine_51"]) == 0
        printed = yaml.safe_load(capsys.readouterr().out)
        assert printed["imports"] == ["mine_51"] and printed["params"]["boost"] == 1.5
        assert config_from_dict(printed).to_dict() == printed
        assert main(["list", "--imports", "mine_51"]) == 0
        assert "mine_51" in capsys.readouterr().out
    finally:
        ALGORITHMS._registered.pop("mine_51", None)
        sys.modules.pop("mine_51", None)
