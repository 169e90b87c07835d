"""Node agents on a real two-node Ray cluster on this machine (issue 17, first step): each node's agent is a Ray
actor on the Ray node carrying its resource and drives its own Docker engine (the two test engines stand for two
hosts' engines), with the fast path, behind the same sandbox seam the CPU manager uses for a local engine."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest
import ray
from ray.cluster_utils import Cluster

from managers.cpu.exec_spec import ExecLimits, check_files
from managers.remote.broker.ray_cluster import node_resource, token_problem
from managers.remote.node.node_agent import NodeAgent
from sandboxes.backend import LABEL_ENV, NodeHardware, SandboxBackend, SandboxSpec
from tangram.core.errors import RequestError
from tangram.sim.broker_station import NoSandboxes
from tangram_client.client import AsyncTangramClient
from tangram_client.output_stream import OutputPiece
from tests.docker_nodes import cpu_config, docker_engines, labelled_containers, new_broker_id
from tests.harness import Live, live_broker, until
from tests.ray_clusters import NODE, two_node_cluster
from tests.test_action_output import WAITS_FOR_FLAG, collect, texts
from tests.test_malleable import a_tool_call_takes_a_core_and_gives_it_back
from tests.test_recovery import free_port, start_broker

T = TypeVar("T")

@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Cluster]:
    """The Ray nodes of CPU nodes n1 (the head) and n2."""
    with two_node_cluster(node_resource("n1"), node_resource("n2")) as cluster:
        yield cluster


def agent_nodes(cluster: Cluster) -> dict[str, Any]:
    engines = docker_engines()
    nodes = {name: {"agent": True, "backend": "docker", "engine": engine, "cores": "0-1", "memory_mb": 2048}
             for name, engine in zip(("n1", "n2"), engines)}
    return {**cpu_config(nodes, default_memory_mb=256), "ray": {"address": cluster.address}}


async def run(live: Live, command: str, trajectory: str) -> dict[str, Any]:
    body = {"task": "t", "trajectory": trajectory, "kind": "exec", "demand": {"cpu": 1},
            "spec": {"command": command}, "timeout_s": 60}
    _, record = await live.call("POST", "/v1/actions?wait=true", json=body)
    return record


def refuses(unix_path: str) -> bool:
    """Whether nothing listens on ``unix_path`` any more (its process ended)."""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(unix_path)
        except OSError:
            return True
    return False


async def open_channels(live: Live) -> dict[str, str]:
    """Each agent node's channel, once every one is open (each opens beside its agent's first call)."""

    async def channels() -> dict[str, str] | None:
        _, resources = await live.call("GET", "/v1/resources")
        rows = {r["pool"]: r["channel"] for r in resources["resources"] if r["resource"] == "cpu"}
        return rows if all(rows.values()) else None

    opened: dict[str, str] = await until(channels)
    return opened


async def test_trajectories_run_on_both_nodes_through_their_agents(ray_cluster: Cluster, tmp_path) -> None:
    raw = agent_nodes(ray_cluster)
    broker_id = raw["cpu"]["broker_id"]
    engines = dict(zip(("n1", "n2"), docker_engines()))
    async with live_broker(raw, str(tmp_path / "t.db")) as live:
        trajectories = [f"traj-{i}" for i in range(4)]
        first = await asyncio.gather(*(run(live, f"echo {t} > mine; nproc", t) for t in trajectories))
        assert all(r["state"] == "succeeded" and r["result"]["stdout"] == "1\n" for r in first), first
        nodes = {r["result"]["node"] for r in first}
        assert nodes == {"n1", "n2"}  # new environments are spread by memory load
        for record in first:  # each sandbox lives on its node's own engine, found there by its labels
            env_id, node = record["result"]["environment"], record["result"]["node"]
            on_engine = {c.labels[LABEL_ENV] for c in labelled_containers(engines[node], broker_id)}
            assert env_id in on_engine
        again = await asyncio.gather(*(run(live, "cat mine", t) for t in trajectories))  # state kept between actions
        assert [r["result"]["stdout"] for r in again] == [f"{t}\n" for t in trajectories]
        assert [r["result"]["environment"] for r in again] == [r["result"]["environment"] for r in first]
        _, resources = await live.call("GET", "/v1/resources")
        agents = {r["pool"]: r for r in resources["resources"] if r["resource"] == "cpu"}
        assert {pool: row["backend"] for pool, row in agents.items()} == {"n1": "agent", "n2": "agent"}
        assert all(row["node_backend"]["backend"] == "docker" for row in agents.values())
        # both agents share this host with the broker: their calls go over their channels, not through Ray
        opened = await open_channels(live)
        assert all(opened[pool].endswith(f"/{broker_id}/{pool}.agent.sock") for pool in agents), opened
    for engine in engines.values():  # the broker's stop removed every sandbox through the agents
        assert labelled_containers(engine, broker_id) == []


async def test_agents_are_called_over_tls_when_asked(ray_cluster: Cluster, tmp_path) -> None:
    """``channel = "tls"``: every agent is called over TLS on its node's address (here 127.0.0.1, as the loopback
    cluster advertises), as a broker on another host calls it."""
    raw = agent_nodes(ray_cluster)
    raw["ray"]["channel"] = "tls"
    async with live_broker(raw, str(tmp_path / "t.db")) as live:
        records = await asyncio.gather(*(run(live, f"echo {i}", f"traj-{i}") for i in range(4)))
        assert [r["result"]["stdout"] for r in records] == [f"{i}\n" for i in range(4)], records
        assert {r["result"]["node"] for r in records} == {"n1", "n2"}
        opened = await open_channels(live)
        assert set(opened) == {"n1", "n2"}
        assert all(channel.startswith("tls://127.0.0.1:") for channel in opened.values()), opened
        assert len(set(opened.values())) == 2  # each agent its own listener


async def test_a_command_behind_an_agent_streams_its_output_while_it_runs(ray_cluster: Cluster, tmp_path) -> None:
    """The output comes through the agent's Ray streaming call as the node's sandbox reads it: the command waits for
    a flag the test makes (``docker exec`` on the node's engine) once its first line came through."""
    raw = agent_nodes(ray_cluster)
    engines = dict(zip(("n1", "n2"), docker_engines()))
    async with live_broker(raw, str(tmp_path / "t.db")) as live, AsyncTangramClient(live.url, task="t") as client:
        made = await run(live, "true", "streamed")
        env_id, node = made["result"]["environment"], made["result"]["node"]
        [container] = [c for c in labelled_containers(engines[node], raw["cpu"]["broker_id"])
                       if c.labels[LABEL_ENV] == env_id]
        body = {"task": "t", "trajectory": "streamed", "kind": "exec", "demand": {"cpu": 1}, "timeout_s": 60,
                "spec": {"command": WAITS_FOR_FLAG.format(flag="/tmp/streamed-go")}}
        _, record = await live.call("POST", "/v1/actions", json=body)

        async def on_piece(piece: OutputPiece) -> None:
            if "first" in piece.text:
                await asyncio.to_thread(container.exec_run, ["touch", "/tmp/streamed-go"])

        pieces = await asyncio.wait_for(collect(client.output(record["id"]), on_piece), 90)
        assert (pieces[0].event, pieces[0].text) == ("stdout", "first\n")
        assert (texts(pieces, "stdout"), texts(pieces, "stderr")) == ("first\nthird\n", "second\n")
        assert pieces[-1].end is not None and pieces[-1].end["state"] == "succeeded", pieces[-1]


async def test_a_dead_agent_ends_its_actions_with_a_code_and_its_environments_are_lost(ray_cluster: Cluster,
                                                                                      tmp_path) -> None:
    raw = agent_nodes(ray_cluster)
    broker_id = raw["cpu"]["broker_id"]
    async with live_broker(raw, str(tmp_path / "t.db")) as live:
        records = await asyncio.gather(*(run(live, "true", f"traj-{i}") for i in range(2)))
        by_node = {r["result"]["node"]: r for r in records}
        assert set(by_node) == {"n1", "n2"}
        channel = (await open_channels(live))["n2"]
        ray.kill(ray.get_actor(f"tangram-agent-{broker_id}-n2", namespace="tangram"), no_restart=True)
        await until(lambda: refuses(channel))  # the kill lands a moment later; until then the agent still answers
        lost_env = by_node["n2"]["result"]["environment"]
        lost = await run(live, "true", by_node["n2"]["trajectory"])
        assert lost["state"] == "failed" and lost["error"]["code"] == "node_lost", lost
        _, env = await live.call("GET", f"/v1/environments/{lost_env}")
        assert env["state"] == "lost" and "agent died" in env["lost_reason"]
        still = await run(live, "echo fine", by_node["n1"]["trajectory"])  # the other node goes on
        assert still["state"] == "succeeded" and still["result"]["stdout"] == "fine\n"
        code, _ = await live.call("DELETE", f"/v1/environments/{lost_env}")
        assert code == 200
    # with no agent on n2 nothing could remove its sandbox: it waits there, labelled, for the next agent to adopt
    [left] = labelled_containers(docker_engines()[1], broker_id)
    assert left.labels[LABEL_ENV] == lost_env
    left.remove(force=True)


@pytest.mark.parametrize("files", [{"../escape": b"x"}, {"/etc/passwd": b"x"}, {"a/../../b": b"x"},
                                   {"big": b"x" * 1025}, {"a": b"", "b": b"", "c": b""}])
async def test_the_agent_refuses_bad_files_itself(files: dict[str, bytes]) -> None:
    async def opened() -> SandboxBackend:
        return NoSandboxes()  # its create raises: the agent must refuse before reaching the engine

    limits = ExecLimits(max_files=2, max_files_bytes=1024)
    agent = NodeAgent(opened, limits, NodeHardware(cores=(0,), memory_mb=64, numa=((0,),)))
    spec = SandboxSpec(env_id="env-1", task="t", trajectory=None, image="i", memory_mb=64, pids_limit=64, files=files)
    reply = await agent.create(spec)
    assert reply["error"]["code"] == "bad_files" and not reply["error"]["lost"]
    assert reply["error"]["message"].startswith("files")  # names the field, as the REST API would
    with pytest.raises(RequestError):
        check_files(files, "files", limits)
    check_files({"ok/inside.txt": b"x" * 1000, "b": b"x" * 24}, "files", limits)  # inside and within the bounds


async def test_an_agent_restarted_by_ray_takes_its_sandboxes_back(ray_cluster: Cluster, tmp_path) -> None:
    raw = agent_nodes(ray_cluster)
    broker_id = raw["cpu"]["broker_id"]
    async with live_broker(raw, str(tmp_path / "t.db")) as live:
        records = await asyncio.gather(*(run(live, f"echo {t} > mine", t) for t in ("a", "b")))
        by_node = {r["result"]["node"]: r for r in records}
        agent = ray.get_actor(f"tangram-agent-{broker_id}-n2", namespace="tangram")
        pid = await agent.__ray_call__.remote(lambda _: os.getpid())
        os.kill(pid, signal.SIGKILL)  # the agent's process dies; Ray starts it again
        for _ in range(100):  # until Ray has restarted it, an action sent to it ends with a code to retry on
            again = await run(live, "cat mine", by_node["n2"]["trajectory"])
            if again["state"] == "succeeded":
                break
            assert again["error"]["code"] == "node_unavailable", again["error"]
            await asyncio.sleep(0.1)
        assert again["state"] == "succeeded", again["error"]
        assert again["result"]["stdout"] == f"{by_node['n2']['trajectory']}\n"  # the same sandbox, files kept
        assert again["result"]["environment"] == by_node["n2"]["result"]["environment"]
        assert await agent.__ray_call__.remote(lambda _: os.getpid()) != pid
    for engine in docker_engines():  # the restarted agent removed its sandbox at the broker's stop
        assert labelled_containers(engine, broker_id) == []


def n2_raylet(cluster: Cluster) -> Any:
    """The cluster's only worker node: n2's."""
    [node] = cluster.worker_nodes
    return node


async def test_a_node_joins_from_ray_leaves_with_its_raylet_and_comes_back(ray_cluster: Cluster, tmp_path) -> None:
    """n2's raylet goes, and comes back while the broker runs: the joining node is used without a restart, its
    loss ends its running action and lists its environment lost, and its return brings the environment back."""
    engines = docker_engines()
    raw = agent_nodes(ray_cluster)
    raw["cpu"]["nodes"].pop("n2")
    raw["cpu"]["join"] = {"backend": "docker", "engine": engines[1]}  # a joining node runs on this engine
    broker_id = raw["cpu"]["broker_id"]
    ray_cluster.remove_node(n2_raylet(ray_cluster))
    async with live_broker(raw, str(tmp_path / "t.db")) as live:
        async def cpu_pools() -> dict[str, Any]:
            _, resources = await live.call("GET", "/v1/resources")
            return {row["pool"]: row for row in resources["resources"] if row["resource"] == "cpu"}

        assert set(await cpu_pools()) == {"n1"}
        ray_cluster.add_node(**NODE, resources={node_resource("n2"): 1})
        pools = await until(lambda: _with(cpu_pools(), lambda pools: "n2" in pools and pools))
        assert pools["n2"]["backend"] == "agent" and pools["n2"]["capacity"] == len(os.sched_getaffinity(0))
        # n2 reported this host's memory (80% of it), far more than n1's 2 GiB: new trajectories go there
        first = await run(live, "echo kept > mine", "stays")
        assert first["result"]["node"] == "n2", first
        env_id = first["result"]["environment"]
        running = asyncio.create_task(run(live, "sleep 60", "running"))

        async def running_env() -> list[Any]:
            _, listed = await live.call("GET", "/v1/environments?task=t")
            return [e for e in listed["environments"] if e["trajectory"] == "running" and e["running_actions"]]

        [running_on] = await until(running_env)  # the command runs in its sandbox on n2
        assert running_on["node"] == "n2"

        left_at = time.monotonic()
        ray_cluster.remove_node(n2_raylet(ray_cluster), allow_graceful=False)
        ended = await running
        assert ended["state"] == "failed" and ended["error"]["code"] == "node_lost", ended["error"]
        assert "left the cluster" in ended["error"]["message"]
        env = await until(lambda: _with(live.call("GET", f"/v1/environments/{env_id}"),
                                        lambda answer: answer[1]["state"] == "lost" and answer[1]))
        detected_s = time.monotonic() - left_at
        assert "left the cluster" in env["lost_reason"]
        pools = await cpu_pools()
        assert pools["n2"]["lost"] and pools["n2"]["in_use"] == 0  # its cores are back, none leaked
        elsewhere = await run(live, "echo fine", "new")  # new trajectories go to the nodes still there
        assert elsewhere["state"] == "succeeded" and elsewhere["result"]["node"] == "n1", elsewhere
        lost = await run(live, "cat mine", "stays")
        assert lost["state"] == "failed" and lost["error"]["code"] == "environment_lost", lost

        ray_cluster.add_node(**NODE, resources={node_resource("n2"): 1})
        await until(lambda: _with(live.call("GET", f"/v1/environments/{env_id}"),
                                  lambda answer: answer[1]["state"] == "ready"))
        back = await run(live, "cat mine", "stays")  # the same sandbox, adopted by its labels
        assert back["state"] == "succeeded" and back["result"]["stdout"] == "kept\n", back
        assert (await cpu_pools())["n2"]["lost"] is None
        print(f"node loss: action ended and environment listed lost {detected_s:.1f} s after the raylet died")
    for engine in engines:
        assert labelled_containers(engine, broker_id) == []


async def _with(answer: Awaitable[T], check: Callable[[T], Any]) -> Any:
    return check(await answer)


async def test_a_standby_broker_takes_over_the_agents_and_their_sandboxes(ray_cluster: Cluster, postgres_url: str,
                                                                          tmp_path) -> None:
    """Two brokers on one PostgreSQL store, nodes behind agents: the leader killed with SIGKILL, the standby leads
    through the same agents (detached from the dead broker), and the trajectories' sandboxes go on."""
    engines = docker_engines()
    broker_id = new_broker_id()
    ports = free_port(), free_port()
    configs = []
    for i, port in enumerate(ports):
        path = tmp_path / f"b{i}.toml"
        path.write_text(
            f'[store]\nurl = "{postgres_url}"\nleader_election = true\n'
            f'[server]\nadvertise_url = "http://127.0.0.1:{port}"\n'
            f'[ray]\naddress = "{ray_cluster.address}"\n'
            f'[cpu]\nbroker_id = "{broker_id}"\ndefault_memory_mb = 256\n'
            + "".join(f'[cpu.nodes.{name}]\nagent = true\nbackend = "docker"\nengine = "{engine}"\n'
                      f'cores = "0-1"\nmemory_mb = 2048\n' for name, engine in zip(("n1", "n2"), engines)))
        configs.append(path)
    leader = await start_broker(configs[0], ports[0], timeout_s=120)
    standby = await start_broker(configs[1], ports[1], timeout_s=60)
    try:
        async with AsyncTangramClient([f"http://127.0.0.1:{port}" for port in ports], task="t",
                                      failover_s=60) as client:
            first = [await client.exec(f"echo {t} > mine", trajectory=t) for t in ("a", "b")]
            assert {r.result["node"] for r in first if r.result} == {"n1", "n2"}
            agents = {name: ray.get_actor(f"tangram-agent-{broker_id}-{name}", namespace="tangram")
                      for name in ("n1", "n2")}
            pids = {name: await agent.__ray_call__.remote(lambda _: os.getpid()) for name, agent in agents.items()}
            leader.send_signal(signal.SIGKILL)
            await leader.wait()
            again = [await client.exec("cat mine", trajectory=t) for t in ("a", "b")]
        assert [r.result["stdout"] for r in again if r.result] == ["a\n", "b\n"]  # the same sandboxes, kept
        assert [r.result["environment"] for r in again if r.result] == [r.result["environment"]
                                                                        for r in first if r.result]
        assert {name: await agent.__ray_call__.remote(lambda _: os.getpid())  # the same agents, not new ones
                for name, agent in agents.items()} == pids
    finally:
        for process in (leader, standby):
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                await process.wait()
    for engine in engines:  # the new leader's stop removed the sandboxes through the agents
        assert labelled_containers(engine, broker_id) == []


async def test_a_broker_without_the_clusters_token_does_not_join(ray_cluster: Cluster, tmp_path) -> None:
    config = tmp_path / "b.toml"
    engine = docker_engines()[0]
    config.write_text(f'[store]\nurl = "sqlite+aiosqlite:///{tmp_path}/b.db"\n'
                      f'[cpu]\nbroker_id = "{new_broker_id()}"\n'
                      f'[cpu.nodes.n1]\nagent = true\nbackend = "docker"\nengine = "{engine}"\n')
    for environ, refusal in [({"RAY_AUTH_MODE": "token"}, "without its token"),
                             ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "not-the-token"}, "did not accept")]:
        process = await asyncio.create_subprocess_exec(  # the cluster named on the command line ([ray] address)
            sys.executable, "-m", "tangram.cli", "serve", "--config", str(config), "--port", str(free_port()),
            "--ray", ray_cluster.address,
            env={**{k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}, **environ,
                 "HOME": str(tmp_path)}, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        _, stderr = await asyncio.wait_for(process.communicate(), 120)
        assert process.returncode != 0 and refusal in stderr.decode(), stderr.decode()[-2000:]
        assert ray_cluster.address in stderr.decode()


def test_what_counts_as_having_the_clusters_token(tmp_path) -> None:
    assert token_problem({}, tmp_path) == 'RAY_AUTH_MODE is not "token"'
    assert token_problem({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "t"}, tmp_path) is None
    assert "no token" in (token_problem({"RAY_AUTH_MODE": "token"}, tmp_path) or "")
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t\n")
    assert token_problem({"RAY_AUTH_MODE": "token"}, tmp_path) is None  # Ray's default place
    named = tmp_path / "token"
    named.write_text("")
    assert "no token" in (token_problem({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(named)}, tmp_path)
                          or "")


async def test_a_test_run_behind_an_agent_shrinks_for_a_tool_call_and_grows_back(ray_cluster: Cluster,
                                                                                 tmp_path) -> None:
    """The malleable path through an agent: each resize is one call to it (``Sandbox.repin`` on its node)."""
    raw = {**cpu_config({"n1": {"agent": True, "backend": "docker", "engine": docker_engines()[0], "cores": "0-1",
                                "memory_mb": 2048}}), "ray": {"address": ray_cluster.address}}
    async with live_broker(raw, str(tmp_path / "t.db")) as live:
        await a_tool_call_takes_a_core_and_gives_it_back(live)


async def test_a_broker_of_joining_nodes_only_serves_on_the_nodes_that_joined(ray_cluster: Cluster,
                                                                              tmp_path) -> None:
    """No ``[cpu.nodes]`` at all: both Ray nodes join at start (``[cpu.join]``), each reporting its hardware."""
    raw = {**cpu_config({}, default_memory_mb=256, join={"backend": "local", "unsandboxed": True}),
           "ray": {"address": ray_cluster.address}}
    raw["cpu"].pop("nodes")
    async with live_broker(raw, str(tmp_path / "t.db")) as live:
        _, resources = await live.call("GET", "/v1/resources")
        pools = {r["pool"] for r in resources["resources"] if r["resource"] == "cpu"}
        assert pools == {"n1", "n2"}
        records = await asyncio.gather(*(run(live, "echo $TANGRAM_ENVIRONMENT", f"traj-{i}") for i in range(4)))
        assert all(r["state"] == "succeeded" for r in records), records
        assert {r["result"]["node"] for r in records} == {"n1", "n2"}
        assert all(r["result"]["stdout"] == f"{r['result']['environment']}\n" for r in records)
