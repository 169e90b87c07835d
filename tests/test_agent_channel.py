"""The direct channel between a broker and a node agent (issue 40), without Ray: a real ``NodeAgent`` over local
processes serves its unix socket, and TLS on 127.0.0.1 as it does on a node's address for a broker on another host;
the broker's ``AgentRoute`` sends through them. What stands for the Ray transport is an in-process call that counts
what it carries. The same route through a real two-node Ray cluster is in ``tests/test_ray_agents.py``."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from managers.cpu.exec_spec import ExecLimits
from managers.remote.broker.agent_backend import AgentSandbox, answer
from managers.remote.broker.agent_route import RETRY_S, AgentRoute, ChannelMode
from managers.remote.broker.channel_client import ChannelClient, ChannelUnreachable
from managers.remote.channel_frames import ACCEPTED, TOKEN_BYTES, frame, host_identity
from managers.remote.channel_tls import client_context, server_context
from managers.remote.node.channel_server import ChannelServer
from managers.remote.node.node_agent import NodeAgent
from managers.remote.replies import Reply, failed
from sandboxes.backend import NODE_UNAVAILABLE, NodeHardware, SandboxBackend, SandboxSpec
from sandboxes.exec_wire import ExecRequest
from sandboxes.local import LocalProcessBackend
from tangram.core.fencing import DEPOSED
from tests.harness import until

REPLY_LIMIT = 64 << 20


@dataclass
class RayStandIn:
    """Ray's transport as the route sees it: the agent's fenced entry, each call's method noted; ``dead`` answers as
    ``call_agent`` does for an actor that died."""

    agent: NodeAgent
    methods: list[str] = field(default_factory=list)
    dead: bool = False

    async def __call__(self, epoch: int | None, method: str, args: tuple[Any, ...]) -> Reply:
        self.methods.append(method)
        if self.dead:
            return failed("node_lost", "the agent died", lost=True)
        reply: Reply = await self.agent.call(epoch, method, *args)
        return reply


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[NodeAgent]:
    backend = LocalProcessBackend(tmp_path / "run")
    await backend.start()

    async def opened() -> SandboxBackend:
        return backend

    agent = NodeAgent(opened, ExecLimits(max_files_bytes=1 << 20), NodeHardware(cores=(0,), memory_mb=64,
                                                                                  numa=((0,),)),
                      channel_path=tmp_path / "agents" / "n1.agent.sock", channel_address="127.0.0.1")
    yield agent
    await agent.close()
    await backend.reap("-")  # the sandboxes the tests made, their executors with them


def route_to(ray: RayStandIn, mode: ChannelMode = "auto") -> AgentRoute:
    return AgentRoute(ray, "node n1's agent", NODE_UNAVAILABLE, REPLY_LIMIT, mode)


async def a_sandbox(route: AgentRoute, env_id: str = "env-1") -> AgentSandbox:
    async def call(method: str, *args: Any) -> Reply:
        return await route.send(None, method, args)

    spec = SandboxSpec(env_id=env_id, task="t", trajectory=None, image="i", memory_mb=64, pids_limit=64)
    return AgentSandbox(call, env_id, answer(await call("create", spec)), "n1")


async def test_calls_go_over_the_channel_once_it_is_known(agent: NodeAgent, tmp_path: Path) -> None:
    ray = RayStandIn(agent)
    route = route_to(ray)
    sandbox = await a_sandbox(route)  # through Ray, while the channel opens beside it
    await until(lambda: route.channel)
    executed = await asyncio.gather(*(sandbox.execute(f"a{i}", ExecRequest(f"echo {i}", timeout_s=30))
                                      for i in range(4)))  # at once: each on a connection of its own
    assert [e.result.stdout for e in executed] == [f"{i}\n" for i in range(4)]
    assert ray.methods == ["create", "channel"]  # after the first call, Ray carried only where the channel is
    assert route.channel == str(tmp_path / "agents" / "n1.agent.sock")
    socket_mode = os.stat(route.channel).st_mode
    assert stat.S_ISSOCK(socket_mode) and stat.S_IMODE(socket_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "agents").st_mode) == 0o700
    route.close()


async def test_calls_go_over_tls_to_an_agent_on_another_host(agent: NodeAgent,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("managers.remote.broker.agent_route.host_identity", lambda: "another-boot-id")
    ray = RayStandIn(agent)
    route = route_to(ray)
    sandbox = await a_sandbox(route)
    channel = await until(lambda: route.channel)
    executed = await asyncio.gather(*(sandbox.execute(f"a{i}", ExecRequest(f"echo {i}", timeout_s=30))
                                      for i in range(4)))  # at once: each on a connection of its own
    assert [e.result.stdout for e in executed] == [f"{i}\n" for i in range(4)]
    assert ray.methods == ["create", "channel"]
    assert channel.startswith("tls://127.0.0.1:")
    route.close()


async def test_a_socket_out_of_reach_on_the_same_host_gives_way_to_tls(agent: NodeAgent) -> None:
    """A broker in another container of the agent's host: the same kernel (boot id), so the agent offers its unix
    socket, at a path the broker's filesystem does not have; the route asks again for TLS."""

    class OtherContainer(RayStandIn):
        async def __call__(self, epoch: int | None, method: str, args: tuple[Any, ...]) -> Reply:
            reply = await super().__call__(epoch, method, args)
            if method == "channel" and reply["ok"] and "path" in reply["ok"]:
                return {"ok": {**reply["ok"], "path": "/nonexistent/agent.sock"}}
            return reply

    ray = OtherContainer(agent)
    route = route_to(ray)
    assert "ok" in await route.send(None, "describe", ())
    assert (await until(lambda: route.channel)).startswith("tls://127.0.0.1:")
    assert "ok" in await route.send(None, "describe", ())
    assert ray.methods == ["describe", "channel", "channel"]  # the socket, then TLS; the second call over TLS
    route.close()


@pytest.mark.parametrize("mode", ["auto", "tls"])
async def test_the_channel_keeps_the_agents_fencing(agent: NodeAgent, mode: ChannelMode) -> None:
    ray = RayStandIn(agent)
    route = route_to(ray, mode)
    assert "ok" in await route.send(7, "describe", ())  # through Ray, as the channel opens
    assert (await until(lambda: route.channel)).startswith("tls://") == (mode == "tls")
    refused = await route.send(6, "describe", ())  # an older leader, over the channel too
    assert refused["error"]["code"] == DEPOSED and ray.methods == ["describe", "channel"]
    route.close()


async def test_with_mode_ray_or_no_channel_served_every_call_goes_through_ray(agent: NodeAgent, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    ray = RayStandIn(agent)
    off = route_to(ray, "ray")
    for _ in range(2):
        assert "ok" in await off.send(None, "describe", ())
    assert ray.methods == ["describe", "describe"] and off.channel is None

    # an agent that serves no TLS, asked from another host: no channel, and the question is not asked at every call
    monkeypatch.setattr("managers.remote.broker.agent_route.host_identity", lambda: "another-boot-id")
    local_only = NodeAgent(agent._open_backend, ExecLimits(), NodeHardware(cores=(0,), memory_mb=64, numa=((0,),)),
                           channel_path=tmp_path / "agents" / "n2.agent.sock")
    ray = RayStandIn(local_only)
    elsewhere = route_to(ray)
    for _ in range(3):
        assert "ok" in await elsewhere.send(None, "describe", ())
        await asyncio.sleep(0.05)  # time for the question beside it
    assert ray.methods == ["describe", "channel", "describe", "describe"] and elsewhere.channel is None
    await local_only.close()


async def test_a_channel_that_cannot_be_reached_costs_the_calls_nothing(agent: NodeAgent, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A TLS listener behind a firewall (here: a port whose TCP backlog takes the connection and nobody ever answers
    the handshake): the calls go through Ray while the attempt waits out its timeout, and after it the route waits
    ``RETRY_S`` before it asks again, twice that after the next failure."""
    monkeypatch.setattr("managers.remote.broker.channel_client.CONNECT_TIMEOUT_S", 3.0)
    silent = socket.create_server(("127.0.0.1", 0))  # listens, never accepts
    hidden = {"address": "127.0.0.1", "port": silent.getsockname()[1], "token": os.urandom(TOKEN_BYTES),
              "certificate": server_context("127.0.0.1", tmp_path)[1]}

    class Firewalled(RayStandIn):
        async def __call__(self, epoch: int | None, method: str, args: tuple[Any, ...]) -> Reply:
            if method == "channel":
                self.methods.append(method)
                return {"ok": hidden}
            return await super().__call__(epoch, method, args)

    ray = Firewalled(agent)
    route = route_to(ray)
    assert "ok" in await route.send(None, "describe", ())  # the channel is looked for beside this call
    await until(lambda: "channel" in ray.methods)  # and is being connected to now
    for _ in range(5):  # each answered through Ray while the connection attempt waits
        assert "ok" in await route.send(None, "describe", ())
    assert route._opening is not None and route.channel is None
    await until(lambda: route._opening is None)  # it gave up
    for _ in range(3):
        assert "ok" in await route.send(None, "describe", ())
    assert sorted(ray.methods) == ["channel"] + ["describe"] * 9  # asked once: the next ask is RETRY_S away
    assert route._ask_at - time.monotonic() > RETRY_S - 5 and route._retry_s == 2 * RETRY_S
    route.close()
    silent.close()


async def test_a_channel_that_cannot_be_reached_sends_through_ray_instead(agent: NodeAgent, tmp_path: Path) -> None:
    ray = RayStandIn(agent)
    route = route_to(ray)
    sandbox = await a_sandbox(route)
    route._client = ChannelClient.unix(str(tmp_path / "gone.sock"), os.urandom(TOKEN_BYTES), REPLY_LIMIT)  # gone
    ray.methods.clear()
    executed = await sandbox.execute("a1", ExecRequest("echo through-ray", timeout_s=30))
    assert executed.result.stdout == "through-ray\n"
    assert ray.methods == ["execute"] and route.channel is None  # sent once, through Ray; asked for again later


async def test_a_call_lost_in_transit_answers_as_ray_says_the_agent_is(tmp_path: Path) -> None:
    """An agent whose socket takes the call and closes (it died with the call): the route does not send the call
    again; it answers with Ray's word on the agent, here that it died for good."""
    path = tmp_path / "a.sock"
    token = os.urandom(TOKEN_BYTES)
    received: list[int] = []

    async def dies_mid_call(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert await reader.readexactly(TOKEN_BYTES) == token
        writer.write(ACCEPTED)
        (length,) = struct.unpack(">Q", await reader.readexactly(8))
        received.append(length)
        await reader.readexactly(length)
        writer.close()

    server = await asyncio.start_unix_server(dies_mid_call, path)
    ray = RayStandIn(agent=None, dead=True)  # type: ignore[arg-type]
    route = route_to(ray)
    route._client = ChannelClient.unix(str(path), token, REPLY_LIMIT)  # as if it had asked
    reply = await route.send(None, "execute", ("env-1", "a1", ExecRequest("true")))
    assert reply["error"]["code"] == "node_lost" and reply["error"]["lost"]
    assert len(received) == 1 and ray.methods == ["channel"]  # sent once; Ray was only asked how the agent is
    ray.dead = False
    ray.methods.clear()

    async def restarting(epoch: int | None, method: str, args: tuple[Any, ...]) -> Reply:
        ray.methods.append(method)
        return {"ok": None}  # alive over Ray (restarted): the call may be tried again

    route = AgentRoute(restarting, "node n1's agent", NODE_UNAVAILABLE, REPLY_LIMIT, "auto")
    route._client = ChannelClient.unix(str(path), token, REPLY_LIMIT)
    reply = await route.send(None, "execute", ("env-1", "a1", ExecRequest("true")))
    assert reply["error"]["code"] == NODE_UNAVAILABLE and not reply["error"]["lost"]
    assert len(received) == 2 and ray.methods == ["channel"]
    server.close()


async def test_the_agent_refuses_a_wrong_token_and_an_oversized_frame(agent: NodeAgent) -> None:
    where = answer(await agent.call(None, "channel", host_identity(), False))
    wrong = ChannelClient.unix(where["path"], bytes(TOKEN_BYTES), REPLY_LIMIT)
    with pytest.raises(ChannelUnreachable, match="token"):
        await wrong.call(None, "describe", ())

    reader, writer = await asyncio.open_unix_connection(where["path"])
    writer.write(where["token"])
    assert await reader.readexactly(1) == ACCEPTED
    writer.write(struct.pack(">Q", 1 << 40))  # a terabyte announced: closed unread
    assert await reader.read() == b""
    writer.close()

    right = ChannelClient.unix(where["path"], where["token"], REPLY_LIMIT)
    assert "ok" in await right.call(None, "describe", ())  # the agent still serves
    big = frame((None, "describe", (b"x" * (6 << 20),)))  # past the request bound (1 MiB files + stdin + slack)
    reader, writer = await asyncio.open_unix_connection(where["path"])
    writer.write(where["token"] + big)
    assert await reader.readexactly(1) == ACCEPTED
    assert await reader.read() == b""
    writer.close()
    right.close()


async def test_over_tls_only_the_agents_certificate_and_token_are_accepted(agent: NodeAgent, tmp_path: Path) -> None:
    where = answer(await agent.call(None, "channel", host_identity(), True))
    address, port, certificate, token = where["address"], where["port"], where["certificate"], where["token"]
    right = ChannelClient.tls(address, port, certificate, token, REPLY_LIMIT)
    assert "ok" in await right.call(None, "describe", ())

    # a broker that pins another certificate (someone else listens there) does not connect, and sends nothing
    _, another = server_context("127.0.0.1", tmp_path)
    with pytest.raises(ChannelUnreachable, match="certificate verify failed"):
        await ChannelClient.tls(address, port, another, token, REPLY_LIMIT).call(None, "describe", ())
    with pytest.raises(ChannelUnreachable, match="token"):
        await ChannelClient.tls(address, port, certificate, bytes(TOKEN_BYTES), REPLY_LIMIT).call(None, "describe", ())

    # the token in the clear (no TLS) is no handshake: the agent closes without a word
    reader, writer = await asyncio.open_connection(address, port)
    writer.write(token)
    assert await reader.read() == b""
    writer.close()
    assert "ok" in await right.call(None, "describe", ())  # the agent still serves
    right.close()


async def test_connections_that_withhold_the_token_are_bounded(agent: NodeAgent,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``UNAUTHENTICATED_LIMIT`` connections that have not sent the token, a new one is closed at once; one
    that sends it late is closed at its timeout, which frees its slot."""
    monkeypatch.setattr("managers.remote.node.channel_server.UNAUTHENTICATED_LIMIT", 2)
    monkeypatch.setattr("managers.remote.node.channel_server.TOKEN_TIMEOUT_S", 1.0)
    where = answer(await agent.call(None, "channel", host_identity(), True))
    address, port, certificate, token = where["address"], where["port"], where["certificate"], where["token"]
    silent = [await asyncio.open_connection(address, port, ssl=client_context(certificate)) for _ in range(2)]
    await asyncio.sleep(0.2)  # both are waiting for their tokens
    with pytest.raises(ChannelUnreachable, match="token"):
        await ChannelClient.tls(address, port, certificate, token, REPLY_LIMIT).call(None, "describe", ())
    for reader, writer in silent:  # closed by the agent when their time was up
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    client = ChannelClient.tls(address, port, certificate, token, REPLY_LIMIT)
    assert "ok" in await client.call(None, "describe", ())
    client.close()


async def test_a_directory_the_channel_made_goes_with_it_and_one_it_found_stays(tmp_path: Path) -> None:
    async def entry(epoch: int | None, method: str, *args: Any) -> Reply:
        return {"ok": method}

    made = ChannelServer(entry, tmp_path / "fresh" / "agent.sock", REPLY_LIMIT)
    await made.start_unix()
    await made.start_tls("127.0.0.1")
    assert stat.S_IMODE(os.stat(tmp_path / "fresh").st_mode) == 0o700
    assert os.listdir(tmp_path / "fresh") == ["agent.sock"]  # the TLS key was there only while it loaded
    await made.close()
    assert not (tmp_path / "fresh").exists()

    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "n1.agent-epoch").write_text("3")
    found = ChannelServer(entry, tmp_path / "shared" / "n1.agent.sock", REPLY_LIMIT)
    await found.start_unix()
    await found.close()
    assert os.listdir(tmp_path / "shared") == ["n1.agent-epoch"]
