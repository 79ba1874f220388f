"""The eNTK path's settings (issue 55): ``entk:`` config keys, their environment overrides, and the
settings a run holds in force only while it runs."""

from __future__ import annotations

import json

import pytest

import triton_kernels._triton as kernels
from hpcfl.entk import costs
from hpcfl.entk.cuda_graph import cuda_graph_wanted
from hpcfl.entk.settings import (
    AUTOTUNE_ENV,
    COSTS_ENV,
    CUDA_GRAPH_ENV,
    NATIVE_ENV,
    EntkSection,
    EntkSettings,
    active,
    applied,
    resolve,
)
from hpcfl.errors import ConfigError


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch):
    for name in (COSTS_ENV, CUDA_GRAPH_ENV, AUTOTUNE_ENV, NATIVE_ENV):
        monkeypatch.delenv(name, raising=False)
    costs.fitted_file.cache_clear()
    yield
    costs.fitted_file.cache_clear()


def _table(tmp_path, name: str, **changed: float) -> str:
    path = tmp_path / name
    path.write_text(json.dumps({"device": "cpu", "fitted": {**costs.CPU_COSTS, **changed}}))
    return str(path)


def test_each_variable_overrides_its_key_and_the_source_is_named(tmp_path):
    mine, theirs = _table(tmp_path, "mine.json", mac=0.5), _table(tmp_path, "theirs.json", mac=0.7)
    section = EntkSection(costs=mine, cuda_graph=True, triton_autotune=False)
    assert resolve(section, method="auto", env={}) == EntkSettings(
        costs=mine, cuda_graph=True, triton_autotune=False, method="auto"
    )
    env = {COSTS_ENV: theirs, CUDA_GRAPH_ENV: "0", AUTOTUNE_ENV: "yes"}
    got = resolve(section, env=env)
    assert (got.costs, got.cuda_graph, got.triton_autotune) == (theirs, False, True)
    assert (got.costs_from, got.cuda_graph_from, got.triton_autotune_from) == (
        COSTS_ENV,
        CUDA_GRAPH_ENV,
        AUTOTUNE_ENV,
    )
    empty = resolve(section, env={COSTS_ENV: "", CUDA_GRAPH_ENV: ""})  # an empty variable is unset
    assert empty.costs == mine and empty.cuda_graph is True and empty.costs_from == "config"
    assert (got.native, got.native_from) == (True, "config")  # the native CPU kernel: on by default
    off = resolve(section, env={NATIVE_ENV: "0"})
    assert (off.native, off.native_from) == (False, NATIVE_ENV)
    assert resolve(EntkSection(native=False), env={}).native is False


@pytest.mark.parametrize("name", [CUDA_GRAPH_ENV, AUTOTUNE_ENV, NATIVE_ENV])
def test_a_bad_flag_in_the_environment_is_one_line(name):
    with pytest.raises(ConfigError) as err:
        resolve(EntkSection(), env={name: "maybe"})
    assert str(err.value) == f"{name}='maybe': must be 1 or 0 (or true/false, yes/no, on/off)"


def test_a_relative_costs_path_is_made_absolute_and_a_bad_file_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _table(tmp_path, "c.json")
    assert EntkSection(costs="c.json").costs == str(tmp_path / "c.json")
    with pytest.raises(ConfigError, match=r"^config key 'entk.costs' \(.*missing.json\): not a fitted"):
        EntkSection(costs="missing.json")


def test_settings_are_in_force_only_while_applied(tmp_path):
    table = _table(tmp_path, "c.json", pick=3.0)
    before = kernels.AUTOTUNE
    assert active() == resolve() and costs.constants("cpu") is costs.CPU_COSTS
    with applied(resolve(EntkSection(costs=table, cuda_graph=True, triton_autotune=not before))):
        assert costs.constants("cpu")["pick"] == 3.0
        assert costs.fitted_record() == {
            "file": table,
            "device_type": "cpu",
            "fitted": costs.constants("cpu"),
        }
        assert cuda_graph_wanted(None) is True and cuda_graph_wanted(False) is False
        assert kernels.AUTOTUNE is (not before)
    assert costs.constants("cpu") is costs.CPU_COSTS and costs.fitted_record() is None
    assert cuda_graph_wanted(None) is False and kernels.AUTOTUNE is before
