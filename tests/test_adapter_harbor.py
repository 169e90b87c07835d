"""The Harbor adapter (``tangram_client.adapters.harbor``) through a trial's steps against a real broker on Docker:
an agent's commands, a task's files uploaded inside and outside the working directory, a verifier run whose reward
file comes back with ``download_dir``, and the environment deleted by ``stop``. Harbor itself needs Python >= 3.12,
so the adapter is driven here as Harbor's trial and verifier call ``BaseEnvironment``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tangram_client.adapters.harbor import TangramEnvironment
from tangram_client.errors import ForbiddenError, UnauthorizedError, UnprocessableError
from tests.adapter_brokers import OTHER, RIGHT, TESTS, TOKEN, WRONG, secured_docker_node
from tests.harness import live_broker

pytestmark = pytest.mark.slow

TASK = "harbor-rl"
#: what a Harbor task's tests/test.sh does: run the tests, write the reward where the verifier downloads it from
TEST_SH = ("#!/bin/bash\ncd /workspace && python3 -m pytest -q /tests/test_solution.py\n"
           "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n")


@pytest.fixture
def db(tmp_path: Path) -> str:
    return str(tmp_path / "tangram.db")


async def verify(environment: TangramEnvironment, tests: Path, out: Path) -> float:
    """Harbor's verifier: upload the tests to /tests, run test.sh as the default user, download /logs/verifier."""
    made = await environment.exec("mkdir -p /logs/verifier && rm -f /logs/verifier/reward.txt", user="root")
    assert made.return_code == 0, made
    await environment.upload_dir(tests, "/tests")
    await environment.exec("chmod +x /tests/test.sh", user="root")
    ran = await environment.exec("/tests/test.sh > /logs/verifier/test-stdout.txt 2>&1")
    assert ran.return_code == 0, ran  # the script records the tests' failure in the reward, and ends well
    await environment.download_dir("/logs/verifier", out)
    return float((out / "reward.txt").read_text())


async def test_a_trial_runs_commands_moves_files_and_scores_in_one_broker_environment(db, tmp_path, monkeypatch):
    monkeypatch.delenv("TANGRAM_TOKEN", raising=False)
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_solution.py").write_text(TESTS)
    (tests / "test.sh").write_text(TEST_SH)
    async with live_broker(secured_docker_node(TASK), db) as live:
        environment = TangramEnvironment(session_id="hello__abc__env", broker_url=live.url, task=TASK, token=TOKEN)
        assert environment.type() == "tangram"
        await environment.start(force_build=False)
        try:
            result = await environment.exec("echo $GREETING from $(pwd); echo oops >&2; exit 3", cwd="/tmp",
                                            env={"GREETING": "hello"}, timeout_sec=30)
            assert (result.stdout, result.stderr, result.return_code) == ("hello from /tmp\n", "oops\n", 3)
            again = await environment.exec("id -u; echo $GREETING; pwd")
            assert again.stdout == "0\n\n/workspace\n"  # root by default, no env carried over, the working dir

            # the agent's solution: a file inside the working directory (write_files) and one outside (stdin)
            (tmp_path / "solution.py").write_text(WRONG)
            await environment.upload_file(tmp_path / "solution.py", "/workspace/solution.py")
            await environment.upload_file(str(tmp_path / "solution.py"), "/opt/agent/copy.py")
            listing = await environment.exec("cat /workspace/solution.py /opt/agent/copy.py | grep -c return")
            assert listing.stdout == "2\n"

            assert await verify(environment, tests, tmp_path / "run1") == 0.0
            log = (tmp_path / "run1" / "test-stdout.txt").read_text()
            assert "1 failed" in log and "assert -1 == 5" in log

            (tmp_path / "solution.py").write_text(RIGHT)
            await environment.upload_file(tmp_path / "solution.py", "solution.py")  # relative: the working dir
            assert await verify(environment, tests, tmp_path / "run2") == 1.0
            assert "1 passed" in (tmp_path / "run2" / "test-stdout.txt").read_text()

            # downloads: a file and a directory inside the working directory, a file outside it
            await environment.exec("mkdir -p out/sub && echo deep > out/sub/f.txt && printf '\\000\\377' > out/b")
            await environment.download_dir("/workspace/out", tmp_path / "out")
            assert (tmp_path / "out" / "sub" / "f.txt").read_text() == "deep\n"
            assert (tmp_path / "out" / "b").read_bytes() == b"\x00\xff"
            await environment.download_file("/workspace/solution.py", tmp_path / "back" / "solution.py")
            assert (tmp_path / "back" / "solution.py").read_text() == RIGHT
            await environment.download_file("/tests/test.sh", tmp_path / "test.sh")
            assert (tmp_path / "test.sh").read_text() == TEST_SH
            with pytest.raises(RuntimeError, match="exit code 1"):
                await environment.download_file("/no/such/file", tmp_path / "nothing")

            with pytest.raises(RuntimeError, match="timed out after 1 seconds"):
                await environment.exec("sleep 20", timeout_sec=1)
            with pytest.raises(UnprocessableError) as refused:  # a refusal of the configuration: raised as is
                await environment.exec("true", user=1234)  # a Docker sandbox runs as its own user only
            assert refused.value.field == "spec.user"
        finally:
            await environment.stop(delete=True)
        status, body = await live.call("GET", f"/v1/environments?task={TASK}",
                                       headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and body["environments"] == []

        # the token: $TANGRAM_TOKEN when none is given; a missing or another task's token raises at start
        monkeypatch.setenv("TANGRAM_TOKEN", TOKEN)
        from_env = TangramEnvironment(session_id="from-env", broker_url=live.url, task=TASK)
        await from_env.start()
        assert (await from_env.exec("echo ok")).stdout == "ok\n"
        await from_env.stop()
        monkeypatch.delenv("TANGRAM_TOKEN")
        for token, error in ((None, UnauthorizedError), (OTHER, ForbiddenError)):
            refused = TangramEnvironment(session_id="refused", broker_url=live.url, task=TASK, token=token)
            with pytest.raises(error):
                await refused.start()
            await refused.stop()
