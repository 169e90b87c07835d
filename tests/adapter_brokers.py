"""What the adapters' tests share (issue 39): a broker with one Docker node whose API needs a token (``TOKEN`` acts
for the test's task, ``OTHER`` for another task), and the toy solution each rollout is scored on."""

from __future__ import annotations

from typing import Any

from tangram.server.auth import new_token, token_sha256
from tests.docker_nodes import cpu_config, docker_engines

TOKEN, OTHER = new_token(), new_token()
TESTS = "from solution import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
WRONG, RIGHT = "def add(a, b):\n    return a - b\n", "def add(a, b):\n    return a + b\n"


def secured_docker_node(task: str) -> dict[str, Any]:
    """One Docker node of two cores; TOKEN acts for ``task``, OTHER for another task, and some admin exists."""
    config = cpu_config({"n1": {"backend": "docker", "engine": docker_engines()[0], "cores": "0-1", "numa": ["0-1"],
                                "memory_mb": 8192}})
    return {**config, "auth": {"admin_token_sha256": token_sha256(new_token())},
            "tasks": {task: {"token_sha256": token_sha256(TOKEN)}, "other": {"token_sha256": token_sha256(OTHER)}}}
