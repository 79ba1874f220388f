"""The package's layers: no import cycle (function-level imports included), and config parsers
that name the key they were given."""

from __future__ import annotations

import pytest

from hpcfl.config import config_from_dict
from hpcfl.errors import ConfigError
from tests.import_graph import cycles, graph, layer, upward


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
