"""SandboxFusion's ``POST /run_code`` on a real broker with Docker sandboxes and auth on: verl's own code reward
(``verl.utils.reward_score.sandbox_fusion``, which posts to a bare URL) scores against it unchanged, and the answers
have SandboxFusion's shapes for each way a run ends."""

from __future__ import annotations

import asyncio
import base64
import threading
from pathlib import Path
from typing import Any

import pytest
from verl.utils.reward_score.sandbox_fusion import compute_score

from tangram.server.auth import new_token, token_sha256
from tests.docker_nodes import cpu_config, docker_engines
from tests.harness import Live, live_broker

pytestmark = [pytest.mark.docker, pytest.mark.slow]

TASK, TOKEN = "code-rl", new_token()
SUM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
DIFFERENCE = "```python\na, b = map(int, input().split())\nprint(a - b)\n```"
CASES = {"inputs": ["1 2\n", "0 0\n", "5 7\n"], "outputs": ["3\n", "0\n", "12\n"]}


def config() -> dict[str, Any]:
    node = {"backend": "docker", "engine": docker_engines()[0], "cores": "0-1", "numa": ["0-1"], "memory_mb": 4096}
    return {**cpu_config({"n1": node}), "auth": {"admin_token_sha256": token_sha256(new_token())},
            "tasks": {TASK: {"token_sha256": token_sha256(TOKEN)}}}


async def run_code(live: Live, body: dict[str, Any], query: str = f"?token={TOKEN}") -> tuple[int, Any]:
    return await live.call("POST", f"/run_code{query}", json=body)


async def test_verls_code_reward_scores_against_the_broker_unchanged(tmp_path: Path) -> None:
    async with live_broker(config(), str(tmp_path / "db.sqlite")) as live:
        url = f"{live.url}/run_code?token={TOKEN}"
        semaphore = threading.Semaphore(4)
        right, wrong = await asyncio.gather(
            asyncio.to_thread(compute_score, url, semaphore, 256, SUM, CASES, timeout=10),
            asyncio.to_thread(compute_score, url, semaphore, 256, DIFFERENCE, CASES, timeout=10))
        assert right[0] == 1.0, right[1]
        assert wrong[0] == pytest.approx(1 / 3), wrong[1]  # only 0 - 0 is right
        assert [m["status"] for m in wrong[1]] == ["wrong_answer", "success", "wrong_answer"]
        looping = await asyncio.to_thread(compute_score, url, semaphore, 256, "```python\nwhile True: pass\n```",
                                          {"inputs": [""], "outputs": [""]}, timeout=1)
        assert looping[0] == 0.0 and looping[1][0]["status"] == "timeout", looping[1]
        broken = await asyncio.to_thread(compute_score, url, semaphore, 256, "```python\nprint(\n```",
                                         {"inputs": [""], "outputs": [""]}, timeout=5)
        assert broken[1][0]["status"] == "runtime_error" and "SyntaxError" in broken[1][0]["stderr"]
        code, listed = await live.call("GET", f"/v1/environments?task={TASK}",
                                       headers={"Authorization": f"Bearer {TOKEN}"})
        assert code == 200 and listed["environments"] == []  # each call's sandbox went with it


async def test_run_code_answers_in_sandbox_fusions_shapes(tmp_path: Path) -> None:
    async with live_broker(config(), str(tmp_path / "db.sqlite")) as live:
        code, answer = await run_code(live, {"code": "cat data.txt; echo err >&2; exit 3", "language": "bash",
                                             "files": {"data.txt": base64.b64encode(b"from a file\n").decode()}})
        assert code == 200, answer
        assert (answer["status"], answer["compile_result"], answer["files"]) == ("Failed", None, {})
        run = answer["run_result"]
        assert (run["status"], run["return_code"], run["stdout"], run["stderr"]) == ("Finished", 3, "from a file\n",
                                                                                     "err\n")
        assert run["execution_time"] > 0
        code, answer = await run_code(live, {"language": "pytest", "code": "def test_one():\n    assert 1 + 1 == 2\n"})
        assert answer["status"] == "Success" and "1 passed" in answer["run_result"]["stdout"], answer
        code, answer = await run_code(live, {"code": "import time\nprint('started', flush=True)\ntime.sleep(30)",
                                             "run_timeout": 1})
        assert (answer["status"], answer["run_result"]["status"]) == ("Failed", "TimeLimitExceeded"), answer
        assert answer["run_result"]["stdout"] == "started\n"

        # refusals: JSON naming the field, nothing run
        for body, status, field in (({"code": "x", "language": "cobol"}, 400, "language"),
                                    ({"code": "x", "fetch_files": ["out.txt"]}, 400, "fetch_files"),
                                    ({"code": "x", "run_timeout": 0}, 400, "run_timeout"),
                                    ({"code": "x", "files": {"../up": "eA=="}}, 422, "files.../up"),
                                    ({"code": "x", "memory_limit_MB": 1 << 20}, 422, "memory_limit_MB")):
            code, refused = await run_code(live, body)
            assert (code, refused["error"]["field"]) == (status, field), (body, refused)
        code, refused = await run_code(live, {"code": "print(1)"}, query="")
        assert code == 401, refused
        code, refused = await run_code(live, {"code": "print(1)"}, query=f"?token={TOKEN}&task=another")
        assert code == 403 and refused["error"]["field"] == "task", refused
        code, answer = await live.call("POST", "/run_code", json={"code": "print(1)"},
                                       headers={"Authorization": f"Bearer {TOKEN}"})
        assert code == 200 and answer["run_result"]["stdout"] == "1\n", answer
