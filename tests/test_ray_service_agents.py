"""Reward services behind service agents on a real two-node Ray cluster on this machine (issue 17): GPU nodes g1
(the head) and g2 (a second raylet) each run the torch worker on CPU virtual GPUs inside their agent, and the GPU
manager drives them through the same service seam it uses on its own host. Without a GPU here the device copies
are CPU copies; the agent, its placement, restarts and the instance protocol are the real ones."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import ray
from ray.cluster_utils import Cluster

from managers.gpu.manager import GpuManager
from managers.gpu.service_backends import HOST_COPY_SHARED, SPILLS_TO_DISK
from managers.remote.broker.ray_cluster import gpu_node_resource
from managers.remote.node.service_agent import ServiceAgent
from reward_services.backend import ServiceSpec
from reward_services.requests import RewardLimits, parse_reward_input
from reward_services.torch_worker import TorchBackend
from tangram.config import parse_config
from tangram.core.errors import ConfigError
from tests.harness import Live, live_broker, until
from tests.ray_clusters import NODE, two_node_cluster
from tests.test_gpu_manager import PAIRS, reward, service, similarities_of_pairs


@pytest.fixture(scope="module")
def reference_scores() -> list[float]:
    return similarities_of_pairs()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Cluster]:
    """The Ray nodes of GPU nodes g1 (the head) and g2."""
    with two_node_cluster(gpu_node_resource("g1"), gpu_node_resource("g2")) as cluster:
        yield cluster


def agent_gpus(cluster: Cluster, **extra: Any) -> dict[str, Any]:
    """Two agent GPU nodes of one virtual GPU each, room for one resident service per GPU."""
    nodes = {name: {"agent": True, "gpus": 1, "gpu_memory_mb": 150, "host_memory_mb": 1000, "device_type": "cpu"}
             for name in ("g1", "g2")}
    return {"cpu": {"enabled": False}, "ray": {"address": cluster.address},
            "gpu": {"nodes": nodes, "services": {"judge": service(dops=[1])}, **extra}}


def gpu_manager(live: Live) -> GpuManager:
    return next(m for m in live.broker.managers if isinstance(m, GpuManager))


def agent_of(live: Live, node: str) -> Any:
    """The Ray actor behind ``node``'s torch instances."""
    link = gpu_manager(live).nodes[node].backends["torch"]._link  # type: ignore[attr-defined]
    return link._actor


async def run(live: Live, body: dict[str, Any]) -> dict[str, Any]:
    status, record = await live.call("POST", "/v1/actions?wait=true&timeout_s=120", json=body)
    assert status == 200, record
    return record  # type: ignore[no-any-return]


async def batch(live: Live, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Submitted in one request (so one pass places them), each awaited to its end."""
    status, body = await live.call("POST", "/v1/actions:batch", json={"actions": bodies})
    assert status == 200, body
    return [(await live.call("GET", f"/v1/actions/{r['id']}?wait=true&timeout_s=120"))[1] for r in body["actions"]]


async def test_reward_actions_run_in_each_nodes_agent_on_its_ray_node(ray_cluster: Cluster, tmp_path,
                                                                      reference_scores) -> None:
    async with live_broker(agent_gpus(ray_cluster), str(tmp_path / "b.db")) as live:
        records = await batch(live, [reward("judge")] * 6)
        for record in records:
            assert record["state"] == "succeeded", record
            assert record["result"]["scores"] == pytest.approx(reference_scores, abs=1e-5)
        assert {r["result"]["node"] for r in records} == {"g1", "g2"}  # the first pass placed one on each
        actors = [agent_of(live, name) for name in ("g1", "g2")]
        ray_nodes = {key.removeprefix("tangram_gpu_node_"): node["NodeID"] for node in ray.nodes()
                     if node["Alive"] for key in node["Resources"] if key.startswith("tangram_gpu_node_")}
        for name in ("g1", "g2"):
            actor = agent_of(live, name)
            where = await actor.__ray_call__.remote(lambda _: (os.getpid(), ray.get_runtime_context().get_node_id(),
                                                               os.environ.get("CUDA_VISIBLE_DEVICES")))
            assert where[0] != os.getpid() and where[1] == ray_nodes[name]  # its own process, on its node
            assert where[2] is None  # Ray left the node's GPUs to the manager (the agent takes no Ray GPU)
        status, described = await live.call("GET", "/v1/services/judge")
        assert status == 200 and {r["agent"] for r in described["resident"]} == {"g1", "g2"}
    for actor in actors:  # a stopping broker closes the instances and lets its agents go
        with pytest.raises(ray.exceptions.ActorDiedError):
            await actor.__ray_call__.remote(lambda _: os.getpid())


@pytest.mark.parametrize("channel", ["auto", "tls"])
async def test_rewards_go_over_the_agents_channel_once_it_is_open(ray_cluster: Cluster, tmp_path, reference_scores,
                                                                   channel: str) -> None:
    """The service agent shares this host with the broker: "auto" calls it over its unix socket, "tls" over TLS on
    its node's address (127.0.0.1 on this loopback cluster); either way the rewards are the same."""
    config = agent_gpus(ray_cluster)
    config["gpu"]["nodes"].pop("g2")
    config["ray"]["channel"] = channel
    async with live_broker(config, str(tmp_path / "b.db")) as live:
        assert (await run(live, reward("judge")))["state"] == "succeeded"  # through Ray, as the channel opens
        link = gpu_manager(live).nodes["g1"].backends["torch"]._link  # type: ignore[attr-defined]
        where = await until(lambda: link._route.channel)
        assert where.startswith("tls://127.0.0.1:") if channel == "tls" else where.endswith("/agent.sock"), where
        for _ in range(3):
            record = await run(live, reward("judge"))
            assert record["state"] == "succeeded", record
            assert record["result"]["scores"] == pytest.approx(reference_scores, abs=1e-5)
        assert link._route.channel == where  # the calls kept to it


async def test_a_restarted_agent_fails_one_action_and_the_next_is_served_afresh(ray_cluster: Cluster, tmp_path,
                                                                                 reference_scores) -> None:
    """Ray restarts an agent killed with SIGKILL; the action that meets the restart ends service_unavailable, and
    the GPU manager makes the instance afresh (prepare, restore) for the next one."""
    config = agent_gpus(ray_cluster)
    config["gpu"]["nodes"].pop("g2")
    async with live_broker(config, str(tmp_path / "b.db")) as live:
        assert (await run(live, reward("judge")))["state"] == "succeeded"
        actor = agent_of(live, "g1")
        pid = await actor.__ray_call__.remote(lambda _: os.getpid())
        os.kill(pid, signal.SIGKILL)
        failed = await run(live, reward("judge"))
        assert failed["state"] == "failed" and failed["error"]["code"] == "service_unavailable", failed
        again = await run(live, reward("judge"))
        assert again["state"] == "succeeded" and again["result"]["restored"], again
        assert again["result"]["scores"] == pytest.approx(reference_scores, abs=1e-5)
        assert await actor.__ray_call__.remote(lambda _: os.getpid()) != pid


async def test_a_gpu_node_joins_from_ray_sized_by_its_agent(ray_cluster: Cluster, tmp_path,
                                                             reference_scores) -> None:
    """g2 is not configured: its raylet carries tangram_gpu_node_g2 and [gpu.join] lets it join; its agent reads
    its host memory on its host (the join table leaves it at 0), and it serves beside g1."""
    config = agent_gpus(ray_cluster, join={"gpus": 1, "gpu_memory_mb": 150, "device_type": "cpu"})
    config["gpu"]["nodes"].pop("g2")
    async with live_broker(config, str(tmp_path / "b.db")) as live:
        joined = gpu_manager(live).nodes["g2"].config
        assert joined.agent and joined.host_memory_mb == psutil.virtual_memory().total // 2 >> 20
        done = await batch(live, [reward("judge")] * 2)
        assert {r["result"]["node"] for r in done} == {"g1", "g2"}  # placed in one pass, one on each
        for record in done:
            assert record["result"]["scores"] == pytest.approx(reference_scores, abs=1e-5)


async def test_nodes_that_cannot_hold_the_services_stay_out_and_submits_wait_for_one(ray_cluster: Cluster,
                                                                                      tmp_path) -> None:
    """A join-only broker whose joining nodes lend less GPU memory than its service needs: neither node joins
    (admission refuses them, logged), and a reward submit gets a 503 to retry, not a 422 or a hang."""
    config = agent_gpus(ray_cluster, join={"gpus": 1, "gpu_memory_mb": 50, "host_memory_mb": 1000,
                                           "device_type": "cpu"})
    config["gpu"].pop("nodes")
    async with live_broker(config, str(tmp_path / "b.db")) as live:
        assert gpu_manager(live).nodes == {}
        status, body = await live.call("POST", "/v1/actions", json=reward("judge"))
        assert status == 503 and body["error"]["field"] == "demand.gpu", body


async def test_an_agent_nodes_disk_tier_spills_on_its_host_and_restores_load_from_it(ray_cluster: Cluster, tmp_path,
                                                                                     reference_scores) -> None:
    """g1 behind its agent with a disk tier: host memory for two of three 100 MiB copies. The agent writes the
    files and loads them on g1's host (this machine's disk here), and the broker's tier and results see it."""
    config = agent_gpus(ray_cluster)
    config["gpu"]["nodes"].pop("g2")
    config["gpu"]["nodes"]["g1"].update(host_memory_mb=250, disk_dir=str(tmp_path / "tier"))
    config["gpu"]["services"] = {name: service(dops=[1]) for name in "abc"}
    async with live_broker(config, str(tmp_path / "b.db")) as live:
        assert sorted(p.name for p in (tmp_path / "tier").iterdir()) == ["a.safetensors", "b.safetensors",
                                                                         "c.safetensors"]
        tier = gpu_manager(live).nodes["g1"].tier
        assert tier is not None and tier.copies["a"].state.value == "disk"  # prepared first, dropped for c
        loaded = await run(live, reward("a"))
        assert loaded["state"] == "succeeded" and 0 < loaded["result"]["load_s"] <= loaded["result"]["restore_s"]
        for name in "bca":
            record = await run(live, reward(name))
            assert record["result"]["scores"] == pytest.approx(reference_scores, abs=1e-5), record
        row = next(r for r in (await live.call("GET", "/v1/resources"))[1]["resources"] if r["resource"] == "gpu")
        assert row["host_tier"]["budget_mb"] == 250 and row["host_tier"]["used_mb"] <= 250


async def test_an_agent_nodes_disk_tier_is_checked_on_its_host(ray_cluster: Cluster, tmp_path) -> None:
    """A disk_dir the agent cannot create is refused at start, naming the field and the agent's reason."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = agent_gpus(ray_cluster)
    config["gpu"]["nodes"].pop("g2")
    config["gpu"]["nodes"]["g1"].update(host_memory_mb=250, disk_dir=str(blocker / "tier"))
    config["gpu"]["services"] = {name: service(dops=[1]) for name in "abc"}
    manager = GpuManager(parse_config(config).gpu)
    try:
        with pytest.raises(ConfigError) as refused:
            await manager.start()
        assert refused.value.key == "gpu.nodes.g1.disk_dir" and "a-file" in refused.value.reason
    finally:
        await manager.close()


def long_reward() -> dict[str, Any]:
    """A reward action that keeps its agent busy for seconds (a thousand pairs on one CPU thread)."""
    text = "the quick brown fox jumps over the lazy dog"
    return {**reward("judge"), "spec": {"service": "judge", "input": {"pairs": [[text, text]] * 1000}}}


async def test_a_gpu_node_leaves_with_its_raylet_and_comes_back(ray_cluster: Cluster, tmp_path,
                                                                reference_scores) -> None:
    """g2's raylet dies while an action runs there: that action ends node_lost, g2's GPUs leave the pool and the
    other node goes on; when g2's raylet is back, its instances are made afresh and it serves again."""
    async with live_broker(agent_gpus(ray_cluster), str(tmp_path / "b.db")) as live:
        async def gpu_pools() -> dict[str, Any]:
            _, resources = await live.call("GET", "/v1/resources")
            return {row["pool"]: row for row in resources["resources"] if row["resource"] == "gpu"}

        async def running(ids: list[str]) -> bool:
            states = [(await live.call("GET", f"/v1/actions/{i}"))[1]["state"] for i in ids]
            return states == ["running", "running"]

        status, body = await live.call("POST", "/v1/actions:batch", json={"actions": [long_reward()] * 2})
        assert status == 200
        ids = [record["id"] for record in body["actions"]]
        await until(lambda: running(ids), timeout_s=120)  # one on each node (one GPU each)
        [worker] = ray_cluster.worker_nodes
        ray_cluster.remove_node(worker, allow_graceful=False)
        ended = {r["result"]["node"] if r["result"] else r["error"]["node"]: r for r in
                 [(await live.call("GET", f"/v1/actions/{i}?wait=true&timeout_s=120"))[1] for i in ids]}
        assert ended["g1"]["state"] == "succeeded"
        assert ended["g2"]["state"] == "failed" and ended["g2"]["error"]["code"] == "node_lost", ended["g2"]
        assert "left the cluster" in ended["g2"]["error"]["message"]
        pools = await gpu_pools()
        assert pools["g2"]["lost"] and pools["g2"]["in_use"] == 0 and pools["g1"]["lost"] is None
        elsewhere = await asyncio.gather(*(run(live, reward("judge")) for _ in range(3)))
        assert {r["state"] for r in elsewhere} == {"succeeded"} and {r["result"]["node"] for r in elsewhere} == {"g1"}

        ray_cluster.add_node(**NODE, resources={gpu_node_resource("g2"): 1})
        await until(lambda: _back(gpu_pools()), timeout_s=120)
        back = await batch(live, [reward("judge")] * 2)
        assert {r["result"]["node"] for r in back} == {"g1", "g2"}  # placed in one pass: g2 serves again
        for record in back:
            assert record["result"]["scores"] == pytest.approx(reference_scores, abs=1e-5)


async def _back(pools: Any) -> bool:
    return (await pools)["g2"]["lost"] is None


def test_admission_of_an_agent_node_counts_host_copies_as_its_backend_keeps_them(tmp_path) -> None:
    """The broker admits an agent node's services without importing its backends: what it assumes about shared
    host copies, and about which kinds spill to a disk tier, is what the backends do."""
    from reward_services.sglang import SglangBackend

    assert HOST_COPY_SHARED == {"torch": TorchBackend.shares_host_copy, "sglang": SglangBackend.shares_host_copy}
    with_disk = TorchBackend(device_type="cpu", disk_dir=tmp_path)
    assert SPILLS_TO_DISK == {"torch": with_disk.tiered, "sglang": SglangBackend.tiered}


async def test_an_agent_refuses_what_the_rest_api_would(tmp_path, reference_scores) -> None:
    """The service agent checks each request with the REST API's parser and limits, and answers errors with
    their codes (here in this process, with the real torch worker)."""
    spec = ServiceSpec(**{**service(dops=[1]), "name": "judge", "dops": (1,)})
    agent = ServiceAgent(lambda: TorchBackend(device_type="cpu"), RewardLimits(max_items=4, max_input_bytes=256))
    described = await agent.prepare(1, spec, (0,))
    assert "ok" in described and described["ok"]["host_bytes"] > 0
    assert await agent.restore(1) == {"ok": None}
    request = parse_reward_input("similarity", {"pairs": PAIRS}, RewardLimits())
    assert parse_reward_input("similarity", request, RewardLimits()) == request  # what the broker sends passes again
    answered = await agent.infer(1, request)
    assert answered["ok"]["scores"] == pytest.approx(reference_scores, abs=1e-5)
    for bad, code in [({"pairs": [["a", "b"]] * 5}, "bad_input"),  # past max_items
                      ({"pairs": [["x" * 200, "y" * 200]]}, "bad_input"),  # past max_input_bytes
                      ({"texts": ["a"]}, "bad_input")]:  # not a similarity request
        assert (await agent.infer(1, bad))["error"]["code"] == code
    assert (await agent.infer(2, request))["error"]["code"] == "service_unavailable"  # no such instance
    assert (await agent.prepare(1, spec, (0,)))["error"]["code"] == "prepare_failed"  # its id is taken
    assert await agent.close(1) == {"ok": None} and await agent.close(1) == {"ok": None}  # idempotent
    assert (await agent.infer(1, request))["error"]["code"] == "service_unavailable"
    assert await agent.shutdown() == {"ok": None}
