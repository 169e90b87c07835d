"""The TRL adapter (``tangram_client.adapters.trl``) driven by TRL 1.16's own ``GRPOTrainer``, one real training step
on the CPU, against a live broker with auth and Docker sandboxes.

Only the LLM is a stand-in: a tiny random Qwen3 whose ``generate`` answers with scripted tool calls, through a real
tokenizer built offline (one token per byte) that carries TRL's bundled Qwen3 chat template, so TRL's own
``add_response_schema``/``parse_response`` render the tools and parse the calls. What TRL does with the factory
(``trl/trainer/grpo_trainer.py`` of trl 1.16.0): it calls it once at init to probe the class, requiring ``reset`` and
picking up ``get_reward`` and the public methods as tools (lines 686-733); pools instances, calling the factory again
when a batch needs more (2358); calls ``reset(**example)`` before each rollout (2389); calls each tool as
``tool(**arguments)`` inside ``except Exception`` (1982-1990); and scores with ``get_reward()`` per rollout (725).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import qwen3_chat_template

from tangram_client import AsyncTangramClient
from tangram_client.adapters.trl import BrokerConfigError, BrokerSandboxFactory, ScoredBrokerSandbox
from tangram_client.errors import ForbiddenError, UnauthorizedError, UnprocessableError
from tests.adapter_brokers import OTHER, TOKEN, secured_docker_node
from tests.byte_tokenizer import byte_tokenizer
from tests.harness import live_broker

pytestmark = pytest.mark.slow  # importing trl and transformers alone takes seconds

TASK = "trl-adapter"
TEST_FILE = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
CALC = {"buggy": "def add(a, b):\n    return a - b\n", "fixed": "def add(a, b):\n    return a + b\n"}
PYTEST = "python3 -m pytest -q --tb=line -p no:cacheprovider test_calc.py"


def call(name: str, **arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def script(variant: str) -> list[str]:
    """The policy's turns: write the code, read it back (and a file that is not there), run the tests, stop."""
    return [call("write_file", path="calc.py", content=CALC[variant]),
            call("read_file", path="calc.py") + "\n" + call("read_file", path="missing.txt"),
            call("run_command", command=f"{PYTEST}; echo status=$?"), "done"]


class ScriptedQwen3(Qwen3ForCausalLM):
    """A real (tiny, random) model for TRL's forward and backward passes, with scripted generation: the variant named
    in the prompt picks the script, the number of assistant turns so far the turn."""

    tokenizer: PreTrainedTokenizerFast

    def generate(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:  # type: ignore[override]
        pad = int(self.tokenizer.pad_token_id)
        rows = []
        for ids in input_ids.tolist():
            prompt = self.tokenizer.decode(ids)
            turn = prompt.count("<|im_start|>assistant") - 1
            turns = script("buggy" if "variant: buggy" in prompt else "fixed")
            text = turns[min(turn, len(turns) - 1)] + "<|im_end|>"
            rows.append(ids + self.tokenizer.encode(text, add_special_tokens=False))
        width = max(map(len, rows))
        return torch.tensor([row + [pad] * (width - len(row)) for row in rows])


def trainer(factory: BrokerSandboxFactory, output_dir: str) -> GRPOTrainer:
    """GRPO over two prompts (the buggy and the fixed variant), two rollouts each: one step, four rollouts."""
    # Qwen3's template: TRL knows its response schema, so it parses the tool calls
    tokenizer = byte_tokenizer(qwen3_chat_template, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=16384,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    ScriptedQwen3.tokenizer = tokenizer
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"variant: {variant}. Make the tests pass."}],
                                  "files": {"test_calc.py": TEST_FILE}} for variant in CALC])
    args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=4, num_generations=2, max_steps=1,
                      max_completion_length=4096, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                      logging_steps=1, seed=7)
    return GRPOTrainer(model=ScriptedQwen3(config), args=args, train_dataset=dataset, processing_class=tokenizer,
                       environment_factory=factory)


@pytest.fixture
def db(tmp_path: Path) -> str:
    return str(tmp_path / "tangram.db")


def tool_answers(completion: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(message["name"], message["content"]) for message in completion if message["role"] == "tool"]


async def test_grpo_trainer_runs_each_rollout_in_its_own_broker_sandbox_and_scores_it_there(
        db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    async with live_broker(secured_docker_node(TASK), db) as live:
        monkeypatch.setenv("TANGRAM_TOKEN", TOKEN)  # the factory takes the client's default
        factory = BrokerSandboxFactory(live.url, task=TASK, reward_command=PYTEST)
        with tempfile.TemporaryDirectory() as output_dir:
            grpo = trainer(factory, output_dir)

            def rollout() -> dict[str, Any]:
                grpo.train()
                held = {instance.environment: factory.client.read_file(str(instance.environment), "calc.py").decode()
                        for instance in factory.instances}
                exit_codes = {instance.environment: instance.last_result.get("exit_code")
                              for instance in factory.instances}
                first = factory.instances[0]
                before = first.environment
                first.reset(files={"seed.txt": "7"})  # the next rollout: a fresh sandbox, the last one deleted
                again = first.run_command("cat seed.txt; echo; ls")
                return {"held": held, "exit_codes": exit_codes, "before": before, "after": first.environment,
                        "again": again}

            try:
                seen = await asyncio.to_thread(rollout)
                async with AsyncTangramClient(live.url, task=TASK) as client:
                    live_ids = {env["id"] for env in await client.environments()}
            finally:
                await asyncio.to_thread(factory.close)
            async with AsyncTangramClient(live.url, task=TASK) as client:
                assert await client.environments() == []  # close deleted every sandbox still held

    # four rollouts, four sandboxes: each holds the code its own rollout wrote and scored
    assert len(factory.instances) == 4 and all(type(i) is ScoredBrokerSandbox for i in factory.instances)
    assert len(seen["held"]) == 4 and None not in seen["held"]
    for environment, code in seen["held"].items():
        assert seen["exit_codes"][environment] == (0 if code == CALC["fixed"] else 1)
    assert sorted(seen["held"].values()) == sorted([CALC["buggy"]] * 2 + [CALC["fixed"]] * 2)
    # reset deleted the first rollout's sandbox and made one with the example's files
    assert seen["after"] not in seen["held"] and seen["before"] not in live_ids and seen["after"] in live_ids
    assert seen["again"] == "exit code: 0\nstdout:\n7\nseed.txt"

    logs: dict[str, Any] = grpo._logs
    rewards = list(logs["rewards"]["ScoredBrokerSandbox"])
    assert len(logs["completion"]) == len(rewards) == 4
    for prompt, completion, reward in zip(logs["prompt"], logs["completion"], rewards, strict=True):
        variant = "buggy" if "variant: buggy" in prompt[-1]["content"] else "fixed"
        answers = tool_answers(completion)
        assert [name for name, _ in answers] == ["write_file", "read_file", "read_file", "run_command"]
        assert answers[0][1] == f"wrote {len(CALC[variant])} bytes to calc.py"
        assert answers[1][1] == CALC[variant]  # read back from the sandbox
        assert answers[2][1].startswith("Error: HTTP 404")  # a broker error the model reads, not a failure
        ran = answers[3][1]
        if variant == "buggy":  # the failing test, as the model saw it
            assert ran.startswith("exit code: 0\nstdout:\n") and "1 failed" in ran and "status=1" in ran
            assert reward == 0.0
        else:
            assert "1 passed" in ran and "status=0" in ran and reward == 1.0
    history = grpo.state.log_history[0]
    assert history["rewards/ScoredBrokerSandbox/mean"] == 0.5 and history["tools/failure_frequency"] == 0.0


@pytest.mark.parametrize("case", ["no token", "another task's token", "an impossible demand"])
async def test_a_refusal_of_the_setup_stops_training_instead_of_becoming_an_observation(
        db: str, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """TRL turns an ``Exception`` from a tool into the model's observation; a 401, a 403 or a 422 on anything but
    the command raises ``BrokerConfigError`` out of ``trainer.train()`` instead, with the broker's error as cause."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.delenv("TANGRAM_TOKEN", raising=False)
    setups: dict[str, dict[str, Any]] = {"no token": {}, "another task's token": {"token": OTHER},
                                         "an impossible demand": {"token": TOKEN, "exec_spec": {"cores": 64}}}
    options = setups[case]
    cause = {"no token": UnauthorizedError, "another task's token": ForbiddenError,
             "an impossible demand": UnprocessableError}[case]
    async with live_broker(secured_docker_node(TASK), db) as live:
        factory = BrokerSandboxFactory(live.url, task=TASK, reward_command=PYTEST, **options)
        with tempfile.TemporaryDirectory() as output_dir:
            grpo = trainer(factory, output_dir)
            try:
                with pytest.raises(BrokerConfigError) as refused:
                    await asyncio.to_thread(grpo.train)
            finally:
                await asyncio.to_thread(factory.close)
        error = refused.value.__cause__
        assert isinstance(error, cause)
        frames = [entry.name for entry in refused.traceback]
        if isinstance(error, UnprocessableError):  # the sandbox was made; the first tool call was refused
            assert error.field.startswith("demand")
            assert frames[frames.index("_tool_call_loop") + 1:][-2:] == ["run_command", "observation"]
        else:  # no sandbox for the rollout
            assert frames[frames.index("_generate_and_score_completions") + 1:][-2:] == ["reset", "observation"]
            assert all(instance.last_result == {} for instance in factory.instances)
        async with AsyncTangramClient(live.url, task=TASK, token=TOKEN) as client:
            assert await client.environments() == []
