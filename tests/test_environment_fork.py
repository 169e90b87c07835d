"""Forking an environment (issue 38): ``POST /v1/environments/{id}/fork`` on a real Docker engine gives N
environments that each see the source's files, write apart from one another, outlive the source, and leave no image
behind; the caps and limits refuse a fork before anything is made."""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import docker
import pytest

from managers.cpu.exec_spec import ExecLimits
from managers.remote.broker.agent_backend import AgentBackend
from managers.remote.node.node_agent import NodeAgent
from managers.remote.replies import Reply
from sandboxes.backend import NodeHardware, SandboxBackend, SandboxError, SandboxSpec
from sandboxes.docker import DockerBackend
from sandboxes.exec_wire import ExecRequest
from sandboxes.image import DEFAULT_IMAGE
from tangram_client.client import AsyncTangramClient
from tests.docker_nodes import docker_engines, local_cpu, new_broker_id
from tests.harness import Live, live_broker
from tests.test_cpu_docker import exec_action, one_node, run

MIB = 1 << 20


@pytest.fixture
def db(tmp_path):
    return str(tmp_path / "tangram.db")


def fork_images(engine: str) -> set[str]:
    client = docker.DockerClient(base_url=engine)
    try:
        return {image.id for image in client.images.list(all=True, filters={"label": "org.arl-tangram.fork=1"})}
    finally:
        client.close()


async def cat(live: Live, trajectory: str, command: str) -> str:
    record = await run(live, exec_action(command, trajectory=trajectory))
    assert record["state"] == "succeeded", record
    return str(record["result"]["stdout"])


async def test_forks_see_the_files_write_apart_and_outlive_the_source(db):
    engine = docker_engines()[0]
    before = fork_images(engine)
    blob = os.urandom(MIB)
    async with live_broker(one_node(engine), db) as live:
        status, source = await live.call("POST", "/v1/environments", json={
            "task": "t", "trajectory": "src", "memory_mb": 256,
            "files": {"repo/a.txt": "hello\n", "blob.bin": {"base64": base64.b64encode(blob).decode()}}})
        assert status == 201, source
        await cat(live, "src", "mkdir -p deps/pkg && echo installed > deps/pkg/marker")
        status, body = await live.call("POST", f"/v1/environments/{source['id']}/fork?n=3",
                                       json={"trajectories": ["r0", "r1", "r2"]})
        assert status == 201, body
        forks = body["environments"]
        assert [f["trajectory"] for f in forks] == ["r0", "r1", "r2"]
        assert all(f["state"] == "ready" and f["id"] != source["id"] for f in forks)
        assert len(fork_images(engine) - before) == 1  # one snapshot, shared by the forks
        for name in ("r0", "r1", "r2"):
            out = await cat(live, name, "cat repo/a.txt deps/pkg/marker; sha256sum blob.bin | cut -c1-16")
            assert out.split() == ["hello", "installed", hashlib.sha256(blob).hexdigest()[:16]]
        await cat(live, "r0", "echo mine > repo/a.txt && touch only-r0")
        assert (await cat(live, "r1", "cat repo/a.txt; ls")).split()[0] == "hello"
        assert "only-r0" not in await cat(live, "src", "ls")
        assert (await cat(live, "src", "cat repo/a.txt")).strip() == "hello"
        status, _ = await live.call("DELETE", f"/v1/environments/{source['id']}")
        assert status == 200
        assert (await cat(live, "r2", "cat repo/a.txt")).strip() == "hello"  # the source gone, the fork is not
        # default names, from the source's trajectory
        status, body = await live.call("POST", f"/v1/environments/{forks[1]['id']}/fork?n=1")
        assert status == 201, body
        assert body["environments"][0]["trajectory"] == "r1-fork-0"
        assert "only-r0" not in await cat(live, "r1-fork-0", "ls")
        for env in [*forks, *body["environments"]]:
            status, _ = await live.call("DELETE", f"/v1/environments/{env['id']}")
            assert status == 200
        assert fork_images(engine) - before == set()  # the last fork removed took the images with it


async def test_a_fork_is_refused_before_anything_is_made(db):
    engine = docker_engines()[0]
    before = fork_images(engine)
    config: dict[str, Any] = {**one_node(engine), "tasks": {"t": {"max_environments": 3}}}
    config["cpu"]["limits"] = {"max_fork": 4}
    async with live_broker(config, db) as live:
        status, source = await live.call("POST", "/v1/environments", json={"task": "t", "trajectory": "s",
                                                                           "memory_mb": 256})
        assert status == 201, source
        path = f"/v1/environments/{source['id']}/fork"
        for query in ("?n=0", "?n=5", "?n=x"):
            status, body = await live.call("POST", path + query)
            assert status == 400 and body["error"]["field"] == "n", (query, body)
        status, body = await live.call("POST", path, json={"trajectories": list("abcde")})  # over max_fork
        assert status == 422 and body["error"]["field"] == "trajectories", body
        status, body = await live.call("POST", path)  # neither n nor names
        assert status == 422 and body["error"]["field"] == "n", body
        status, body = await live.call("POST", path + "?n=2", json={"trajectories": ["a"]})
        assert status == 422 and body["error"]["field"] == "trajectories", body
        status, body = await live.call("POST", path + "?n=1", json={"trajectories": ["s"]})
        assert status == 409 and body["error"]["field"] == "trajectories", body
        status, body = await live.call("POST", path + "?n=3")  # 1 + 3 > the task's 3
        assert status == 429 and body["error"]["cap"] == "max_environments", body
        status, body = await live.call("POST", "/v1/environments/env-nope/fork?n=1")
        assert status == 404 and body["error"]["field"] == "id", body
        status, listed = await live.call("GET", "/v1/environments")
        assert [e["id"] for e in listed["environments"]] == [source["id"]]  # nothing made
        assert fork_images(engine) == before
        async with AsyncTangramClient(live.url, task="t") as client:
            forks = await client.fork(source["id"], trajectories=["a", "b"])  # n from the names
            assert [f["trajectory"] for f in forks] == ["a", "b"]
            for env in forks:
                await client.delete_environment(env["id"])
        assert fork_images(engine) == before


async def test_local_sandboxes_refuse_a_fork_and_keep_nothing(db):
    with tempfile.TemporaryDirectory(dir="/tmp") as run_dir:
        async with live_broker({"cpu": local_cpu(run_dir)}, db) as live:
            status, source = await live.call("POST", "/v1/environments", json={"task": "t", "trajectory": "s"})
            assert status == 201, source
            status, body = await live.call("POST", f"/v1/environments/{source['id']}/fork?n=2")
            assert status == 422 and body["error"]["code"] == "fork_unsupported", body
            status, listed = await live.call("GET", "/v1/environments")
            assert [e["id"] for e in listed["environments"]] == [source["id"]]


async def test_a_fork_through_a_node_agent_is_made_on_its_node_and_its_image_dropped_there():
    """The agent path without Ray: the broker's ``AgentSandbox`` and ``AgentBackend`` call a ``NodeAgent`` over a
    Docker backend, which snapshots on its node, makes the fork there from the snapshot, and removes only snapshots it
    made."""
    engine = docker_engines()[0]
    before = fork_images(engine)
    backend = DockerBackend(engine, run_dir=Path("/run/tangram/test-sandboxes"), cores=(0,), fast_path=True)
    await backend.start()

    async def opened() -> SandboxBackend:
        return backend

    agent = NodeAgent(opened, ExecLimits(), NodeHardware(cores=(0,), memory_mb=1024, numa=((0,),)))

    async def call(method: str, *args: Any) -> Reply:
        reply: Reply = await getattr(agent, method)(*args)
        return reply

    async def released() -> None:
        return None

    remote = AgentBackend(call, "n1", released)
    source_spec = SandboxSpec(env_id=f"src-{uuid.uuid4().hex[:8]}", task="t", trajectory="s", image=DEFAULT_IMAGE,
                              memory_mb=128, pids_limit=64, broker_id=new_broker_id())
    source = await remote.create(source_spec)
    fork = None
    try:
        await source.set_cores(frozenset({0}))
        await source.run(ExecRequest("echo prepared > state.txt", timeout_s=30))
        await source.set_cores(frozenset())
        snapshot = await source.snapshot()
        assert snapshot in fork_images(engine) - before
        fork = await remote.create(replace(source_spec, env_id=f"fork-{uuid.uuid4().hex[:8]}", trajectory="f",
                                           image=snapshot))
        await fork.set_cores(frozenset({0}))
        assert (await fork.run(ExecRequest("cat state.txt", timeout_s=30))).stdout == "prepared\n"
        with pytest.raises(SandboxError) as refused:
            await remote.drop_snapshot(DEFAULT_IMAGE)  # not a snapshot: never removed through the agent
        assert refused.value.code == "bad_request"
        await fork.destroy()
        fork = None
        await remote.drop_snapshot(snapshot)
        assert fork_images(engine) == before
    finally:
        for sandbox in (fork, source):
            if sandbox is not None:
                await sandbox.destroy()
        await backend.close()
