"""``--log-format json``: one JSON object per line, carrying the ids of the action being handled."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import orjson
import pytest

from tangram.cli import main
from tangram.core.action import Action, Demand, Kind
from tangram.log_context import bound_action, current_fields
from tangram.log_format import JsonFormatter
from tests.harness import live_broker


def _record(message: str, *args: object, exc_info: bool = False) -> logging.LogRecord:
    return logging.getLogger("tangram.test").makeRecord(
        "tangram.test", logging.WARNING, __file__, 1, message, args, sys.exc_info() if exc_info else None)


def _action(**more: Any) -> Action:
    return Action(task="t", kind=Kind.EXEC, demands={"cpu": Demand.fixed(1)}, **more)


def test_a_line_outside_any_action_has_the_base_fields_only():
    line = orjson.loads(JsonFormatter().format(_record("%d queued", 3)))
    assert set(line) == {"time", "level", "logger", "message"}
    assert (line["level"], line["logger"], line["message"]) == ("WARNING", "tangram.test", "3 queued")
    when = datetime.fromisoformat(line["time"])
    assert when.utcoffset() == timedelta(0) and abs(datetime.now(when.tzinfo) - when) < timedelta(minutes=1)


def test_a_line_inside_an_action_carries_its_known_ids():
    action = _action(trajectory="traj-1", spec={"environment": "env_9", "command": "ls"})
    with bound_action(action):
        line = orjson.loads(JsonFormatter().format(_record("running")))
    assert {k: line[k] for k in ("action", "task", "trajectory", "environment")} == {
        "action": action.id, "task": "t", "trajectory": "traj-1", "environment": "env_9"}
    bare = _action()
    with bound_action(bare):
        line = orjson.loads(JsonFormatter().format(_record("running")))
    assert line["action"] == bare.id and "trajectory" not in line and "environment" not in line
    assert current_fields() == {}  # the binding ended with its block


def test_a_logged_exception_is_its_traceback_text():
    try:
        raise RuntimeError("engine gone")
    except RuntimeError:
        line = orjson.loads(JsonFormatter().format(_record("executing failed", exc_info=True)))
    assert line["exc_info"].startswith("Traceback") and "RuntimeError: engine gone" in line["exc_info"]


class JsonLines(logging.Handler):
    """Formats each record as it is emitted (in the emitting task's context) and keeps the parsed line."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonFormatter())
        self.lines: list[dict[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(orjson.loads(self.format(record)))


@pytest.fixture
def broker_lines() -> Iterator[JsonLines]:
    logger = logging.getLogger("tangram.broker")
    handler, level = JsonLines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


async def test_the_broker_logs_an_actions_end_with_its_ids(tmp_path, broker_lines):
    leases = {"basic": {"lease.local": {"concurrency": 4}}, "cpu": {"enabled": False}}
    body = {"task": "t", "kind": "lease", "trajectory": "traj-7", "demand": {"lease.local": 1}, "spec": {"ttl_s": 60}}
    async with live_broker(leases, str(tmp_path / "t.db")) as live:
        status, action = await live.call("POST", "/v1/actions?wait=true", json=body)
    assert status == 200 and action["state"] == "succeeded", action
    ends = [line for line in broker_lines.lines if line.get("action") == action["id"]]
    assert ends and ends[0]["message"] == f"action {action['id']} ended succeeded"
    assert (ends[0]["task"], ends[0]["trajectory"], ends[0]["level"]) == ("t", "traj-7", "DEBUG")
    assert all("action" not in line for line in broker_lines.lines if line not in ends)


def test_serve_refuses_an_unknown_log_format(capsys, monkeypatch):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--log-format", "xml"])
    assert exit_.value.code == 2 and "--log-format" in capsys.readouterr().err
    monkeypatch.setenv("TANGRAM_LOG_FORMAT", "xml")
    assert main(["serve"]) == 2
    assert "TANGRAM_LOG_FORMAT" in capsys.readouterr().err
