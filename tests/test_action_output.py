"""Streaming output (issue 38): ``GET /v1/actions/{id}/output`` shows a running exec action's stdout and stderr as they
come, capped like its record; down from the executor's stream frames, through the manager's buffer, to the client.

Ordering is proven by events, not timings: a command prints a line, then waits for a flag that the test makes only
once the stream showed that line, so the line came before the command could end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from managers.cpu.exec_spec import ExecLimits
from managers.cpu.live_output import MAX_SWITCHES, LiveOutput, LiveOutputs
from managers.cpu.manager import CpuManager
from managers.remote.broker.agent_backend import AgentSandbox, answer
from managers.remote.node.node_agent import NodeAgent
from managers.remote.replies import Reply
from sandboxes.backend import NodeHardware, SandboxBackend, SandboxSpec
from sandboxes.exec_wire import ExecRequest
from sandboxes.executor_answer import BadAnswer
from sandboxes.executor_client import call, wait_ready
from sandboxes.local import LocalProcessBackend
from tangram.core.action import Kind
from tangram_client import AsyncTangramClient, NotFoundError, OutputPiece, TangramClient
from tangram_client.output_stream import read_pieces
from tests.docker_nodes import docker_engines, local_cpu
from tests.harness import Live, live_broker
from tests.test_auth import ADMIN, TOKEN_A, TOKEN_B, bearer, secured
from tests.test_cpu_docker import exec_action, one_node, run
from tests.test_executor import Executor

#: prints a line, waits for the flag file (made by the test once the stream showed the line), prints another
WAITS_FOR_FLAG = "echo first; while [ ! -e {flag} ]; do sleep 0.02; done; echo second >&2; echo third"


@pytest.fixture
def db(tmp_path: Path) -> str:
    return str(tmp_path / "tangram.db")


async def collect(pieces: AsyncIterator[OutputPiece], on_piece: Any = None) -> list[OutputPiece]:
    seen = []
    async for piece in pieces:
        seen.append(piece)
        if on_piece is not None:
            await on_piece(piece)
    return seen


def texts(pieces: list[OutputPiece], stream: str) -> str:
    return "".join(piece.text for piece in pieces if piece.event == stream)


def outputs_of(live: Live) -> LiveOutputs:
    manager = live.broker.executor[Kind.EXEC]
    assert isinstance(manager, CpuManager)
    return manager.outputs


def nothing_left(outputs: LiveOutputs) -> bool:
    """No buffer and no waiting reader is kept once actions ended and their streams went."""
    return not outputs._live and not outputs._waiting


# -- the buffer ---------------------------------------------------------------------------------------------------


async def test_a_late_reader_sees_everything_once_in_order_and_the_cap_holds() -> None:
    live = LiveOutput(limit=10)
    live.add("stdout", b"abc")
    live.add("stderr", b"E1")
    live.add("stdout", b"def")
    early = [piece async for piece in _until_idle(live.follow())]
    assert early == [("stdout", b"abc"), ("stderr", b"E1"), ("stdout", b"def")]
    live.add("stdout", b"0123456789")  # 4 bytes fit
    live.end()
    late = [piece async for piece in live.follow()]
    assert late == [("stdout", b"abc"), ("stderr", b"E1"), ("stdout", b"def0123")]
    assert bytes(live.data["stdout"]) == b"abcdef0123"


async def _until_idle(pieces: AsyncIterator[tuple[str, bytes]]) -> AsyncIterator[tuple[str, bytes]]:
    """What a reader gets before it would wait."""
    while True:
        try:
            yield await asyncio.wait_for(anext(pieces), 0.05)
        except TimeoutError:
            return


async def test_past_max_switches_every_byte_still_streams() -> None:
    live = LiveOutput(limit=1 << 20)
    for i in range(MAX_SWITCHES + 100):
        live.add("stdout" if i % 2 else "stderr", b"x")
    live.end()
    pieces = [piece async for piece in live.follow()]
    assert sum(len(data) for stream, data in pieces if stream == "stdout") == (MAX_SWITCHES + 100) // 2
    assert sum(len(data) for stream, data in pieces if stream == "stderr") == (MAX_SWITCHES + 100) // 2
    assert len(live._order) == MAX_SWITCHES


async def test_a_reader_waiting_for_a_start_that_leaves_keeps_nothing() -> None:
    outputs = LiveOutputs()
    waiting = asyncio.ensure_future(outputs.started("a"))
    await asyncio.sleep(0)
    assert outputs._waiting
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert nothing_left(outputs)
    waiting = asyncio.ensure_future(outputs.started("a"))
    await asyncio.sleep(0)
    live = outputs.open("a", 5)
    assert await waiting is live
    outputs.close("a")
    assert live.ended and nothing_left(outputs)


# -- the executor's stream --------------------------------------------------------------------------------------


async def test_the_executor_streams_output_before_its_answer(tmp_path: Path) -> None:
    executor = Executor(tmp_path)
    flag = tmp_path / "go"
    pieces: list[tuple[str, bytes]] = []

    def sink(stream: str, data: bytes) -> None:
        pieces.append((stream, data))
        if b"first" in data:
            flag.touch()  # the command can end only after this

    try:
        await wait_ready(executor.socket, timeout=10)
        answer = await call(executor.socket, {"op": "run", "command": WAITS_FOR_FLAG.format(flag=flag),
                                              "timeout_s": 30}, on_output=sink)
        assert answer["exit_code"] == 0 and not answer["timed_out"], answer
        assert pieces[0] == ("stdout", b"first\n")
        streamed = {name: b"".join(data for stream, data in pieces if stream == name) for name in ("stdout", "stderr")}
        assert streamed == {"stdout": b"first\nthird\n", "stderr": b"second\n"}
        assert (answer["stdout"], answer["stderr"]) == ("first\nthird\n", "second\n")
        # capped: the stream carries what the answer keeps, never more
        pieces.clear()
        answer = await call(executor.socket, {"op": "run", "output_limit": 1000, "command":
                                              "head -c 100000 /dev/zero | tr '\\0' a; head -c 5000 /dev/zero >&2"},
                            on_output=sink)
        assert sum(len(data) for stream, data in pieces if stream == "stdout") == 1000
        assert sum(len(data) for stream, data in pieces if stream == "stderr") == 1000
        assert answer["stdout_truncated"] and answer["stdout_bytes"] == 100000
        # without a sink nothing is streamed: the answer is the first frame, as before
        assert (await call(executor.socket, {"op": "run", "command": "echo plain"}))["stdout"] == "plain\n"
    finally:
        executor.stop()


async def test_a_stream_past_the_output_limit_is_refused(tmp_path: Path) -> None:
    """An executor is the sandbox's word: one that streams more than the request's output_limit is out of protocol."""
    path = str(tmp_path / "liar.sock")

    async def lie(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(4096)
        body = b'{"stream":"stdout","payload":11}'
        writer.write(len(body).to_bytes(4, "big") + body + b"x" * 11)
        await writer.drain()
        await reader.read()
        writer.close()

    server = await asyncio.start_unix_server(lie, path)
    try:
        with pytest.raises(BadAnswer, match="streamed 11 bytes"):
            await call(path, {"op": "run", "command": "true", "output_limit": 10}, on_output=lambda s, d: None)
    finally:
        server.close()
        await server.wait_closed()


async def test_the_client_parses_events_split_anywhere() -> None:
    body = (b': waiting\n\nevent: stdout\ndata: {"data":"a\\nb"}\n\nevent: stderr\ndata: {"data":"\xc3\xa9"}\n\n'
            b'event: end\ndata: {"id":"x","state":"succeeded","exit_code":0,"error":null}\n\nevent: stdout\n')

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(len(body)):
            yield body[i:i + 1]

    pieces = await collect(read_pieces(chunks()))
    assert [(p.event, p.text) for p in pieces[:2]] == [("stdout", "a\nb"), ("stderr", "é")]
    assert pieces[2].end == {"id": "x", "state": "succeeded", "exit_code": 0, "error": None} and len(pieces) == 3


# -- the route, on local sandboxes ------------------------------------------------------------------------------


def local_config(run_dir: str) -> dict[str, Any]:
    """Local sandboxes beside a lease, an action of another kind."""
    return {"basic": {"lease.x": {"concurrency": 4, "lease_ttl_s": 30.0}}, "cpu": local_cpu(run_dir)}


async def test_local_sandboxes_stream_while_the_command_runs(db: str, run_dir: str) -> None:
    flag = Path(run_dir) / "go"
    async with live_broker(local_config(run_dir), db) as live, AsyncTangramClient(live.url, task="t") as client:
        status, record = await live.call("POST", "/v1/actions", json={**exec_action(WAITS_FOR_FLAG.format(flag=flag)),
                                                                      "timeout_s": 60})
        assert status == 201, record

        async def on_piece(piece: OutputPiece) -> None:
            if "first" in piece.text:
                flag.touch()

        pieces = await collect(client.output(record["id"]), on_piece)
        assert (pieces[0].event, pieces[0].text) == ("stdout", "first\n")
        assert (texts(pieces, "stdout"), texts(pieces, "stderr")) == ("first\nthird\n", "second\n")
        assert pieces[-1].end is not None and pieces[-1].end["state"] == "succeeded"
        assert pieces[-1].end["exit_code"] == 0 and pieces[-1].end["error"] is None
        # an ended action's stream: its record's output, then end
        again = await collect(client.output(record["id"]))
        assert (texts(again, "stdout"), texts(again, "stderr")) == ("first\nthird\n", "second\n")
        assert again[-1].event == "end"
        assert nothing_left(outputs_of(live))

        def blocking() -> list[OutputPiece]:
            with TangramClient(live.url, task="t") as sync:
                return list(sync.output(record["id"]))

        assert await asyncio.to_thread(blocking) == again


@pytest.mark.slow  # a queued action waits for one that sleeps
async def test_a_queued_actions_stream_waits_for_it_to_start(db: str, run_dir: str) -> None:
    async with live_broker(local_config(run_dir), db) as live, AsyncTangramClient(live.url, task="t") as client:
        _, busy = await live.call("POST", "/v1/actions", json=exec_action("sleep 2", trajectory="a"))
        _, queued = await live.call("POST", "/v1/actions", json=exec_action("echo later", trajectory="b"))
        assert (await client.get(queued["id"])).state == "queued"  # the one core is busy
        pieces = await collect(client.output(queued["id"]))
        assert texts(pieces, "stdout") == "later\n"
        assert pieces[-1].end is not None and pieces[-1].end["state"] == "succeeded"
        assert (await client.wait(busy["id"])).succeeded


async def test_unknown_other_tenants_and_non_exec_actions(db: str, run_dir: str) -> None:
    config = {**secured(), **local_config(run_dir)}
    async with live_broker(config, db) as live:
        status, body = await live.call("GET", "/v1/actions/act_nope/output", headers=bearer(TOKEN_A))
        assert (status, body) == (404, {"error": {"field": "id", "reason": "no action 'act_nope'"}})
        _, mine = await live.call("POST", "/v1/actions?wait=true", headers=bearer(TOKEN_A),
                                  json={"kind": "exec", "demand": {"cpu": 1}, "spec": {"command": "echo mine"}})
        status, body = await live.call("GET", f"/v1/actions/{mine['id']}/output", headers=bearer(TOKEN_B))
        assert (status, body["error"]["field"]) == (404, "id")
        status, body = await live.call("GET", f"/v1/actions/{mine['id']}/output", headers=bearer(ADMIN))
        assert status == 200 and "event: stdout\ndata: {\"data\":\"mine\\n\"}" in body and "event: end" in body
        _, lease = await live.call("POST", "/v1/actions", headers=bearer(TOKEN_A),
                                   json={"kind": "lease", "demand": {"lease.x": 1}})
        status, body = await live.call("GET", f"/v1/actions/{lease['id']}/output", headers=bearer(TOKEN_A))
        assert (status, body["error"]["field"]) == (409, "id")
        assert "only exec actions have an output stream" in body["error"]["reason"]
        async with AsyncTangramClient(live.url, task="a", token=TOKEN_A) as client:
            with pytest.raises(NotFoundError):
                await collect(client.output("act_nope"))


# -- the route, on a Docker engine ------------------------------------------------------------------------------


async def open_stream(live: Live, action_id: str) -> tuple[aiohttp.ClientResponse, AsyncIterator[OutputPiece]]:
    response = await live.http.get(f"{live.url}/v1/actions/{action_id}/output")
    assert response.status == 200 and response.content_type == "text/event-stream"
    return response, read_pieces(response.content.iter_any())


@pytest.mark.slow  # sandboxes on a real engine
async def test_docker_streams_while_running_caps_and_survives_a_dropped_stream(db: str) -> None:
    async with live_broker(one_node(docker_engines()[0]), db) as live:
        # the flag is made by a second command of the same trajectory, once the stream showed the first line
        status, record = await live.call("POST", "/v1/actions", json={**exec_action(WAITS_FOR_FLAG.format(flag="go")),
                                                                      "timeout_s": 60})
        assert status == 201, record
        response, pieces = await open_stream(live, record["id"])
        seen = []
        async for piece in pieces:
            seen.append(piece)
            if "first" in piece.text:
                assert (await run(live, exec_action("touch go")))["state"] == "succeeded"
        response.close()
        assert (seen[0].event, seen[0].text) == ("stdout", "first\n")
        assert (texts(seen, "stdout"), texts(seen, "stderr")) == ("first\nthird\n", "second\n")
        assert seen[-1].end is not None and seen[-1].end["state"] == "succeeded"

        # the cap holds on the stream as on the record
        status, capped = await live.call("POST", "/v1/actions", json=exec_action(
            "head -c 100000 /dev/zero | tr '\\0' a; head -c 3000 /dev/zero | tr '\\0' b >&2", output_limit=1000))
        response, pieces = await open_stream(live, capped["id"])
        seen = await collect(pieces)
        response.close()
        assert (texts(seen, "stdout"), texts(seen, "stderr")) == ("a" * 1000, "b" * 1000)
        record = (await live.call("GET", f"/v1/actions/{capped['id']}"))[1]
        assert record["result"]["stdout"] == "a" * 1000 and record["result"]["stdout_truncated"] is True

        # a client that drops its stream cancels nothing: the command runs to its end
        status, dropped = await live.call("POST", "/v1/actions", json={**exec_action(
            "echo one; while [ ! -e go2 ]; do sleep 0.02; done; echo two"), "timeout_s": 60})
        response, pieces = await open_stream(live, dropped["id"])
        first = await anext(pieces)
        assert (first.event, first.text) == ("stdout", "one\n")
        response.close()
        assert (await run(live, exec_action("touch go2")))["state"] == "succeeded"
        status, done = await live.call("GET", f"/v1/actions/{dropped['id']}?wait=true")
        assert done["state"] == "succeeded" and done["result"]["stdout"] == "one\ntwo\n", done
        for _ in range(100):  # the dropped stream's handler notices on its next write or wake
            if nothing_left(outputs_of(live)):
                break
            await asyncio.sleep(0.05)
        assert nothing_left(outputs_of(live))


@pytest.mark.slow  # sandboxes on a real engine
async def test_the_engine_path_streams_the_output_at_the_end(db: str) -> None:
    """Without the fast path each command is a one-shot ``docker exec`` that answers once: the stream shows nothing
    until the end, then the record's output (as for an executor from an older broker)."""
    async with live_broker(one_node(docker_engines()[1], fast_path=False), db) as live:
        _, record = await live.call("POST", "/v1/actions", json=exec_action("echo a; sleep 0.3; echo b >&2"))
        response, pieces = await open_stream(live, record["id"])
        seen = await collect(pieces)
        response.close()
        assert [(p.event, p.text) for p in seen[:-1]] == [("stdout", "a\n"), ("stderr", "b\n")]
        assert seen[-1].end is not None and seen[-1].end["state"] == "succeeded"


async def test_a_node_agent_streams_the_output_while_the_command_runs(tmp_path: Path) -> None:
    """The agent path without Ray: the broker's ``AgentSandbox`` polls ``NodeAgent.output`` while the output is
    watched, local processes behind the agent. The command waits for a flag made once its first line came through, so
    nothing but output fetched while it runs ends it; unwatched, the output comes with the answer, in no poll."""
    backend = LocalProcessBackend(tmp_path / "run")
    await backend.start()

    async def opened() -> SandboxBackend:
        return backend

    agent = NodeAgent(opened, ExecLimits(), NodeHardware(cores=(0,), memory_mb=64, numa=((0,),)))
    calls: list[str] = []

    async def call(method: str, *args: Any) -> Reply:
        calls.append(method)
        reply: Reply = await getattr(agent, method)(*args)
        return reply

    spec = SandboxSpec(env_id="env-stream", task="t", trajectory=None, image="i", memory_mb=64, pids_limit=64)
    sandbox = AgentSandbox(call, spec.env_id, answer(await agent.create(spec)), "n1")
    flag = Path(sandbox.workdir) / "go"
    live = LiveOutput(1 << 20)

    async def watch() -> list[tuple[str, bytes]]:
        seen = []
        async for stream, data in live.follow():
            seen.append((stream, data))
            if b"first" in data:
                flag.touch()
        return seen

    try:
        watching = asyncio.create_task(watch())
        await asyncio.sleep(0)  # the reader is there before the command starts
        request = ExecRequest(WAITS_FOR_FLAG.format(flag=flag), timeout_s=30)
        executed = await asyncio.wait_for(sandbox.execute("a1", request, live), 60)
        live.end()
        seen = await watching
        assert executed.result.exit_code == 0 and not executed.result.timed_out, executed
        assert seen[0] == ("stdout", b"first\n") and "output" in calls
        assert b"".join(data for name, data in seen if name == "stdout") == b"first\nthird\n"
        assert b"".join(data for name, data in seen if name == "stderr") == b"second\n"
        assert (executed.result.stdout, executed.result.stderr) == ("first\nthird\n", "second\n")
        calls.clear()
        unwatched = LiveOutput(1 << 20)
        executed = await sandbox.execute("a2", ExecRequest("sleep 0.6; echo x", timeout_s=30), unwatched)
        assert calls == ["execute"] and bytes(unwatched.data["stdout"]) == b"x\n" == executed.result.stdout.encode()
        assert await call("output", spec.env_id, "a2", {}) == {"ok": None}  # nothing kept once it answered
    finally:
        await sandbox.destroy()
