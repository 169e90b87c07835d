"""The executor's protocol version (issue 38): a sandbox adopted from an older broker keeps that broker's executor,
which would ignore what it does not know (stdin, user, background, the runner, file ops) and run the command
otherwise than asked. The broker learns each adopted executor's protocol from its ping and refuses such requests by
name instead. On a real engine, on the fast path and the engine path."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from sandboxes.backend import SandboxError, SandboxSpec
from sandboxes.docker import DockerBackend, DockerSandbox
from sandboxes.exec_wire import ExecRequest
from sandboxes.executor import PROTOCOL_VERSION
from sandboxes.image import DEFAULT_IMAGE
from tests.docker_nodes import docker_engines, new_broker_id

RUN_DIR = Path("/run/tangram/test-sandboxes")


def test_the_requests_that_need_protocol_2() -> None:
    assert ExecRequest("true").protocol() == 1
    for newer in (ExecRequest("cat", stdin=b"x"), ExecRequest("id", user=0), ExecRequest("sleep 9", background=True),
                  ExecRequest("pytest", pytest_runner=True)):
        assert newer.protocol() == 2 <= PROTOCOL_VERSION


@pytest.mark.parametrize("path", ["fast", "engine"])
async def test_an_adopted_executor_is_asked_its_protocol_and_an_older_one_is_refused_by_name(path: str) -> None:
    engine = docker_engines()[0 if path == "fast" else 1]
    broker_id = new_broker_id()
    made = DockerBackend(engine, run_dir=RUN_DIR / broker_id, cores=(0,), fast_path=path == "fast")
    adopter = DockerBackend(engine, run_dir=RUN_DIR / broker_id, cores=(0,), fast_path=path == "fast")
    await made.start()
    await adopter.start()
    spec = SandboxSpec(env_id=f"proto-{random.randrange(10**9)}", task="t", trajectory="a", image=DEFAULT_IMAGE,
                       memory_mb=128, pids_limit=64, broker_id=broker_id)
    sandbox = await made.create(spec)
    try:
        assert isinstance(sandbox, DockerSandbox) and sandbox.protocol == PROTOCOL_VERSION
        (leftover,) = await adopter.adopt(broker_id)
        adopted = leftover.sandbox
        assert isinstance(adopted, DockerSandbox) and adopted.protocol == PROTOCOL_VERSION  # from its ping
        await adopted.set_cores(frozenset({0}))
        assert (await adopted.run(ExecRequest("cat", stdin=b"fed", timeout_s=30))).stdout == "fed"
        adopted.protocol = 1  # what an executor shipped before version 2 answers
        with pytest.raises(SandboxError) as refused:
            await adopted.run(ExecRequest("cat", stdin=b"fed", timeout_s=30))
        assert refused.value.code == "executor_outdated" and "stdin" in refused.value.message
        with pytest.raises(SandboxError) as refused:
            await adopted.exchange({"op": "read", "path": "x"})
        assert refused.value.code == "executor_outdated" and "file operations" in refused.value.message
        assert (await adopted.run(ExecRequest("echo plain", timeout_s=30))).stdout == "plain\n"  # protocol 1 is enough
    finally:
        await sandbox.destroy()
        await made.close()
        await adopter.close()
