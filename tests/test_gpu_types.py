"""GPU types: the shipped specs, a config's overrides (errors naming the field), the speed model, and node types in
``[gpu]``."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest

from managers.gpu.config import parse_gpu_config
from managers.gpu.gpu_types import (
    GPU_TYPES,
    REFERENCE_TYPE,
    GpuType,
    fits,
    merge_types,
    restore_factor,
    speed,
)
from tangram.core.config_tables import table
from tangram.core.errors import ConfigError


def test_every_shipped_type_passes_its_own_validation() -> None:
    for name, spec in GPU_TYPES.items():
        assert table(GpuType, asdict(spec), f"gpu.types.{name}") == spec
    assert {"h100", "h200", "h20", "a100", "l40s", "a10", "cpu"} <= set(GPU_TYPES) and REFERENCE_TYPE in GPU_TYPES


def test_a_partial_table_overrides_single_fields_and_a_new_type_gives_all() -> None:
    new = GpuType(tflops=2250.0, hbm_gb_per_s=8000, h2d_gb_per_s=64, memory_mb=180 * 1024)
    types = merge_types({"h20": {"tflops": 150}, "b200": asdict(new)})
    assert types["h20"] == GpuType(tflops=150, hbm_gb_per_s=4000, h2d_gb_per_s=64, memory_mb=96 * 1024)
    assert types["b200"] == new and types["h100"] == GPU_TYPES["h100"]
    assert GPU_TYPES["h20"].tflops == 148  # the shipped table is not changed


@pytest.mark.parametrize("raw,key", [
    ({"h20": {"tflops": 0}}, "gpu.types.h20.tflops"),
    ({"h20": {"tflops": "148"}}, "gpu.types.h20.tflops"),
    ({"h20": {"tflops": float("nan")}}, "gpu.types.h20.tflops"),
    ({"h20": {"hbm_gb_per_s": 4e12}}, "gpu.types.h20.hbm_gb_per_s"),  # bytes/s, not GB/s
    ({"h20": {"memory_mb": 1.5}}, "gpu.types.h20.memory_mb"),
    ({"h20": {"colour": 1}}, "gpu.types.h20.colour"),
    ({"b200": {"tflops": 2250, "hbm_gb_per_s": 8000, "h2d_gb_per_s": 64}}, "gpu.types.b200.memory_mb"),
    ({"h20": 148}, "gpu.types.h20"),
    ({"bad name": {}}, "gpu.types.bad name"),
    ([], "gpu.types"),
])
def test_a_bad_type_table_names_the_field(raw: Any, key: str) -> None:
    with pytest.raises(ConfigError) as error:
        merge_types(raw)
    assert error.value.key == key, str(error.value)


def test_speed_is_the_ratio_of_tflops_or_of_hbm_bandwidth() -> None:
    h100, h20, a100 = GPU_TYPES["h100"], GPU_TYPES["h20"], GPU_TYPES["a100"]
    assert speed(h20, h100, "compute") == pytest.approx(148 / 989)
    assert speed(h20, h100, "memory") == pytest.approx(4000 / 3350)
    assert speed(h100, h100, "compute") == speed(h100, h100, "memory") == 1.0
    assert restore_factor(a100, h100) == pytest.approx(2.0)  # PCIe Gen4 against Gen5: twice as long
    assert fits(h100, 80 * 1024) and not fits(GPU_TYPES["a10"], 30_000)


def test_node_types_default_by_device_and_must_be_known() -> None:
    config = parse_gpu_config({
        "types": {"h20": {"tflops": 150}},
        "nodes": {"a": {"type": "h20"}, "b": {}, "c": {"device_type": "cpu"}, "d": {"device_type": "cpu",
                                                                                   "type": "a10"}}})
    assert [n.type for n in config.nodes] == ["h20", "h100", "cpu", "a10"]
    assert config.types["h20"].tflops == 150 and config.types["a100"] == GPU_TYPES["a100"]
    assert parse_gpu_config({}).types == GPU_TYPES
    with pytest.raises(ConfigError) as error:
        parse_gpu_config({"nodes": {"n1": {"type": "b300"}}})
    assert error.value.key == "gpu.nodes.n1.type" and "'h100'" in error.value.reason
    with pytest.raises(ConfigError) as error:
        parse_gpu_config({"types": {"h20": {"tflops": -1}}, "nodes": {"n1": {}}})
    assert error.value.key == "gpu.types.h20.tflops"


def test_a_joining_node_takes_its_type_from_its_device() -> None:
    config = parse_gpu_config({"join": {"gpus": 1, "gpu_memory_mb": 100, "device_type": "cpu"}})
    assert config.join is not None and config.join.node("g1").type == "cpu"
