"""The ``[gpu]`` placement keys (``managers/gpu/config.py``): defaults, accepted values, errors naming the key, and
``placement_method``, which resolves "auto" by the number of node types."""

from __future__ import annotations

from typing import Any

import pytest

from managers.gpu.config import parse_gpu_config
from tangram.core.errors import ConfigError

H100 = {"type": "h100", "gpus": 1, "gpu_memory_mb": 1000, "host_memory_mb": 1000}
H20 = {**H100, "type": "h20"}


def test_the_defaults() -> None:
    config = parse_gpu_config({})
    assert config.placement == "auto" and config.placement_method is None
    assert (config.placement_interval_s, config.placement_window_s, config.placement_time_limit_s) == (30.0, 300.0,
                                                                                                      1.0)
    assert config.typed_fit is True


@pytest.mark.parametrize("choice", ["auto", "none", "ilp", "greedy"])
def test_each_placement_choice_is_accepted(choice: str) -> None:
    assert parse_gpu_config({"placement": choice}).placement == choice


def test_the_placement_figures_are_read() -> None:
    config = parse_gpu_config({"placement_interval_s": 5, "placement_window_s": 0.5, "placement_time_limit_s": 2.5,
                               "typed_fit": False})
    assert (config.placement_interval_s, config.placement_window_s, config.placement_time_limit_s) == (5, 0.5, 2.5)
    assert config.typed_fit is False


@pytest.mark.parametrize("raw,key", [
    ({"placement": "fast"}, "gpu.placement"),
    ({"placement": True}, "gpu.placement"),
    ({"placement_interval_s": 0}, "gpu.placement_interval_s"),
    ({"placement_interval_s": -30}, "gpu.placement_interval_s"),
    ({"placement_interval_s": "30"}, "gpu.placement_interval_s"),
    ({"placement_window_s": 0.0}, "gpu.placement_window_s"),
    ({"placement_time_limit_s": -1}, "gpu.placement_time_limit_s"),
    ({"typed_fit": "yes"}, "gpu.typed_fit"),
])
def test_a_bad_placement_key_names_itself(raw: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_gpu_config(raw)
    assert error.value.key == key, str(error.value)


@pytest.mark.parametrize("placement,nodes,method", [
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
def test_placement_method_resolves_auto_by_the_node_types(placement: str, nodes: dict[str, Any],
                                                          method: str | None) -> None:
    raw: dict[str, Any] = {"placement": placement}
    if nodes:
        raw["nodes"] = nodes
    assert parse_gpu_config(raw).placement_method == method
