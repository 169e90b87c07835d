"""What the broker takes from an executor's answer (``sandboxes/executor_answer.py``): no more than the request's
output limit per stream, cut at a character boundary, and only the fields and types of a run answer."""

from __future__ import annotations

from typing import Any

import pytest

from sandboxes.executor import DEFAULT_OUTPUT_LIMIT
from sandboxes.executor_answer import (
    FRAME_OVERHEAD_BYTES,
    MAX_ERROR_CHARS,
    BadAnswer,
    bounded_run_answer,
    frame_limit,
)


def answer(**fields: Any) -> dict[str, Any]:
    return {"exit_code": 0, "signal": None, "timed_out": False, "oom_killed": False, "stdout": "", "stderr": "",
            "stdout_bytes": 0, "stderr_bytes": 0, "stdout_truncated": False, "stderr_truncated": False,
            "duration_s": 0.5, "error": None, **fields}


def test_an_honest_answer_is_kept_as_it_is() -> None:
    honest = answer(stdout="hello\n", stdout_bytes=6, stderr="x" * 10, stderr_bytes=10)
    assert bounded_run_answer(honest, 10) == honest


def test_a_background_runs_pid_is_kept() -> None:
    assert bounded_run_answer(answer(pid=42), 10) == answer(pid=42)


def test_a_stream_over_the_limit_is_cut_at_a_character_and_marked() -> None:
    bounded = bounded_run_answer(answer(stdout="é" * 6, stdout_bytes=3), 5)  # 12 bytes of UTF-8
    assert bounded["stdout"] == "éé" and bounded["stdout_truncated"] is True
    assert bounded["stdout_bytes"] == 4  # never fewer than the bytes kept


def test_unknown_fields_are_dropped_and_the_error_is_capped() -> None:
    bounded = bounded_run_answer(answer(extra="x" * 100, error="e" * (MAX_ERROR_CHARS + 1)), 10)
    assert "extra" not in bounded and len(bounded["error"]) == MAX_ERROR_CHARS


@pytest.mark.parametrize("fields", [{"exit_code": "0"}, {"exit_code": True}, {"stdout": ["x"]},
                                    {"timed_out": 1}, {"stdout_bytes": -1}, {"duration_s": float("nan")},
                                    {"stderr_truncated": "no"}, {"error": 7}, {"pid": 0}, {"pid": "1"}])
def test_fields_of_the_wrong_type_are_refused(fields: dict[str, Any]) -> None:
    with pytest.raises(BadAnswer):
        bounded_run_answer(answer(**fields), 10)


def test_the_frame_limit_follows_the_request() -> None:
    assert frame_limit({"op": "ping"}) == FRAME_OVERHEAD_BYTES
    assert frame_limit({"op": "run", "output_limit": 1000}) == FRAME_OVERHEAD_BYTES + 12_000
    assert frame_limit({"command": "true"}) == FRAME_OVERHEAD_BYTES + 12 * DEFAULT_OUTPUT_LIMIT
