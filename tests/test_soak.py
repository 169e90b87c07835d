"""The soak test (loadtest/soak.py) in short: a few hundred mixed actions (trajectory sandboxes, ephemeral commands,
proxied API calls, leases, MiniLM rewards) against a real broker built from loadtest/broker.toml, with every fault
kind injected (cancels of queued and running actions, dropped ``?wait=true`` requests, ``docker kill`` of sandbox
containers, commands outliving their deadline). However the faults fall, every action must end in exactly one
terminal state (through the API and in the store), every unit must be free again, and no environment or container
may be left."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadtest.soak import FAULT_KINDS, SoakOptions, broker_config, soak_local
from loadtest.soak_verdict import TERMINAL
from tests.docker_nodes import docker_engines, new_broker_id

ACTIONS = 300
OPTIONS = SoakOptions(actions=ACTIONS, concurrency=12, seed=7, cancel_rate=0.12, disconnect_rate=0.08, kill_rate=0.3,
                      deadline_rate=0.1, action_timeout_s=60.0, store_sample=0)
# faults the driver injects on purpose; a cancel that comes too late is an outcome, not an injection
INJECTED = [fault for fault in FAULT_KINDS if fault != "cancel_too_late"]


def config(tmp_path: Path, upstream_url: str) -> dict[str, Any]:
    """loadtest/broker.toml on the test's first Docker engine with two cores, under a broker id of this session."""
    node = {"engine": docker_engines()[0], "cores": "0-1", "numa": ["0-1"], "memory_mb": 4096}
    raw = broker_config(upstream_url, f"sqlite+aiosqlite:///{tmp_path / 'soak.db'}", broker_id=new_broker_id(),
                        node=node)
    raw["cpu"]["run_dir"] = "/run/tangram/test-sandboxes"
    return raw


async def test_short_soak_leaves_every_action_terminal_and_nothing_held(tmp_path: Path) -> None:
    verdict = await soak_local(OPTIONS, lambda upstream_url: config(tmp_path, upstream_url), tmp_path / "broker.log")

    failed = {name: check for name, check in verdict["checks"].items() if not check["ok"]}
    assert not failed, f"soak checks failed: {failed}; broker log in {tmp_path / 'broker.log'}"
    assert verdict["ok"] and verdict["skipped_checks"] == {}
    assert verdict["submitted"] == ACTIONS == verdict["terminal"] == sum(verdict["by_state"].values())
    assert set(verdict["by_kind"]) == {"exec", "api", "lease", "reward"}
    assert verdict["units_in_use"] and not any(verdict["units_in_use"].values())
    # every fault kind happened, and its outcome shows: cancels end cancelled, deadlines timed_out, kills lose
    # the sandbox under a command or before the next one
    assert all(verdict["faults"][fault] > 0 for fault in INJECTED), verdict["faults"]
    assert verdict["by_state"]["cancelled"] == verdict["faults"]["cancel_queued"] + verdict["faults"]["cancel_running"]
    assert verdict["by_state"]["timed_out"] > 0 and verdict["by_state"]["succeeded"] > 0
    assert any(code.endswith(":environment_lost") for code in verdict["error_codes"]), verdict["error_codes"]
    assert set(verdict["by_state"]) == set(TERMINAL)
