"""Fencing beyond the store (issue 35): a deposed leader stops sending to node agents, sandboxes and upstreams.

On a real two-node Ray cluster on this machine (CPU node n1 on the head, GPU node g1 on the other raylet) and the
real PostgreSQL store: an agent that a leader of epoch N has called refuses the calls of epoch N-1 before they have
any effect, and the broker of N-1 stops sending; the lost lock and the store's refusal depose the leader too, and
then no upstream call and no sandbox command leaves it. End to end, a leader cut off from its database (a TCP
relay that drops its sessions and then stays silent, as a network partition does) and frozen while a standby takes
over is refused by the agent at its first call once it runs again, stops with the reason logged, and runs nothing
twice."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest
import ray
from ray.cluster_utils import Cluster
from sqlalchemy.engine import make_url

from managers.basic.upstream import Upstream, UpstreamConfig
from managers.basic.upstream_metrics import UpstreamMetrics
from managers.remote.broker.ray_agents import open_agent_backend
from managers.remote.broker.ray_cluster import gpu_node_resource, node_resource
from managers.remote.broker.ray_service_agents import RayServiceLink
from sandboxes.backend import NODE_UNAVAILABLE, SandboxError, SandboxSpec
from sandboxes.exec_wire import ExecRequest
from tangram.config import parse_config
from tangram.core.errors import ActionFailed
from tangram.core.fencing import DEPOSED, Fencing, leading
from tangram.leadership import LOCK_KEY, Leadership, asyncpg_dsn, fence
from tangram.service import LOST_LEADERSHIP_EXIT
from tangram.store.fence import Deposed
from tangram.store.store import Store
from tangram_client.client import AsyncTangramClient
from tests.docker_nodes import local_cpu, new_broker_id
from tests.harness import live_broker, live_upstream
from tests.ray_clusters import two_node_cluster
from tests.test_recovery import free_port, start_broker
from tests.test_store import make_action


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Cluster]:
    """CPU node n1 on the head, GPU node g1 on the second raylet."""
    with two_node_cluster(node_resource("n1"), gpu_node_resource("g1")) as cluster:
        yield cluster


def agent_config(cluster: Cluster, run_dir: str, broker_id: str) -> dict[str, Any]:
    """n1 behind its agent, on local processes (no Docker: the agent is what is under test)."""
    return {"cpu": {"broker_id": broker_id, "run_dir": run_dir, "default_memory_mb": 64,
                    "nodes": {"n1": {"agent": True, "backend": "local", "unsandboxed": True, "cores": "0-1",
                                     "memory_mb": 2048}}},
            "ray": {"address": cluster.address}}


async def test_a_node_agent_refuses_an_older_epoch_and_that_broker_stops_sending(ray_cluster: Cluster,
                                                                                  run_dir: str) -> None:
    """Two brokers of one broker id reach the same agent, as an old and a new leader do: once epoch 2 has called
    (its start), epoch 1's next call does nothing and deposes epoch 1; epoch 2 goes on. Ray restarting the agent
    does not open the gate again: it starts from the epoch it kept on its node."""
    cpu = parse_config(agent_config(ray_cluster, run_dir, new_broker_id())).cpu
    [node] = cpu.nodes

    def spec(env_id: str) -> SandboxSpec:
        return cpu.sandbox_spec(env_id, "t", None, cpu.default_image, 64)

    old, new = Fencing(epoch=1), Fencing(epoch=2)
    async with leading(old):
        old_backend = await open_agent_backend(node, cpu)  # places the agent; its first call carries epoch 1
        await (await old_backend.create(spec("env-before"))).destroy()  # the leader's calls go through
    async with leading(new):
        new_backend = await open_agent_backend(node, cpu)  # the same agent, found by its name: now at epoch 2
    try:
        async with leading(old):
            with pytest.raises(SandboxError) as refused:
                await old_backend.create(spec("env-late"))
            assert refused.value.code == DEPOSED and "epoch 2" in refused.value.message
            assert old.deposed_by is not None and "node n1's agent refused" in old.deposed_by
            with pytest.raises(SandboxError) as again:  # deposed: nothing more is sent
                await old_backend.create(spec("env-later"))
            assert again.value.code == DEPOSED and again.value.message.startswith("this broker no longer leads")
        async with leading(new):
            assert new.deposed_by is None
            assert await new_backend.adopt(cpu.broker_id) == []  # the refused call made no sandbox on the node
            sandbox = await new_backend.create(spec("env-new"))
            executed = await sandbox.execute("act-1", ExecRequest("echo fine", cores=(0,), cwd=sandbox.workdir,
                                                                  timeout_s=10, output_limit=1024, reap=True))
            assert executed.result.stdout == "fine\n", executed
            await sandbox.destroy()
        agent = ray.get_actor(f"tangram-agent-{cpu.broker_id}-n1")
        ray.kill(agent, no_restart=False)  # Ray starts it again
        while True:  # until it answers a call without an epoch (which moves no gate)
            with contextlib.suppress(ray.exceptions.RayActorError):
                if "ok" in await agent.call.remote(None, "describe"):
                    break
            await asyncio.sleep(0.1)
        stale = Fencing(epoch=1)  # epoch 1 again, not yet told it lost: its first call reaches the new agent
        async with leading(stale):
            deadline = time.monotonic() + 60
            while True:  # a handle may still see the restart for a moment (node_unavailable): call again
                with pytest.raises(SandboxError) as after_restart:
                    await old_backend.create(spec("env-after-restart"))
                if after_restart.value.code != NODE_UNAVAILABLE or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
        assert after_restart.value.code == DEPOSED and "epoch 2" in after_restart.value.message
        assert (Path(run_dir) / cpu.broker_id / "n1.agent-epoch").read_text() == "2"
    finally:
        async with leading(new):
            await new_backend.close()


async def test_a_service_agent_refuses_an_older_epoch(ray_cluster: Cluster) -> None:
    raw = {"cpu": {"enabled": False}, "ray": {"address": ray_cluster.address},
           "gpu": {"nodes": {"g1": {"agent": True, "gpus": 1, "gpu_memory_mb": 150, "host_memory_mb": 1000,
                                    "device_type": "cpu"}}}}
    gpu = parse_config(raw).gpu
    [node] = gpu.nodes
    link = RayServiceLink("torch", replace(node, agent=False), gpu)
    old, new = Fencing(epoch=4), Fencing(epoch=5)
    try:
        async with leading(new):
            assert await link.call("close", 1) == {"ok": None}  # closing what it does not hold: done already
        async with leading(old):
            reply = await link.call("close", 1)
            assert reply["error"]["code"] == DEPOSED and "epoch 5" in reply["error"]["message"], reply
            assert old.deposed_by is not None and "GPU node g1's service agent refused" in old.deposed_by
        async with leading(new):
            assert await link.call("close", 1) == {"ok": None}
    finally:
        await link.release()


async def test_the_lost_lock_and_the_stores_refusal_depose_the_leader_beyond_its_store(postgres_url: str) -> None:
    """Both ways a leader learns of its loss outside the agents depose its fencing, so the checks before sandboxes
    and upstreams fail from then on."""
    old = await Leadership.open(postgres_url, "http://old")
    await old.acquire()
    assert old.epoch is not None and old.fencing.epoch == old.epoch
    behind_store = Fencing(old.epoch)  # as the service passes the leader's own fencing to its store's fence
    store = await Store.open(postgres_url, fence=fence(old.epoch, behind_store))
    new: Leadership | None = None
    try:
        await store.durable(make_action(task="fenced"))
        admin = await asyncpg.connect(asyncpg_dsn(postgres_url))
        try:
            await admin.execute("SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' "
                                "AND objid = $1 AND granted", LOCK_KEY & 0xFFFFFFFF)
        finally:
            await admin.close()
        reason = await asyncio.wait_for(old.lost(), 10)
        assert old.fencing.deposed_by == reason and old.fencing.deposed.is_set()
        with pytest.raises(ActionFailed, match="leader's lock failed"):
            old.fencing.check()
        new = await Leadership.open(postgres_url, "http://new")
        await asyncio.wait_for(new.acquire(), 10)
        assert behind_store.deposed_by is None  # nothing told the store's side yet
        with pytest.raises(Deposed):
            await store.durable(make_action(seq=2, task="fenced"))
        assert behind_store.deposed_by is not None and f"(epoch {new.epoch})" in behind_store.deposed_by
    finally:
        with contextlib.suppress(Deposed):
            await store.close()
        for leadership in (old, new):
            if leadership is not None:
                await leadership.close()


async def test_a_deposed_broker_sends_no_upstream_call() -> None:
    """An upstream cannot check an epoch: the broker checks itself before each attempt."""
    async with live_upstream() as upstream, aiohttp.ClientSession() as session:
        proxy = Upstream(UpstreamConfig(base_url=upstream.url, max_retries=0), "api.x", UpstreamMetrics())

        async def no_retry() -> None:
            raise AssertionError("no retry expected")

        fencing = Fencing(epoch=3)
        async with leading(fencing):
            call = {"method": "POST", "path": "/echo", "body": {"n": 1}}
            assert (await proxy.call(session, call, no_retry))["status"] == 200
            fencing.depose("another broker leads the store now (epoch 4)")
            with pytest.raises(ActionFailed) as refused:
                await proxy.call(session, {**call, "body": {"n": 2}}, no_retry)
        assert refused.value.code == DEPOSED and "epoch 4" in refused.value.message
        assert upstream.seen == [{"n": 1}]  # the deposed broker's call never left it


async def test_a_deposed_broker_runs_makes_and_removes_nothing_in_agentless_sandboxes(run_dir: str,
                                                                                     tmp_path: Path) -> None:
    """A sandbox without an agent cannot check an epoch either: the broker checks itself before a command, before
    making a sandbox, and removes none (the new leader has taken them over), even when asked to."""
    ran = tmp_path / "ran"
    fencing = Fencing(epoch=7)
    cpu = local_cpu(run_dir)
    sandboxes = Path(run_dir) / cpu["broker_id"] / "here"
    async with leading(fencing), live_broker({"cpu": cpu}, str(tmp_path / "t.db")) as live:
        def body(trajectory: str) -> dict[str, Any]:
            return {"task": "t", "trajectory": trajectory, "kind": "exec", "demand": {"cpu": 1},
                    "spec": {"command": f"echo ran >> {ran}"}}

        _, record = await live.call("POST", "/v1/actions?wait=true", json=body("a"))
        assert record["state"] == "succeeded" and ran.read_text() == "ran\n", record
        env = record["result"]["environment"]
        fencing.depose("another broker leads the store now (epoch 8)")
        _, in_old = await live.call("POST", "/v1/actions?wait=true", json=body("a"))
        _, in_new = await live.call("POST", "/v1/actions?wait=true", json=body("b"))
        deleted, _ = await live.call("DELETE", f"/v1/environments/{env}")
        left = sorted(path.name for path in sandboxes.iterdir())
    for record in (in_old, in_new):
        assert record["state"] == "failed" and record["error"]["code"] == DEPOSED, record
    assert ran.read_text() == "ran\n"  # the deposed broker's commands never ran
    assert deleted == 200 and left == [env]  # b's sandbox never made; a's forgotten, not removed


class Partition:
    """A TCP relay to PostgreSQL that a test cuts as a network partition would: the database sees the relayed
    sessions end (a leader's lock goes with its session), while the broker's side stays open and silent, so its
    checks hang until they time out rather than fail at once."""

    def __init__(self, host: str, port: int) -> None:
        self._target = host, port
        self._upstreams: list[asyncio.StreamWriter] = []
        self._held: list[asyncio.StreamWriter] = []
        self.cut_off = False
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._held.append(writer)
        if self.cut_off:
            return  # accepted, never answered
        up_reader, up_writer = await asyncio.open_connection(*self._target)
        self._upstreams.append(up_writer)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (data := await reader.read(1 << 16)) and not self.cut_off:
            writer.write(data)
            await writer.drain()
        if not self.cut_off:
            writer.close()

    def cut(self) -> None:
        self.cut_off = True
        for writer in self._upstreams:
            writer.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for writer in self._held + self._upstreams:
            writer.close()


@contextlib.asynccontextmanager
async def partition_to(store_url: str) -> AsyncIterator[tuple[Partition, str]]:
    """A relay to the store's database and the store URL that goes through it."""
    url = make_url(store_url)
    relay = Partition(url.host or "127.0.0.1", url.port or 5432)
    port = await relay.start()
    try:
        yield relay, url.set(host="127.0.0.1", port=port).render_as_string(hide_password=False)
    finally:
        relay.close()


async def ready(url: str) -> None:
    async with aiohttp.ClientSession() as http:
        while True:
            with contextlib.suppress(aiohttp.ClientConnectionError):
                async with http.get(url + "/readyz") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.1)


async def test_a_leader_cut_off_from_its_store_is_stopped_by_its_agent(ray_cluster: Cluster, postgres_url: str,
                                                                       run_dir: str, tmp_path: Path) -> None:
    """The leader runs two actions on n1's agent with a third queued; its database goes silent and it is frozen
    while the standby takes over (adopting through the agent); let run again, its lock check would need seconds to
    time out, but its first call to the agent is refused: it stops at once, saying why, and the queued action runs
    once, on the new leader, not on both."""
    broker_id = new_broker_id()
    ran = tmp_path / "ran"
    ports = free_port(), free_port()
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    async with partition_to(postgres_url) as (relay, relayed_url):
        configs = []
        for i, (store_url, port) in enumerate(zip((relayed_url, postgres_url), ports)):
            raw = agent_config(ray_cluster, run_dir, broker_id)
            path = tmp_path / f"b{i}.toml"
            path.write_text(f'[store]\nurl = "{store_url}"\nleader_election = true\n'
                            f'[server]\nadvertise_url = "http://127.0.0.1:{port}"\n'
                            f'[ray]\naddress = "{raw["ray"]["address"]}"\n'
                            f'[cpu]\nbroker_id = "{broker_id}"\nrun_dir = "{run_dir}"\ndefault_memory_mb = 64\n'
                            f'[cpu.nodes.n1]\nagent = true\nbackend = "local"\nunsandboxed = true\n'
                            f'cores = "0-1"\nmemory_mb = 2048\n')
            configs.append(path)
        logs = [tmp_path / "leader.log", tmp_path / "standby.log"]
        leader = await start_broker(configs[0], ports[0], timeout_s=120, log=logs[0])
        standby = await start_broker(configs[1], ports[1], timeout_s=60, log=logs[1])
        try:
            await ready(urls[0])
            async with AsyncTangramClient(urls[0], task="t") as client:
                running = [await client.submit("exec", {"cpu": 1},
                                               {"command": f'echo "$TANGRAM_ACTION_ID" >> {ran}; sleep 2'})
                           for _ in range(2)]
                queued = await client.submit("exec", {"cpu": 1}, {"command": f'echo "$TANGRAM_ACTION_ID" >> {ran}'})
                while not ran.exists() or len(ran.read_text().split()) < 2:  # both cores busy, the third waits
                    await asyncio.sleep(0.02)
            leader.send_signal(signal.SIGSTOP)
            relay.cut()
            await asyncio.wait_for(ready(urls[1]), 90)  # the standby leads, through the same agent
            leader.send_signal(signal.SIGCONT)
            assert await asyncio.wait_for(leader.wait(), 30) == LOST_LEADERSHIP_EXIT
            stopped = logs[0].read_text()
            assert "stopping at once: node n1's agent refused this broker's call" in stopped, stopped[-3000:]
            async with AsyncTangramClient(urls[1], task="t") as client:
                assert (await client.wait(queued.id, timeout_s=60)).state == "succeeded"
            runs = Counter(ran.read_text().split())
            assert runs[queued.id] == 1, runs  # run by the new leader only
            assert max(runs.values()) == 1 and {r.id for r in running} <= set(runs), runs
        finally:
            for process in (leader, standby):
                if process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        process.send_signal(signal.SIGCONT)
                    process.send_signal(signal.SIGTERM)
                    await process.wait()
