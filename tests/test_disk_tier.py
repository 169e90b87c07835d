"""The disk tier below host memory (issue 18) with real parts: safetensors files on a real disk, the torch worker
serving the real all-MiniLM-L6-v2 on CPU "virtual GPUs", the GPU manager's loads, drops and prefetch, and a real
broker over REST."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from managers.gpu.config import parse_gpu_config
from managers.gpu.host_tier import CopyState
from managers.gpu.manager import GpuManager
from reward_services.weights_file import read_weights, write_weights
from tangram.core.action import Action, Demand, Kind
from tangram.core.errors import ActionFailed, ConfigError
from tests.harness import live_broker
from tests.test_gpu_manager import PAIRS, reward, service, similarities_of_pairs

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def reference_scores() -> list[float]:
    return similarities_of_pairs()


def buffers() -> dict[torch.dtype, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {torch.bfloat16: torch.randn(1000, generator=generator).to(torch.bfloat16),
            torch.float32: torch.randn(77, generator=generator), torch.int64: torch.arange(5)}


def test_weights_file_is_a_safetensors_file_that_reads_back_exactly(tmp_path: Path) -> None:
    written = buffers()
    path = tmp_path / "w.safetensors"
    write_weights(path, written)
    with safe_open(str(path), framework="pt") as library:  # the library reads what we wrote
        assert sorted(library.keys()) == sorted(str(dtype) for dtype in written)
        for dtype, buffer in written.items():
            assert torch.equal(library.get_tensor(str(dtype)), buffer)
    read = read_weights(path, {dtype: buffer.numel() for dtype, buffer in written.items()}, pin=False)
    assert all(torch.equal(read[dtype], buffer) for dtype, buffer in written.items())
    assert not path.with_name(path.name + ".partial").exists()


def test_a_weights_file_that_does_not_match_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    write_weights(path, buffers())
    with pytest.raises(ValueError, match="does not hold 999 elements"):
        read_weights(path, {torch.bfloat16: 999}, pin=False)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match="ends 10 bytes early"):
        read_weights(path, {torch.int64: 5}, pin=False)


def tiered_config(tmp_path: Path, names: str = "abc", host_memory_mb: int = 250, gpus: int = 1) -> dict[str, Any]:
    """Services of 100 MiB host copies on a node with room for two (with 1 GPU holding one at a time)."""
    return {"nodes": {"n0": {"gpus": gpus, "gpu_memory_mb": 150, "host_memory_mb": host_memory_mb,
                             "device_type": "cpu", "disk_dir": str(tmp_path / "tier")}},
            "services": {name: service(dops=[1]) for name in names}}


def reward_action(name: str) -> Action:
    return Action(task="t", kind=Kind.REWARD, demands={"gpu": Demand((1,))},
                  spec={"service": name, "input": {"pairs": PAIRS}})


async def run(manager: GpuManager, name: str) -> dict[str, Any]:
    action = reward_action(name)
    manager.validate(action)
    allocation = manager.allocate(action, {"gpu": 1}, {"gpu": "n0"})
    try:
        return (await manager.execute(action, allocation)).result
    finally:
        manager.release(allocation)


@pytest.mark.slow  # seconds: left out of the fast lane
async def test_copies_spill_to_disk_at_start_and_a_restore_loads_its_own(tmp_path, reference_scores):
    manager = GpuManager(parse_gpu_config(tiered_config(tmp_path)))
    await manager.start()
    try:
        tier = manager.nodes["n0"].tier
        assert tier is not None and tier.budget_mb == 250
        # every copy was written; the one prepared first went back to disk to make room for the last
        assert sorted(p.name for p in (tmp_path / "tier").iterdir()) == ["a.safetensors", "b.safetensors",
                                                                         "c.safetensors"]
        assert {n: c.state for n, c in tier.copies.items()} == {"a": CopyState.DISK, "b": CopyState.HOST,
                                                                "c": CopyState.HOST}
        first = await run(manager, "a")  # from disk: load, then copy to the (virtual) GPU
        assert first["scores"] == pytest.approx(reference_scores, abs=1e-5)
        assert first["restored"] and 0 < first["load_s"] <= first["restore_s"]
        assert tier.copies["b"].state is CopyState.DISK  # least recently used: dropped for a
        second = await run(manager, "c")  # in host memory: no disk stage
        assert second["restored"] and second["load_s"] == 0 and second["scores"] == pytest.approx(reference_scores,
                                                                                                   abs=1e-5)
        again = await run(manager, "b")
        assert again["load_s"] > 0 and again["scores"] == pytest.approx(reference_scores, abs=1e-5)
        assert tier.used_mb <= 250
    finally:
        await manager.close()


@pytest.mark.slow  # seconds: left out of the fast lane
async def test_prefetch_loads_the_next_queued_service_and_its_restore_skips_the_disk(tmp_path, reference_scores):
    manager = GpuManager(parse_gpu_config(tiered_config(tmp_path)))
    await manager.start()
    try:
        node = manager.nodes["n0"]
        assert node.tier is not None and node.tier.copies["a"].state is CopyState.DISK
        queued = [reward_action(name) for name in "ba"]
        for action in queued:
            manager.validate(action)
        manager.foresee(queued)  # b is in host memory; a is next on disk: it loads, c (needed by nobody) drops
        assert node.tier.copies["a"].state is CopyState.LOADING and node.tier.copies["c"].state is CopyState.DISK
        assert await node.loads["a"] is None
        assert node.tier.copies["a"].state is CopyState.HOST
        result = await run(manager, "a")
        assert result["restored"] and result["load_s"] == 0
        assert result["scores"] == pytest.approx(reference_scores, abs=1e-5)
    finally:
        await manager.close()


@pytest.mark.slow  # seconds: left out of the fast lane
async def test_a_missing_weights_file_fails_the_action_with_the_reason_and_the_next_one_recovers(tmp_path):
    manager = GpuManager(parse_gpu_config(tiered_config(tmp_path)))
    await manager.start()
    try:
        path = tmp_path / "tier" / "a.safetensors"
        saved = path.read_bytes()
        path.unlink()
        with pytest.raises(ActionFailed, match=r"loading .*a\.safetensors") as failed:
            await run(manager, "a")
        assert failed.value.code == "restore_failed"
        tier = manager.nodes["n0"].tier
        assert tier is not None and tier.copies["a"].state is CopyState.DISK and tier.copies["a"].pins == 0
        assert manager.nodes["n0"].residency.used_mb == [0]  # nothing left booked
        path.write_bytes(saved)
        assert (await run(manager, "a"))["load_s"] > 0
    finally:
        await manager.close()


def test_admission_with_a_disk_tier_refuses_a_copy_larger_than_host_memory_naming_it(tmp_path):
    config = tiered_config(tmp_path, host_memory_mb=90)
    with pytest.raises(ConfigError) as refused:
        GpuManager(parse_gpu_config(config))
    assert refused.value.key == "gpu.nodes.n0.host_memory_mb"
    assert "a (100 MiB), b (100 MiB), c (100 MiB)" in refused.value.reason
    untiered = tiered_config(tmp_path)  # without a disk tier, the copies together must fit
    del untiered["nodes"]["n0"]["disk_dir"]
    with pytest.raises(ConfigError) as refused:
        GpuManager(parse_gpu_config(untiered))
    assert refused.value.key == "gpu.services.c.host_memory_mb" and "admission refused" in refused.value.reason


@pytest.mark.slow  # seconds: left out of the fast lane
async def test_over_rest_the_stages_show_in_results_metrics_and_status(tmp_path, reference_scores):
    config = {"cpu": {"enabled": False}, "gpu": tiered_config(tmp_path)}
    async with live_broker(config, str(tmp_path / "db.sqlite")) as live:
        for name in "abca":
            status, body = await live.call("POST", "/v1/actions?wait=true&timeout_s=120", json=reward(name))
            assert status == 200 and body["state"] == "succeeded", body
            assert body["result"]["scores"] == pytest.approx(reference_scores, abs=1e-5)
        metrics = (await live.call("GET", "/metrics"))[1]
        assert 'tangram_gpu_restore_stage_seconds_count{node="n0",service="a",stage="disk_to_host"}' in metrics
        assert 'stage="host_to_gpu"' in metrics
        loads = [line for line in metrics.splitlines() if line.startswith("tangram_gpu_host_loads_total{")]
        assert loads and sum(float(line.split()[-1]) for line in loads) >= 2
        row = next(r for r in (await live.call("GET", "/v1/resources"))[1]["resources"] if r["resource"] == "gpu")
        assert row["host_tier"]["budget_mb"] == 250 and row["host_tier"]["used_mb"] <= 250
        services = (await live.call("GET", "/v1/services"))[1]["services"]
        assert {s["name"]: s["host_copies"]["n0"] for s in services}["a"] == "host"
