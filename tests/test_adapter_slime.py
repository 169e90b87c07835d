"""The slime adapter (``tangram_client.adapters.slime``) through one agent rollout against a real broker on Docker:
the workspace prepared with ``write_file`` (text, bytes and a host ``Path``), the agent's commands, a failing test
run and the reward computed from its exit code as ``examples/coding_agent_rl/swe.py`` does, ``read_file`` and the
sandbox deleted when the ``async with`` ends. slime is not installable here (the index's ``slime`` is another
project), so its ``Sandbox`` protocol is called as its harness and examples call it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tangram_client.adapters.slime import TangramSandbox
from tangram_client.client import AsyncTangramClient
from tangram_client.errors import ForbiddenError, UnauthorizedError, UnprocessableError
from tests.adapter_brokers import OTHER, RIGHT, TESTS, TOKEN, WRONG, secured_docker_node
from tests.harness import live_broker

pytestmark = pytest.mark.slow

TASK = "slime-rl"


@pytest.fixture
def db(tmp_path: Path) -> str:
    return str(tmp_path / "tangram.db")


async def reward(sb: TangramSandbox) -> tuple[float, str]:
    """The evaluator's score: 1.0 when the tests pass (``_run_eval_cmd`` in slime's swe example), and the log."""
    code, stdout, _ = await sb.exec("cd /workspace && python3 -m pytest -q /opt/eval/test_solution.py", timeout=60)
    return (1.0 if code == 0 else 0.0), stdout


async def test_a_rollout_prepares_runs_and_scores_in_one_broker_environment(db, tmp_path, monkeypatch):
    monkeypatch.delenv("TANGRAM_TOKEN", raising=False)
    (tmp_path / "solution.py").write_text(WRONG)
    async with live_broker(secured_docker_node(TASK), db) as live:
        async with TangramSandbox(broker_url=live.url, task=TASK, token=TOKEN) as sb:
            assert sb.sandbox_id
            code, stdout, stderr = await sb.exec("echo $MODE; id -u; echo warn >&2; exit 4", env={"MODE": "agent"})
            assert (code, stdout, stderr) == (4, "agent\n0\n", "warn\n")
            with pytest.raises(RuntimeError, match=r"exec failed \(exit=4\)"):
                await sb.exec("exit 4", check=True)

            await sb.write_file("/workspace/solution.py", tmp_path / "solution.py")  # a host Path, write_files
            await sb.write_file("/opt/eval/test_solution.py", TESTS)  # outside the working directory: stdin
            await sb.write_file("/opt/eval/blob.bin", b"\x00\xff\x10")
            assert await sb.read_file("/workspace/solution.py") == WRONG
            assert await sb.read_file("/opt/eval/test_solution.py") == TESTS
            _, listing, _ = await sb.exec("od -An -tx1 /opt/eval/blob.bin")
            assert listing.split() == ["00", "ff", "10"]
            assert await sb.read_file("/no/such/file") == ""  # as slime's E2B sandbox answers
            assert await sb.read_file("/workspace/missing.txt") == ""

            score, log = await reward(sb)
            assert score == 0.0 and "1 failed" in log and "assert -1 == 5" in log
            await sb.write_file("solution.py", RIGHT)  # relative: in the working directory
            score, log = await reward(sb)
            assert score == 1.0 and "1 passed" in log

            with pytest.raises(TimeoutError):
                await sb.exec("sleep 20", timeout=1)
            with pytest.raises(UnprocessableError) as refused:  # a refusal of the configuration raises as is
                await sb.exec("true", user="1234:1234")  # a Docker sandbox runs as its own user only
            assert refused.value.field == "spec.user"
            sandbox_id = sb.sandbox_id
        status, _ = await live.call("GET", f"/v1/environments/{sandbox_id}",
                                    headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 404  # deleted when the rollout's ``async with`` ended

        # the token from $TANGRAM_TOKEN; a shared client stays open; a missing or wrong token raises on entering
        monkeypatch.setenv("TANGRAM_TOKEN", TOKEN)
        async with AsyncTangramClient(live.url, task=TASK) as client:
            for _ in range(2):
                async with TangramSandbox(client=client) as shared:
                    assert await shared.exec("echo $((6 * 7))") == (0, "42\n", "")
            assert await client.environments() == []
        monkeypatch.delenv("TANGRAM_TOKEN")
        for token, error in ((None, UnauthorizedError), (OTHER, ForbiddenError)):
            with pytest.raises(error):
                async with TangramSandbox(broker_url=live.url, task=TASK, token=token):
                    pass
