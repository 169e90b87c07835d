"""mini-swe-agent's own ``DefaultAgent``, with its ``DeterministicModel`` standing in for the LLM, running short
rollouts in a broker sandbox through ``tangram_client.adapters.mini_swe_agent.TangramEnvironment`` against a real
broker with Docker sandboxes and auth: commands with stdout and stderr merged, a file written by the agent and read
back, a failing then passing pytest run, a submission, a reward, a timeout, and configuration errors that raise."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")  # mini-swe-agent prints a banner at import otherwise

from minisweagent.agents.default import DefaultAgent
from minisweagent.environments import get_environment
from minisweagent.models.test_models import DeterministicModel, make_output

from tangram_client.adapters.mini_swe_agent import TangramEnvironment
from tangram_client.errors import ForbiddenError, UnauthorizedError, UnprocessableError
from tests.adapter_brokers import OTHER, TESTS, TOKEN, secured_docker_node
from tests.harness import live_broker

pytestmark = pytest.mark.slow

TASK = "mini-swe-agent"
AGENT: dict[str, Any] = {"system_template": "You solve tasks in a shell.", "instance_template": "{{task}}",
                         "step_limit": 10, "cost_limit": 0}


def scripted(*commands: str) -> DeterministicModel:
    return DeterministicModel(outputs=[make_output(f"step {i}", [{"command": command}])
                                       for i, command in enumerate(commands)])


def observations(agent: DefaultAgent) -> list[str]:
    return [str(message["content"]) for message in agent.messages[2:] if message["role"] == "user"]


@pytest.fixture
def db(tmp_path: Any) -> str:
    return str(tmp_path / "tangram.db")


async def test_a_rollout_runs_in_one_sandbox_and_is_scored_from_its_result(db, monkeypatch):
    async with live_broker(secured_docker_node(TASK), db) as live:
        monkeypatch.setenv("TANGRAM_TOKEN", TOKEN)  # the environment's client reads it, as the client does

        def rollout() -> tuple[dict[str, Any], list[str], bytes, float, str]:
            # built the way mini-swe-agent builds environments from its YAML config
            env = get_environment({"environment_class": "tangram_client.adapters.mini_swe_agent.TangramEnvironment",
                                   "broker_url": live.url, "task": TASK, "timeout": 60})
            assert isinstance(env, TangramEnvironment)
            with env:
                env.write_files({"test_solution.py": TESTS})  # the task's tests, as a harness seeds them
                agent = DefaultAgent(scripted(
                    "python3 --version; echo to-stderr >&2; pwd",
                    "cat > solution.py <<'EOF'\ndef add(a, b):\n    return a - b\nEOF",
                    "python3 -m pytest -q test_solution.py",
                    "sed -i 's/a - b/a + b/' solution.py && python3 -m pytest -q test_solution.py",
                    "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat solution.py",
                ), env, **AGENT)
                outcome = agent.run("Make test_solution.py pass.")
                solution = env.read_file("solution.py")
                final = env.execute({"command": "python3 -m pytest -q"})  # the reward: the tests on the result
                reward = 1.0 if final["returncode"] == 0 else 0.0
                environment = env.environment_id or ""
                assert [e["id"] for e in env.client.environments()] == [environment]  # one sandbox for the run
            return outcome, observations(agent), solution, reward, environment

        outcome, seen, solution, reward, environment = await asyncio.to_thread(rollout)
        assert "<returncode>0</returncode>" in seen[0] and "Python 3." in seen[0] and "to-stderr" in seen[0]
        assert "/workspace" in seen[0]
        assert "<returncode>0</returncode>" in seen[1]
        assert "<returncode>1</returncode>" in seen[2] and "1 failed" in seen[2]  # the failing test, as observed
        assert "<returncode>0</returncode>" in seen[3] and "1 passed" in seen[3]
        assert outcome["exit_status"] == "Submitted"
        assert outcome["submission"] == "def add(a, b):\n    return a + b\n" == solution.decode()
        assert reward == 1.0
        status, _ = await live.call("GET", f"/v1/environments/{environment}",
                                    headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 404  # close() deleted the sandbox


async def test_a_timeout_is_an_observation_and_a_config_error_raises(db, monkeypatch):
    async with live_broker(secured_docker_node(TASK), db) as live:
        monkeypatch.delenv("TANGRAM_TOKEN", raising=False)

        def run() -> tuple[dict[str, Any], dict[str, Any]]:
            with pytest.raises(UnauthorizedError):
                TangramEnvironment(broker_url=live.url, task=TASK)
            with pytest.raises(ForbiddenError):
                TangramEnvironment(broker_url=live.url, task=TASK, token=OTHER)
            with TangramEnvironment(broker_url=live.url, task=TASK, token=TOKEN) as env:
                timed_out = env.execute({"command": "echo started; sleep 20"}, timeout=1)
                agent = DefaultAgent(scripted("echo fine", "ls"), env, **AGENT)
                env.config.cores = 64  # more than any node has: a 422 that every later step would get too
                with pytest.raises(UnprocessableError) as refused:
                    agent.run("anything")
                assert refused.value.field == "demand.cpu"
                assert agent.messages[-1]["role"] == "exit"  # mini-swe-agent recorded the exception, then raised
                env.config.cores = 1
                after = env.execute({"command": "echo still here"})
            return timed_out, after

        timed_out, after = await asyncio.to_thread(run)
        assert timed_out["returncode"] == -1 and "did not finish" in timed_out["exception_info"]
        assert "started" in timed_out["output"]
        assert after == {"output": "still here\n", "returncode": 0, "exception_info": ""}
