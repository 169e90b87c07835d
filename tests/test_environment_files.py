"""An environment's files at any time (issue 38): ``PUT``/``GET /v1/environments/{id}/files`` on a real Docker
engine, through the executor in the sandbox; and ``files`` on a later exec action, written before its command."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import tarfile
import time
from typing import Any

import pytest

from managers.cpu.exec_spec import ExecLimits
from managers.cpu.turns import Turns
from managers.remote.broker.agent_backend import AgentSandbox, answer
from managers.remote.node.node_agent import NodeAgent
from managers.remote.replies import Reply
from sandboxes import executor_files
from sandboxes.backend import NodeHardware, SandboxBackend, SandboxError, SandboxSpec
from sandboxes.file_wire import FileData, ReadFile, WriteFiles, Written
from sandboxes.local import LocalProcessBackend
from tests.docker_nodes import docker_engines
from tests.harness import Live, live_broker
from tests.test_cpu_docker import exec_action, one_node, run

MIB = 1 << 20


@pytest.fixture
def db(tmp_path):
    return str(tmp_path / "tangram.db")


def host_passwd() -> bytes:
    with open("/etc/passwd", "rb") as host:
        return host.read()


async def raw_call(live: Live, method: str, path: str, **kwargs: Any) -> tuple[int, str, bytes]:
    async with live.http.request(method, live.url + path, **kwargs) as response:
        return response.status, response.content_type, await response.read()


async def new_environment(live: Live) -> str:
    status, env = await live.call("POST", "/v1/environments", json={"task": "t", "memory_mb": 256})
    assert status == 201, env
    return str(env["id"])


def tar_of(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, None if data is None else io.BytesIO(data))
    return buffer.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname = kind, mode, link
    return info


async def test_write_and_read_back_files_a_binary_and_directories_as_tar(db):
    blob = os.urandom(MIB)
    async with live_broker(one_node(docker_engines()[0]), db) as live:
        env = await new_environment(live)
        files = f"/v1/environments/{env}/files"
        status, body = await live.call("PUT", files, json={"files": {
            "notes.txt": "hello", "data/blob.bin": {"base64": base64.b64encode(blob).decode()}}})
        assert (status, body) == (200, {"environment": env, "files": 2, "bytes": 5 + MIB}), body
        assert await raw_call(live, "GET", files, params={"path": "notes.txt"}) == (
            200, "application/octet-stream", b"hello")
        assert (await raw_call(live, "GET", files, params={"path": "./data/blob.bin"}))[2] == blob
        status, kind, data = await raw_call(live, "GET", files, params={"path": "data"})
        assert (status, kind) == (200, "application/x-tar")
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            extracted = tar.extractfile("./blob.bin")
            assert extracted is not None and extracted.read() == blob
        status, kind, data = await raw_call(live, "GET", files, params={"path": "."})
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            assert {"./notes.txt", "./data", "./data/blob.bin"} <= set(tar.getnames())
        # a tar stream: directories and files with their modes, an existing file replaced; owned by the sandbox user
        upload = tar_of([(member("./", tarfile.DIRTYPE, 0o755), None), (member("bin", tarfile.DIRTYPE, 0o700), None),
                         (member("bin/run.sh", mode=0o755), b"#!/bin/sh\necho ran\n"),
                         (member("notes.txt"), b"replaced")])
        status, body = await live.call("PUT", files, data=upload, headers={"content-type": "application/x-tar"})
        assert (status, body["files"]) == (200, 2), body
        record = await run(live, exec_action("bin/run.sh; cat notes.txt; stat -c '%a %u' bin bin/run.sh",
                                             trajectory=None, environment=env))
        assert record["result"]["stdout"].split("\n") == ["ran", "replaced700 1000", "755 1000", ""], record


async def test_links_fifos_bad_paths_and_sizes_are_refused(db):
    config = one_node(docker_engines()[0])
    config["cpu"]["limits"] = {"max_files_bytes": 4096, "max_files": 5}
    before = host_passwd()
    async with live_broker(config, db) as live:
        env = await new_environment(live)
        files = f"/v1/environments/{env}/files"
        made = await run(live, exec_action("ln -s /etc/passwd pw; ln -s .. up; ln -s /etc etc; mkfifo fifo; "
                                           "mkdir d; head -c 5000 /dev/zero > big; ln -s notes.txt inside; "
                                           "head -c 3000 /dev/zero > d/a; head -c 3000 /dev/zero > d/b",
                                           trajectory=None, environment=env))
        assert made["result"]["exit_code"] == 0, made
        reads = [("pw", 422, "file_outside"), ("up/x", 422, "file_outside"), ("etc/passwd", 422, "file_outside"),
                 ("fifo", 422, "file_type"), ("big", 413, "file_too_large"), ("d", 413, "file_too_large"),
                 ("missing", 404, "file_not_found"), ("/etc/passwd", 422, None), ("../x", 422, None),
                 ("", 422, None)]
        for path, expected, code in reads:
            status, answer = await live.call("GET", files, params={"path": path})
            assert (status, answer["error"]["field"], answer["error"].get("code")) == (expected, "path", code), \
                (path, answer)
        writes: list[tuple[dict[str, Any], int, str]] = [
            ({"pw": "owned"}, 422, "files"), ({"etc/evil": "x"}, 422, "files"), ({"up/evil": "x"}, 422, "files"),
            ({"fifo": "x"}, 422, "files"), ({"d": "x"}, 422, "files"), ({"../x": "x"}, 422, "files.../x"),
            ({"/abs": "x"}, 400, "files./abs"), ({"x": "y" * 5000}, 413, "files"),
            ({str(i): "" for i in range(6)}, 413, "files")]
        for body, expected, field in writes:
            status, answer = await live.call("PUT", files, json={"files": body})
            assert (status, answer["error"]["field"]) == (expected, field), (body, answer)
        status, answer = await live.call("PUT", files, json={"nope": {}})
        assert (status, answer["error"]["field"]) == (400, "files"), answer
        status, answer = await live.call("PUT", files, data=b"x", headers={"content-type": "text/plain"})
        assert (status, answer["error"]["field"]) == (415, "content-type"), answer
        status, answer = await live.call("GET", files)
        assert (status, answer["error"]["field"]) == (400, "path"), answer
        for upload, expected, field in [
                (tar_of([(member("l", tarfile.SYMTYPE, link="/etc/passwd"), None)]), 422, "files.l"),
                (tar_of([(member("../x"), b"x")]), 422, "files.../x"),
                (tar_of([(member("x"), b"y" * 5000)]), 413, "files"), (b"not a tar" * 100, 400, "body")]:
            status, answer = await live.call("PUT", files, data=upload, headers={"content-type": "application/x-tar"})
            assert (status, answer["error"]["field"]) == (expected, field), answer
        for method in ("GET", "PUT"):
            status, answer = await live.call(method, "/v1/environments/env-nope/files", params={"path": "x"},
                                             json={"files": {}})
            assert (status, answer["error"]["field"]) == (404, "id"), answer
        record = await run(live, exec_action("head -c 11 /etc/passwd; ls /etc/evil /evil 2>&1", trajectory=None,
                                             environment=env))
        stdout = record["result"]["stdout"]
        assert stdout.startswith("root:x:0:0:") and stdout.count("No such file") == 2, record  # both untouched
    assert host_passwd() == before


async def test_a_write_waits_for_the_running_command_and_later_exec_files_come_first(db):
    async with live_broker(one_node(docker_engines()[0]), db) as live:
        first = await run(live, exec_action("cat f.txt", trajectory="w", files={"f.txt": "made"}))
        env = first["result"]["environment"]
        status, slow = await live.call("POST", "/v1/actions", json=exec_action("sleep 1.5; cat f.txt",
                                                                               trajectory="w"))
        assert status == 201, slow
        for _ in range(200):
            _, state = await live.call("GET", f"/v1/actions/{slow['id']}")
            if state["state"] == "running":
                break
            await asyncio.sleep(0.02)
        status, body = await live.call("PUT", f"/v1/environments/{env}/files", json={"files": {"f.txt": "late"}})
        written_at = time.time()
        assert status == 200, body
        _, slow = await live.call("GET", f"/v1/actions/{slow['id']}?wait=true")
        assert slow["result"]["stdout"] == "made", slow  # the write waited for the command
        assert written_at >= slow["finished_at"] - 0.05
        later = await run(live, exec_action("cat f.txt g.txt", trajectory="w", files={"f.txt": "a", "g.txt": "b"}))
        assert (later["result"]["stdout"], later["result"]["environment"]) == ("ab", env), later
        status, _ = await live.call("DELETE", f"/v1/environments/{env}")
        assert status == 200


def test_the_executor_keeps_file_ops_inside_its_root(tmp_path):
    """The executor's ops themselves, without a sandbox: links resolved and refused when they lead out, special
    files refused, sizes capped, writes atomic and mode-keeping."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.write_text("keep")
    (root / "out").symlink_to(outside)
    (root / "up").symlink_to(tmp_path)
    os.mkfifo(root / "fifo")

    def write(path: str, data: bytes) -> dict[str, Any]:
        return executor_files.handle({"op": "write", "root": str(root), "files": [{"path": path, "size": len(data)}],
                                      "payload": data})

    def read(path: str, limit: int = 100) -> dict[str, Any]:
        return executor_files.handle({"op": "read", "root": str(root), "path": path, "limit": limit})

    assert write("a/b.txt", b"hi") == {"ok": True, "files": 1, "bytes": 2}
    os.chmod(root / "a" / "b.txt", 0o700)
    assert write("a/b.txt", b"again")["ok"] and (root / "a" / "b.txt").stat().st_mode & 0o777 == 0o700
    assert read("a/b.txt")["payload"] == b"again"
    for path in ("out", "up/outside", "up/new/x", "../x"):
        assert write(path, b"x")["code"] == "file_outside", path
        assert read(path)["code"] in ("file_outside", "file_not_found"), path
    assert outside.read_text() == "keep" and not (tmp_path / "new").exists()
    assert read("fifo")["code"] == "file_type" and write("fifo", b"x")["code"] == "file_type"
    assert read("a/b.txt", limit=3)["code"] == "file_too_large"
    with tarfile.open(fileobj=io.BytesIO(read("a", limit=10240)["payload"])) as tar:
        assert tar.getnames() == [".", "./b.txt"]
    assert read(".", limit=1000)["code"] == "file_too_large"
    assert not [name for name in os.listdir(root / "a") if name.startswith(".tangram-write")]


async def test_a_file_op_waits_for_running_commands_and_commands_after_it_wait_for_it():
    turns = Turns()
    order: list[str] = []

    async def command(name: str, seconds: float) -> None:
        async with turns.command():
            order.append(f"{name} start")
            await asyncio.sleep(seconds)
            order.append(f"{name} end")

    async def file_op() -> None:
        async with turns.alone():
            order.append("file op")

    first = asyncio.create_task(command("first", 0.05))
    await asyncio.sleep(0)
    op = asyncio.create_task(file_op())
    await asyncio.sleep(0)
    second = asyncio.create_task(command("second", 0))
    await asyncio.gather(first, op, second)
    assert order == ["first start", "first end", "file op", "second start", "second end"]
    async with turns.command():  # a file op that waits too long gives up, and leaves no turn behind
        with pytest.raises(TimeoutError):
            async with turns.alone(wait_s=0.01):
                pass
    assert not turns.busy


async def test_file_ops_through_a_node_agent(tmp_path):
    """The agent path without Ray: the broker's ``AgentSandbox`` calls a ``NodeAgent`` on local processes, which
    checks a write's files again and bounds a read, as the API does."""
    backend = LocalProcessBackend(tmp_path / "run")
    await backend.start()

    async def opened() -> SandboxBackend:
        return backend

    agent = NodeAgent(opened, ExecLimits(max_files=2, max_files_bytes=1024),
                      NodeHardware(cores=(0,), memory_mb=64, numa=((0,),)))

    async def call(method: str, *args: Any) -> Reply:
        reply: Reply = await getattr(agent, method)(*args)
        return reply

    spec = SandboxSpec(env_id="env-agent", task="t", trajectory=None, image="i", memory_mb=64, pids_limit=64)
    sandbox = AgentSandbox(call, spec.env_id, answer(await agent.create(spec)), "n1")
    try:
        assert await sandbox.files(WriteFiles({"a/b.txt": b"hello"})) == Written(1, 5)
        assert await sandbox.files(ReadFile("a/b.txt", 1024)) == FileData(False, b"hello")
        with pytest.raises(SandboxError) as refused:
            await sandbox.files(WriteFiles({"../x": b"x"}))
        assert refused.value.code == "file_bad_request" and refused.value.message.startswith("files")
        with pytest.raises(SandboxError) as refused:
            await sandbox.files(ReadFile("a/b.txt", 1 << 20))
        assert refused.value.code == "file_bad_request"
        with pytest.raises(SandboxError) as refused:
            await sandbox.files(ReadFile("nothing", 1024))
        assert refused.value.code == "file_not_found"
    finally:
        await sandbox.destroy()
