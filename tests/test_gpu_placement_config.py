"""The ``[gpu.fit]`` and ``[gpu.placement]`` tables (``managers/gpu/config.py``): defaults, accepted values, errors
naming the key, the keys ``[gpu]`` held before refused naming where they went, a reload's ``Conflict`` naming the
changed key, and ``placement_method``, which resolves "auto" by the number of node types."""

from __future__ import annotations

from typing import Any

import pytest

from managers.gpu.catalog import ServiceCatalog
from managers.gpu.config import MOVED, GpuFitArgs, GpuPlacementArgs, on_this_host, parse_gpu_config
from tangram.core.errors import ConfigError, Conflict

H100 = {"type": "h100", "gpus": 1, "gpu_memory_mb": 1000, "host_memory_mb": 1000}
H20 = {**H100, "type": "h20"}


def test_the_defaults() -> None:
    config = parse_gpu_config({})
    assert config.fit == GpuFitArgs(wait_for_resident=False, typed=True)
    assert config.placement == GpuPlacementArgs(method="auto", interval_s=30.0, window_s=300.0, time_limit_s=1.0)
    assert config.placement_method is None


@pytest.mark.parametrize("choice", ["auto", "none", "ilp", "greedy"])
def test_each_placement_method_is_accepted(choice: str) -> None:
    assert parse_gpu_config({"placement": {"method": choice}}).placement.method == choice


def test_the_tables_are_read() -> None:
    config = parse_gpu_config({"fit": {"wait_for_resident": True, "typed": False},
                               "placement": {"interval_s": 5, "window_s": 0.5, "time_limit_s": 2.5}})
    assert config.fit == GpuFitArgs(wait_for_resident=True, typed=False)
    assert (config.placement.interval_s, config.placement.window_s, config.placement.time_limit_s) == (5, 0.5, 2.5)


@pytest.mark.parametrize("raw,key", [
    ({"placement": {"method": "fast"}}, "gpu.placement.method"),
    ({"placement": {"method": True}}, "gpu.placement.method"),
    ({"placement": {"interval_s": 0}}, "gpu.placement.interval_s"),
    ({"placement": {"interval_s": -30}}, "gpu.placement.interval_s"),
    ({"placement": {"interval_s": "30"}}, "gpu.placement.interval_s"),
    ({"placement": {"window_s": 0.0}}, "gpu.placement.window_s"),
    ({"placement": {"time_limit_s": -1}}, "gpu.placement.time_limit_s"),
    ({"placement": {"interval": 30}}, "gpu.placement.interval"),
    ({"fit": {"typed": "yes"}}, "gpu.fit.typed"),
    ({"fit": {"wait_for_resident": 1}}, "gpu.fit.wait_for_resident"),
    ({"fit": {"typed_fit": False}}, "gpu.fit.typed_fit"),
    ({"fit": True}, "gpu.fit"),
])
def test_a_bad_key_names_itself(raw: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_gpu_config(raw)
    assert error.value.key == key, str(error.value)


def test_an_unknown_key_in_the_fit_table_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ConfigError) as error:
        parse_gpu_config({"fit": {"wait": True}})
    assert error.value.key == "gpu.fit.wait"
    assert "unknown key" in error.value.reason and "typed" in error.value.reason, str(error.value)


#: each key ``[gpu]`` held before, a value it took, and where it went
OLD_KEYS = [
    ("wait_for_resident", True, "[gpu.fit] wait_for_resident"),
    ("typed_fit", False, "[gpu.fit] typed"),
    ("placement", "ilp", "[gpu.placement] method"),
    ("placement_interval_s", 5.0, "[gpu.placement] interval_s"),
    ("placement_window_s", 30.0, "[gpu.placement] window_s"),
    ("placement_time_limit_s", 2.0, "[gpu.placement] time_limit_s"),
]


@pytest.mark.parametrize("key,value,now", OLD_KEYS)
def test_a_key_gpu_held_before_is_refused_naming_where_it_went(key: str, value: Any, now: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_gpu_config({key: value})
    assert error.value.key == f"gpu.{key}"
    assert error.value.reason.startswith(f"moved: now {now}"), str(error.value)


def test_every_moved_key_is_tested() -> None:
    assert {key for key, _, _ in OLD_KEYS} == set(MOVED)


def test_a_reload_that_changes_a_table_key_is_refused_naming_it() -> None:
    nodes = {"n0": {"gpus": 1, "gpu_memory_mb": 100, "host_memory_mb": 100, "device_type": "cpu"}}
    running = ServiceCatalog(on_this_host(parse_gpu_config({"nodes": nodes})))
    assert running.added_by(parse_gpu_config({"nodes": nodes, "fit": {"typed": True}})) == []  # the default
    for table, key, value in (("fit", "typed", False), ("placement", "window_s", 60.0)):
        with pytest.raises(Conflict) as error:
            running.added_by(parse_gpu_config({"nodes": nodes, table: {key: value}}))
        assert error.value.field == f"gpu.{table}.{key}", str(error.value)


@pytest.mark.parametrize("method,nodes,resolved", [
    ("auto", {}, None),
    ("auto", {"a": H100}, None),
    ("auto", {"a": H100, "b": H100}, None),  # one type, however many nodes
    ("auto", {"a": H100, "b": H20}, "ilp"),
    ("auto", {"a": H100, "c": {"device_type": "cpu", "gpus": 1, "gpu_memory_mb": 100}}, "ilp"),  # cpu is a type too
    ("none", {"a": H100, "b": H20}, None),
    ("greedy", {"a": H100}, "greedy"),
    ("greedy", {"a": H100, "b": H20}, "greedy"),
    ("ilp", {"a": H100}, "ilp"),
])
def test_placement_method_resolves_auto_by_the_node_types(method: str, nodes: dict[str, Any],
                                                          resolved: str | None) -> None:
    raw: dict[str, Any] = {"placement": {"method": method}}
    if nodes:
        raw["nodes"] = nodes
    assert parse_gpu_config(raw).placement_method == resolved
