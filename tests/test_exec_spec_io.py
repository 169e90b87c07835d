"""Issue 38, item 2: an exec spec's ``run_timeout_s`` (the command's own run, beside ``timeout_s``, the deadline from
submission), ``stdin`` (text or base64, capped) and ``user`` (who one command runs as) — from the spec's checks
through the executor to a broker on local processes and on Docker."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest

from managers.cpu.exec_spec import ExecLimits, parse_exec_spec
from sandboxes import executor as ex
from sandboxes.exec_wire import ExecRequest
from tangram.core.errors import BadRequest, TooLarge, Unprocessable
from tests.docker_nodes import cpu_config, docker_engines, local_cpu
from tests.harness import live_broker
from tests.test_cpu_docker import exec_action, run

BINARY = bytes(range(256)) * 4


# -- the spec --------------------------------------------------------------------------------------------------


def test_the_spec_takes_stdin_as_text_or_base64_within_its_cap() -> None:
    limits = ExecLimits(max_stdin_bytes=4)
    assert parse_exec_spec({"command": "cat", "stdin": "héj"}, limits).stdin == "héj".encode()
    encoded = base64.b64encode(b"\x00\xff\x01").decode()
    assert parse_exec_spec({"command": "cat", "stdin": {"base64": encoded}}, limits).stdin == b"\x00\xff\x01"
    assert parse_exec_spec({"command": "cat"}, limits).stdin is None
    with pytest.raises(TooLarge) as over:
        parse_exec_spec({"command": "cat", "stdin": "12345"}, limits)
    assert over.value.field == "spec.stdin"
    with pytest.raises(BadRequest) as bad:
        parse_exec_spec({"command": "cat", "stdin": {"base64": "not base64!"}}, limits)
    assert bad.value.field.startswith("spec.stdin")
    with pytest.raises(Unprocessable) as background:
        parse_exec_spec({"command": "cat", "stdin": "x", "background": True}, limits)
    assert background.value.field == "spec.stdin"


def test_the_spec_takes_a_run_timeout_and_a_user_in_their_forms() -> None:
    limits = ExecLimits()
    spec = parse_exec_spec({"command": "true", "run_timeout_s": 2.5, "user": "nobody"}, limits)
    assert (spec.run_timeout_s, spec.user) == (2.5, "nobody")
    assert parse_exec_spec({"command": "true", "user": 1234}, limits).user == 1234
    assert parse_exec_spec({"command": "true", "user": "12:34"}, limits).user == "12:34"
    for bad, field in (({"run_timeout_s": 0}, "spec.run_timeout_s"), ({"run_timeout_s": "1"}, "spec.run_timeout_s"),
                       ({"user": "a b"}, "spec.user"), ({"user": -1}, "spec.user"), ({"user": True}, "spec.user"),
                       ({"user": "1:2:3"}, "spec.user")):
        with pytest.raises(BadRequest) as error:
            parse_exec_spec({"command": "true", **bad}, limits)
        assert error.value.field == field, (bad, error.value)


def test_the_wire_carries_stdin_as_base64_and_the_user() -> None:
    wire = ExecRequest(command="cat", stdin=BINARY, user="nobody").to_wire()
    assert base64.b64decode(wire["stdin"]) == BINARY and wire["user"] == "nobody"
    assert "stdin" not in ExecRequest(command="cat").to_wire()


# -- the executor ----------------------------------------------------------------------------------------------


def run_in_executor(command: str | list[str], **fields: Any) -> dict[str, Any]:
    return ex.handle_request({"op": "run", "command": command, "timeout_s": 20, **fields})


def test_the_executor_feeds_stdin_and_closes_it() -> None:
    answer = run_in_executor("cat", stdin=base64.b64encode(b"hello\n").decode())
    assert (answer["error"], answer["stdout"]) == (None, "hello\n")
    binary = run_in_executor(["python3", "-c", "import sys; sys.stdout.write(sys.stdin.buffer.read().hex())"],
                             stdin=base64.b64encode(BINARY).decode())
    assert bytes.fromhex(binary["stdout"]) == BINARY
    assert run_in_executor("cat")["stdout"] == ""  # no stdin: /dev/null, read to its end at once


def test_stdin_past_the_pipe_buffer_neither_deadlocks_nor_outgrows_the_output_cap() -> None:
    big = bytes(4 << 20)
    answer = run_in_executor("cat", stdin=base64.b64encode(big).decode(), output_limit=1000)
    assert answer["stdout_bytes"] == len(big) and len(answer["stdout"]) == 1000 and answer["stdout_truncated"]
    # a command that never reads its input still ends (the rest is dropped at EPIPE)
    assert run_in_executor("exit 3", stdin=base64.b64encode(big).decode())["exit_code"] == 3


def test_the_executor_refuses_bad_stdin_and_stdin_for_a_background_run() -> None:
    assert run_in_executor("cat", stdin="%%%")["error"] == "stdin: is not valid base64"
    answer = run_in_executor("cat", stdin="eA==", background=True)
    assert answer["error"].startswith("stdin:")


def test_the_executor_runs_a_command_as_another_user_only_with_the_capabilities(
        monkeypatch: pytest.MonkeyPatch) -> None:
    if not ex._can_switch_users():
        pytest.skip("needs CAP_SETUID and CAP_SETGID")
    assert run_in_executor("id -u; id -g", user="nobody")["stdout"].split()[0] == "65534"
    assert run_in_executor("id -u; id -g", user="1234:4321")["stdout"].split() == ["1234", "4321"]
    assert run_in_executor("id -u; id -g", user=1234)["stdout"].split() == ["1234", "1234"]
    assert run_in_executor("id -u", user="no-such-user")["error"] == \
        "user: no user 'no-such-user' in the sandbox's /etc/passwd"
    monkeypatch.setattr(ex, "_can_switch_users", lambda: False)  # as in a Docker sandbox, root's dropped too
    assert run_in_executor("id -u", user=0)["stdout"] == "0\n"  # its own ids: nothing to switch
    assert run_in_executor("true", user="nobody")["error"] == (
        "user: the sandbox runs as 0:0 without the capabilities to change users (CAP_SETUID, CAP_SETGID), and "
        "cannot run a command as 65534:65534")


# -- a broker on local processes (one core) ----------------------------------------------------------------------


@pytest.mark.slow  # seconds: left out of the fast lane
async def test_run_timeout_counts_the_run_only_and_says_which_limit_fired(tmp_path, run_dir: str) -> None:
    """Under a queue held busy (the one core taken by another trajectory's long command), an action with a short
    ``run_timeout_s`` and a long ``timeout_s`` runs fully after waiting longer than its ``run_timeout_s``."""
    async with live_broker({"cpu": local_cpu(run_dir)}, str(tmp_path / "t.db")) as live:
        _, busy = await live.call("POST", "/v1/actions", json=exec_action("sleep 2.5", trajectory="busy"))
        while (await live.call("GET", f"/v1/actions/{busy['id']}"))[1]["state"] != "running":
            await asyncio.sleep(0.05)
        waited = await run(live, exec_action("sleep 0.3; echo ran", trajectory="short", run_timeout_s=1),
                           timeout_s=30)
        assert waited["state"] == "succeeded" and waited["result"]["stdout"] == "ran\n", waited
        assert waited["started_at"] - waited["submitted_at"] > 1.5  # it waited longer than its run_timeout_s
        killed = await run(live, exec_action("echo begun; sleep 30", trajectory="short", run_timeout_s=0.5),
                           timeout_s=30)
        assert killed["state"] == "timed_out" and killed["error"]["limit"] == "run_timeout_s", killed
        assert "run_timeout_s" in killed["error"]["message"] and killed["error"]["stdout"] == "begun\n"
        # a run_timeout_s longer than what is left of the deadline: the deadline fires
        deadline = await run(live, exec_action("sleep 30", trajectory="short", run_timeout_s=1.9), timeout_s=2)
        assert deadline["state"] == "timed_out" and deadline["error"]["limit"] == "timeout_s", deadline
        status, answer = await live.call("POST", "/v1/actions", json={
            **exec_action("true", run_timeout_s=60), "timeout_s": 10})
        assert (status, answer["error"]["field"]) == (422, "spec.run_timeout_s"), answer


async def test_stdin_reaches_the_command_and_its_cap_is_a_413(tmp_path, run_dir: str) -> None:
    config = local_cpu(run_dir)
    config["limits"] = {"max_stdin_bytes": 2048}
    async with live_broker({"cpu": config}, str(tmp_path / "t.db")) as live:
        record = await run(live, exec_action("cat", stdin="to the command\n"))
        assert record["result"]["stdout"] == "to the command\n", record
        record = await run(live, exec_action("base64 -w0", stdin={"base64": base64.b64encode(BINARY[:1024]).decode()}))
        assert base64.b64decode(record["result"]["stdout"]) == BINARY[:1024], record
        status, answer = await live.call("POST", "/v1/actions", json=exec_action("cat", stdin="x" * 2049))
        assert (status, answer["error"]["field"]) == (413, "spec.stdin"), answer
        status, answer = await live.call("POST", "/v1/actions", json=exec_action("cat", stdin={"base64": "@@"}))
        assert status == 400 and answer["error"]["field"].startswith("spec.stdin"), answer


# -- Docker ------------------------------------------------------------------------------------------------------


async def test_user_in_a_docker_sandbox_names_its_own_user_only(tmp_path) -> None:
    """A Docker sandbox drops every capability, root's too: a command runs as the environment's own user, named
    by its ids or by a name of the image; other ids are a 422 naming spec.user, another or unknown name a clear
    exec_error."""
    engine = docker_engines()[0]
    config = cpu_config({"n1": {"backend": "docker", "engine": engine, "cores": "0-1", "memory_mb": 4096}})
    async with live_broker(config, str(tmp_path / "t.db")) as live:
        record = await run(live, exec_action("id -u; cat", user="root", stdin="in\n", trajectory="as-root",
                                           sandbox_user="root"))
        assert record["state"] == "succeeded" and record["result"]["stdout"] == "0\nin\n", record
        for user in (1000, "1000:1000"):  # the default sandbox user (1000:1000), by its ids
            record = await run(live, exec_action("id -u", user=user, trajectory="plain"))
            assert record["result"]["stdout"] == "1000\n", record
        for user, trajectory in ((1234, "plain"), ("65534:65534", "as-root")):
            status, answer = await live.call("POST", "/v1/actions", json=exec_action("id -u", user=user,
                                                                                   trajectory=trajectory))
            assert (status, answer["error"]["field"]) == (422, "spec.user"), answer
            assert "holds no capability to change users" in answer["error"]["reason"]
        other = await run(live, exec_action("id -u", user="nobody", trajectory="as-root"))
        assert other["state"] == "failed" and other["error"]["code"] == "exec_error", other
        assert other["error"]["message"].startswith("user: the sandbox runs as 0:0 without the capabilities")
        unknown = await run(live, exec_action("id -u", user="no-such-user", trajectory="as-root"))
        assert unknown["state"] == "failed" and unknown["error"]["code"] == "exec_error", unknown
        assert "user: no user 'no-such-user'" in unknown["error"]["message"]
