"""The executor's JSON both ways (``sandboxes/exec_wire.py``): a typed request encodes to what the executor reads,
and its answer decodes to no more than the request's output limit per stream, cut at a character boundary, with only
the fields and types of a run answer."""

from __future__ import annotations

from typing import Any

import pytest

from sandboxes import executor
from sandboxes.exec_wire import MAX_ERROR_CHARS, ExecRequest, ExecResult
from sandboxes.executor_answer import BadAnswer, frame_limit


def test_a_request_is_what_the_executor_reads() -> None:
    request = ExecRequest(("python3", "-c", "pass"), cores=(2, 3), env={"A": "1"}, cwd="/w", timeout_s=5.0,
                          output_limit=100, memory_bytes=1 << 30, tag="act-1", reap=True)
    wire = request.to_wire()
    assert executor._validate(wire) == (["python3", "-c", "pass"], {"A": "1"}, "/w", 5.0, 100, [2, 3], 1 << 30,
                                        "act-1")
    assert wire["op"] == "run" and wire["reap"] is True
    assert frame_limit(wire) == frame_limit({"output_limit": 100})


def test_defaults_are_left_to_the_executor() -> None:
    wire = ExecRequest("true").to_wire()
    assert wire == {"op": "run", "command": "true", "env": {}, "cwd": None, "timeout_s": None,
                    "output_limit": executor.DEFAULT_OUTPUT_LIMIT}
    assert executor._validate(wire) == (["/bin/sh", "-c", "true"], {}, None, None, executor.DEFAULT_OUTPUT_LIMIT,
                                        None, None, None)
    flags = ExecRequest("true", background=True, pytest_runner=True).to_wire()
    assert flags["background"] is True and flags["pytest_runner"] is True


def answer(**fields: Any) -> dict[str, Any]:
    return {"exit_code": 0, "signal": None, "timed_out": False, "oom_killed": False, "stdout": "", "stderr": "",
            "stdout_bytes": 0, "stderr_bytes": 0, "stdout_truncated": False, "stderr_truncated": False,
            "duration_s": 0.5, "error": None, **fields}


def test_an_honest_answer_is_kept_as_it_is() -> None:
    honest = answer(stdout="hello\n", stdout_bytes=6, stderr="x" * 10, stderr_bytes=10)
    assert ExecResult.from_wire(honest, 10) == ExecResult(**honest)


def test_the_executors_own_answer_decodes() -> None:
    ran = executor.run_command(ExecRequest("echo hi; exit 3", output_limit=100).to_wire())
    result = ExecResult.from_wire(ran, 100)
    assert result.exit_code == 3 and result.stdout == "hi\n" and result.stdout_bytes == 3 and result.error is None
    refused = ExecResult.from_wire(executor.run_command(ExecRequest("true", cwd="/nonexistent-dir").to_wire()), 100)
    assert refused.exit_code is None and refused.error is not None and "cwd" in refused.error


def test_a_background_runs_pid_is_kept() -> None:
    assert ExecResult.from_wire(answer(pid=42), 10).pid == 42


def test_a_stream_over_the_limit_is_cut_at_a_character_and_marked() -> None:
    bounded = ExecResult.from_wire(answer(stdout="é" * 6, stdout_bytes=3), 5)  # 12 bytes of UTF-8
    assert bounded.stdout == "éé" and bounded.stdout_truncated is True
    assert bounded.stdout_bytes == 4  # never fewer than the bytes kept


def test_unknown_fields_are_dropped_and_the_error_is_capped() -> None:
    bounded = ExecResult.from_wire(answer(extra="x" * 100, error="e" * (MAX_ERROR_CHARS + 1)), 10)
    assert bounded.error is not None and len(bounded.error) == MAX_ERROR_CHARS


@pytest.mark.parametrize("fields", [{"exit_code": "0"}, {"exit_code": True}, {"stdout": ["x"]},
                                    {"timed_out": 1}, {"stdout_bytes": -1}, {"duration_s": float("nan")},
                                    {"stderr_truncated": "no"}, {"error": 7}, {"pid": 0}, {"pid": "1"}])
def test_fields_of_the_wrong_type_are_refused(fields: dict[str, Any]) -> None:
    with pytest.raises(BadAnswer):
        ExecResult.from_wire(answer(**fields), 10)
