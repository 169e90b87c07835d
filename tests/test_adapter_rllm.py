"""The rLLM adapter (``tangram_client.adapters.rllm``) through one rollout against a real broker on Docker: the
bash tool's commands (a failing one read as the tool's answer), the agent's file and the task's tests uploaded, and
rLLM's shell-script verifier scoring it from a reward file, as ``rllm/eval/script_evaluator.py`` does. rLLM is not
on the package index, so its ``Sandbox`` protocol is called as its tools and evaluator call it."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from tangram_client.adapters.rllm import CommandFailed, TangramSandbox
from tangram_client.errors import ForbiddenError, UnauthorizedError, UnprocessableError
from tangram_client.sync_client import TangramClient
from tests.adapter_brokers import OTHER, RIGHT, TESTS, TOKEN, WRONG, secured_docker_node
from tests.harness import live_broker

pytestmark = pytest.mark.slow

TASK = "rllm-rl"
#: a task's tests/test.sh in rLLM's (Harbor-compatible) reward contract: the reward in /logs/verifier/reward.txt
TEST_SH = ("#!/bin/bash\npython3 -m pytest -q /tests/test_solution.py\nstatus=$?\n"
           "if [ $status -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"
           "exit $status\n")


@pytest.fixture
def db(tmp_path: Path) -> str:
    return str(tmp_path / "tangram.db")


def safe_exec(sandbox: TangramSandbox, command: str, timeout: float | None = None, user: str | None = None) -> str:
    """What rLLM's ``_safe_exec`` (its bash tool's and setup's call) does: a failure's message is the answer."""
    try:
        return sandbox.exec(command, timeout=timeout, user=user)
    except (RuntimeError, subprocess.CalledProcessError) as error:
        return str(error)


def evaluate(sandbox: TangramSandbox, tests: Path) -> tuple[float, CommandFailed | None]:
    """``ShellScriptEvaluator.evaluate``'s calls: reward dirs, tests to /tests, the script, the reward file."""
    sandbox.exec("mkdir -p /tmp/rllm /logs/verifier && rm -f /logs/verifier/reward.txt", timeout=10)
    sandbox.upload_dir(str(tests), "/tests")
    failed = None
    try:
        sandbox.exec("chmod +x /tests/test.sh && cd /workspace && /tests/test.sh", timeout=60)
    except CommandFailed as error:  # the verifier's non-zero exit is the expected end of an unsolved task
        failed = error
    assert sandbox.exec("test -f /logs/verifier/reward.txt && echo yes || echo no", timeout=10).strip() == "yes"
    return float(sandbox.exec("cat /logs/verifier/reward.txt", timeout=10).strip()), failed


def rollout(url: str, tmp: Path) -> None:
    tests = tmp / "tests"
    tests.mkdir()
    (tests / "test_solution.py").write_text(TESTS)
    (tests / "test.sh").write_text(TEST_SH)
    sandbox = TangramSandbox("task-7-rollout-0", broker_url=url, task=TASK)  # the token from $TANGRAM_TOKEN
    try:
        assert sandbox.is_alive()
        assert sandbox.exec("echo hi; id -u; pwd") == "hi\n0\n/workspace\n"
        answer = safe_exec(sandbox, "ls /no/such/dir")  # the bash tool's answer to a failing command
        assert answer.startswith("Command failed (exit 2) in sandbox task-7-rollout-0: ls /no/such/dir"), answer
        assert "No such file or directory" in answer

        (tmp / "solution.py").write_text(WRONG)
        sandbox.upload_file(str(tmp / "solution.py"), "/workspace/solution.py")  # write_files
        sandbox.upload_file(str(tmp / "solution.py"), "/srv/backup/solution.py")  # outside: a tar on stdin
        assert sandbox.exec("cmp /workspace/solution.py /srv/backup/solution.py && echo same") == "same\n"
        reward, failed = evaluate(sandbox, tests)
        assert reward == 0.0 and failed is not None and failed.exit_code == 1
        assert "1 failed" in failed.stdout and "assert -1 == 5" in failed.stdout

        (tmp / "solution.py").write_text(RIGHT)
        sandbox.upload_file(str(tmp / "solution.py"), "solution.py")
        reward, failed = evaluate(sandbox, tests)
        assert (reward, failed) == (1.0, None)

        timed_out = safe_exec(sandbox, "sleep 20", timeout=1)  # the broker's refusal to go on: an answer too
        assert timed_out.startswith("Command could not run in sandbox task-7-rollout-0: sleep 20"), timed_out
        with pytest.raises(UnprocessableError) as refused:  # a refusal of the configuration: not swallowed
            safe_exec(sandbox, "true", user="1234:1234")  # a Docker sandbox runs as its own user only
        assert refused.value.field == "spec.user" and not isinstance(refused.value, RuntimeError)
    finally:
        sandbox.close()
    assert not sandbox.is_alive()
    with pytest.raises(RuntimeError, match="is closed"):
        sandbox.exec("true")

    # one client shared by sandboxes stays open when they close; a wrong token raises when the sandbox is made
    with TangramClient(url, task=TASK, token=TOKEN) as client:
        for name in ("shared-a", "shared-b"):
            shared = TangramSandbox(name, client=client)
            assert shared.exec("echo $((6 * 7))") == "42\n"
            shared.close()
        assert client.environments() == []
    with pytest.raises(ForbiddenError):
        TangramSandbox("other", broker_url=url, task=TASK, token=OTHER)


async def test_a_rollout_runs_tools_uploads_and_scores_in_one_broker_environment(db, tmp_path, monkeypatch):
    async with live_broker(secured_docker_node(TASK), db) as live:
        monkeypatch.delenv("TANGRAM_TOKEN", raising=False)
        with pytest.raises(UnauthorizedError):
            await asyncio.to_thread(TangramSandbox, "no-token", broker_url=live.url, task=TASK)
        monkeypatch.setenv("TANGRAM_TOKEN", TOKEN)
        # blocking calls, as rLLM makes them, in a thread: the broker runs on this test's loop
        await asyncio.to_thread(rollout, live.url, tmp_path)
