"""The package's layers: no import cycle (function-level imports included), and config parsers
that name the key they were given."""

from __future__ import annotations

import pytest
import torch

from hpcfl.config import config_from_dict
from hpcfl.errors import ConfigError
from tests.import_graph import ACCEPTED, STAGE_CODE, cycles, graph, layer, upward


def test_the_import_graph_has_no_cycle() -> None:
    edges = graph()
    assert len(edges) > 100 and sum(map(len, edges.values())) > 300  # the walker sees the package
    assert cycles(edges) == []


def test_the_cycle_finder_finds_function_level_cycles() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_algorithms_import_no_stage_code_and_the_contract_no_runner() -> None:
    """Algorithms name their stage code by reference ("module:function"); the contract modules
    import nothing above them."""
    edges = graph()
    contract = [m for m in edges if m.startswith("hpcfl.algorithms")]
    assert {(m, t) for m in contract for t in edges[m] if layer(t) < layer(m)} == set()
    assert [edge for edge in upward(edges) if edge[0].startswith("hpcfl.algorithms")] == []


def test_stage_code_imports_the_contract_never_the_runner() -> None:
    """``hpcfl.tct`` and ``hpcfl.ntk`` reach the federation through the stage contract's
    FederationView and the communicator StageInput carries: no import of ``hpcfl.runner`` (nor of
    anything above it), at module level or inside a function."""
    edges = graph()
    stage = [m for m in edges if m.startswith(STAGE_CODE)]
    assert len(stage) >= 8  # the walker sees tct/ and ntk/
    above = {(m, t) for m in stage for t in edges[m] if t.startswith("hpcfl.runner") or layer(t) < layer(m)}
    assert above == set()


def test_every_upward_import_is_an_accepted_one() -> None:
    """Imports only point down (DESIGN.md, "Layers"), but for the function-level ones
    ``tests/import_graph.py`` lists with their reason."""
    assert set(upward(graph())) == set(ACCEPTED)


def test_the_layer_check_catches_a_stage_module_reaching_into_the_runner() -> None:
    edges = {"hpcfl.tct.pipeline": {"hpcfl.runner.federation"}, "hpcfl.runner.federation": set()}
    assert upward(edges) == [("hpcfl.tct.pipeline", "hpcfl.runner.federation")]


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"algorithm": "ntkfl", "params": {"memory_budget": "lots"}}, "params.memory_budget"),
        ({"client_state_memory": "lots"}, "client_state_memory"),
        ({"client_batch": "0"}, "client_batch"),
    ],
)
def test_a_bad_size_names_the_key_it_came_from(data: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=f"config key '{key}' must be"):
        config_from_dict(data)


def test_the_runner_federation_is_the_view_stage_code_reads(tmp_path) -> None:
    """``runner.Federation`` has every member of the contract's FederationView (and no communicator
    in it); ``build_model`` rebuilds the run's initial model bit for bit; the model spec, not a model
    name, says whether inputs are flat; ``chosen_metrics`` names the config keys turned on."""
    import inspect

    from hpcfl.algorithms import FederationView
    from hpcfl.comm import LocalComm
    from hpcfl.config import load_config
    from hpcfl.runner.federation import build_federation
    from hpcfl.training import FlatModel
    from tests.helpers import synthetic_config

    members = {n for n, _ in inspect.getmembers(FederationView) if not n.startswith("_")}
    assert {"model_plan", "build_model", "flat_inputs", "client_data", "seed"} <= members
    assert "comm" not in members and "cfg" not in members
    small = {"num_clients": 3, "dataset_options": {"n_train": 60, "n_test": 20, "seed": 1}}
    for model, flat_inputs in (("mlp", True), ("simplecnn", False)):
        cfg = load_config(synthetic_config(tmp_path, model=model, drift_diversity=True, **small))
        fed = build_federation(cfg, LocalComm())
        assert all(hasattr(fed, n) for n in members)
        assert fed.flat_inputs is flat_inputs and fed.model_name == model
        assert fed.chosen_metrics == ("drift_diversity",)
        assert torch.equal(FlatModel(fed.build_model(fed.dataset.input_shape)).vector, fed.flat.vector)
        assert fed.model_plan().algorithm is fed.algorithm
