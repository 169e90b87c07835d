"""Per-task caps over real HTTP: a task over its running cap waits without holding back other tasks' actions behind
it in the FCFS queue; a full per-task queue, or a task out of environments or memory, gets 429 with Retry-After
(batches all or nothing); the scheduling pass starts no action that would take a task past its environments."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest

from tangram.sched.tenants import AUTHENTICATED_DEFAULTS, TaskCaps, Tenancy
from tangram_client import AsyncTangramClient
from tangram_client.errors import OverloadedError
from tests.docker_nodes import local_cpu
from tests.harness import Live, live_broker, live_upstream


@pytest.fixture
def db(tmp_path) -> str:
    return str(tmp_path / "tangram.db")




def lease(task: str, **extra: Any) -> dict[str, Any]:
    return {"task": task, "kind": "lease", "demand": {"lease.x": 1}, "spec": {"ttl_s": 60}, **extra}


def exec_action(task: str, command: str = "true", **extra: Any) -> dict[str, Any]:
    return {"task": task, "kind": "exec", "demand": {"cpu": 1}, "spec": {"command": command}, "timeout_s": 120,
            **extra}


async def states(live: Live, ids: list[str]) -> list[str]:
    return [(await live.call("GET", f"/v1/actions/{action_id}"))[1]["state"] for action_id in ids]


async def until_state(live: Live, action_id: str, state: str) -> None:
    for _ in range(600):
        if (await live.call("GET", f"/v1/actions/{action_id}"))[1]["state"] == state:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{action_id} never became {state}")


# -- max_running ------------------------------------------------------------------------------------------------

async def test_leases_over_the_running_cap_wait_without_holding_back_another_task(db):
    """Three units, task a capped at 2: a's third lease waits though a unit is free, and b's later one takes it
    (without the cap FCFS would give it to a's third)."""
    config = {"basic": {"lease.x": {"concurrency": 3, "lease_ttl_s": 60.0}}, "cpu": {"enabled": False},
              "tasks": {"a": {"max_running": 2}}}
    async with live_broker(config, db) as live:
        _, burst = await live.call("POST", "/v1/actions:batch", json={"actions": [lease("a")] * 5})
        a_ids = [record["id"] for record in burst["actions"]]
        code, b = await live.call("POST", "/v1/actions?wait=true&wait_timeout_s=30", json=lease("b"))
        assert code == 200 and b["state"] == "succeeded"
        assert await states(live, a_ids) == ["succeeded"] * 2 + ["queued"] * 3
        assert (await live.call("DELETE", f"/v1/leases/{a_ids[0]}"))[0] == 200
        _, third = await live.call("GET", f"/v1/actions/{a_ids[2]}?wait=true&wait_timeout_s=30")
        assert third["state"] == "succeeded"  # a's own order is kept: the third, not a later one
        assert await states(live, a_ids[3:]) == ["queued", "queued"]


async def test_a_burst_over_the_running_cap_leaves_other_tasks_running_promptly(db):
    """Proxied API calls that take a while: a runs one at a time, its others stay queued, b's run meanwhile."""
    async with live_upstream() as upstream:
        config = {"basic": {"api.u": {"concurrency": 4, "upstream": {"base_url": upstream.url, "timeout_s": 60.0}}},
                  "cpu": {"enabled": False}, "tasks": {"max_running": 1, "b": {"max_running": 4}}}
        slow = {"kind": "api", "demand": {"api.u": 1}, "spec": {"method": "POST", "path": "/slow",
                                                                "body": {"sleep_s": 5}}}
        fast = {"kind": "api", "demand": {"api.u": 1}, "spec": {"method": "POST", "path": "/fast",
                                                                "body": {"sleep_s": 0}}}
        async with live_broker(config, db) as live:
            _, burst = await live.call("POST", "/v1/actions:batch", json={"actions": [{**slow, "task": "a"}] * 3})
            a_ids = [record["id"] for record in burst["actions"]]
            await until_state(live, a_ids[0], "running")
            _, b_burst = await live.call("POST", "/v1/actions:batch", json={"actions": [{**fast, "task": "b"}] * 3})
            for record in b_burst["actions"]:
                _, final = await live.call("GET", f"/v1/actions/{record['id']}?wait=true&wait_timeout_s=30")
                assert final["state"] == "succeeded"
            assert await states(live, a_ids) == ["running", "queued", "queued"]
            assert (await live.call("DELETE", f"/v1/actions/{a_ids[0]}"))[0] == 200
            await until_state(live, a_ids[1], "running")  # the cap frees: a's next one starts
            assert await states(live, a_ids[2:]) == ["queued"]
            for action_id in a_ids[1:]:
                await live.call("DELETE", f"/v1/actions/{action_id}")


# -- max_queued -------------------------------------------------------------------------------------------------

async def test_a_full_task_queue_answers_429_with_retry_after_and_batches_are_all_or_nothing(db):
    config = {"basic": {"lease.x": {"concurrency": 1, "lease_ttl_s": 60.0}}, "cpu": {"enabled": False},
              "tasks": {"max_queued": 3, "a": {"max_queued": 1}}}
    async with live_broker(config, db) as live:
        assert (await live.call("POST", "/v1/actions?wait=true", json=lease("a")))[1]["state"] == "succeeded"
        code, queued = await live.call("POST", "/v1/actions", json=lease("a", idempotency_key="second"))
        assert code == 201 and queued["state"] == "queued"
        async with live.http.post(live.url + "/v1/actions", json=lease("a")) as response:
            body = await response.json()
            assert response.status == 429 and int(response.headers["Retry-After"]) >= 1
        assert body["error"]["field"] == "task" and (body["error"]["cap"], body["error"]["limit"]) == ("max_queued", 1)
        code, replay = await live.call("POST", "/v1/actions", json=lease("a", idempotency_key="second"))
        assert (code, replay["id"]) == (200, queued["id"])  # a replay queues nothing, so it is no cap's business
        queue_before = len(live.broker.queue)
        code, reply = await live.call("POST", "/v1/actions:batch", json={"actions": [lease("c")] * 4})
        assert (code, reply["error"]["cap"], reply["error"]["limit"]) == (429, "max_queued", 3)
        assert len(live.broker.queue) == queue_before
        code, reply = await live.call("POST", "/v1/actions:batch", json={"actions": [lease("c")] * 3})
        assert (code, reply["created"]) == (200, 3)
        async with AsyncTangramClient(live.url, task="a", retries=1) as client:
            with pytest.raises(OverloadedError) as error:
                await client.submit("lease", {"lease.x": 1}, {"ttl_s": 60})
            assert (error.value.status, error.value.field, error.value.attempts) == (429, "task", 2)


async def test_the_bytes_of_a_tasks_queued_specs_are_capped(db, run_dir):
    """``max_queued_bytes``: a submit whose spec would take the task's queued specs past the cap gets 429 naming it;
    the bytes come back as its queued actions leave the queue."""
    config = {"cpu": local_cpu(run_dir), "tasks": {"a": {"max_queued_bytes": 2000}}}
    padded = "true # " + "x" * 900
    async with live_broker(config, db) as live:
        busy = (await live.call("POST", "/v1/actions", json=exec_action("a", "sleep 30")))[1]
        await until_state(live, busy["id"], "running")
        first = await live.call("POST", "/v1/actions", json=exec_action("a", padded))
        second = await live.call("POST", "/v1/actions", json=exec_action("a", padded))
        third = await live.call("POST", "/v1/actions", json=exec_action("a", padded))
        assert (await live.call("DELETE", f"/v1/actions/{first[1]['id']}"))[0] == 200
        fourth = await live.call("POST", "/v1/actions", json=exec_action("a", padded))
        assert (await live.call("DELETE", f"/v1/actions/{busy['id']}"))[0] == 200
    assert [first[0], second[0], fourth[0]] == [201, 201, 201]
    assert third[0] == 429 and (third[1]["error"]["cap"], third[1]["error"]["limit"]) == ("max_queued_bytes", 2000)


async def test_auth_on_caps_every_task_where_the_config_is_silent(db):
    """Tenants behind tokens need not trust each other: with auth on, a task without caps of its own gets
    ``AUTHENTICATED_DEFAULTS`` (a configured cap still wins); with auth off, none."""
    admin = "a" * 64
    digest = hashlib.sha256(admin.encode()).hexdigest()
    config = {"cpu": {"enabled": False}, "auth": {"admin_token_sha256": [digest]}, "tasks": {"b": {"max_queued": 7}}}
    async with live_broker(config, db) as live:
        ledger = live.broker.ledger
        assert ledger.limited and ledger.caps("a") == AUTHENTICATED_DEFAULTS
        assert (ledger.caps("b").max_queued, ledger.caps("b").max_queued_bytes) == (7, 1 << 30)
    async with live_broker({"cpu": {"enabled": False}}, db) as live:
        assert not live.broker.ledger.limited and live.broker.ledger.caps("a") == TaskCaps()


# -- max_environments and max_memory_mb -----------------------------------------------------------------------

async def test_environment_and_memory_caps_answer_429_at_creation(db, run_dir):
    config = {"cpu": local_cpu(run_dir), "tasks": {"a": {"max_environments": 2}, "b": {"max_memory_mb": 100},
                                                    "c": {"max_environments": 1}}}
    async with live_broker(config, db) as live:
        code, first = await live.call("POST", "/v1/environments", json={"task": "a", "trajectory": "t1"})
        assert code == 201
        code, ran = await live.call("POST", "/v1/actions?wait=true", json=exec_action("a", trajectory="t2"))
        assert code == 200 and ran["state"] == "succeeded"
        async with live.http.post(live.url + "/v1/environments", json={"task": "a", "trajectory": "t3"}) as response:
            body = await response.json()
            assert response.status == 429 and int(response.headers["Retry-After"]) >= 1
        assert (body["error"]["cap"], body["error"]["limit"]) == ("max_environments", 2)
        code, again = await live.call("POST", "/v1/actions?wait=true", json=exec_action("a", trajectory="t2"))
        assert code == 200 and again["state"] == "succeeded"  # its trajectory's environment exists: nothing new
        for new in (exec_action("a", trajectory="t4"), exec_action("a")):  # a new trajectory, or a one-off sandbox
            code, reply = await live.call("POST", "/v1/actions", json=new)
            assert (code, reply["error"]["cap"]) == (429, "max_environments")
        assert (await live.call("DELETE", f"/v1/environments/{first['id']}"))[0] == 200
        assert (await live.call("POST", "/v1/environments", json={"task": "a", "trajectory": "t3"}))[0] == 201

        assert (await live.call("POST", "/v1/environments", json={"task": "b", "memory_mb": 64}))[0] == 201
        code, reply = await live.call("POST", "/v1/environments", json={"task": "b", "memory_mb": 64})
        assert (code, reply["error"]["cap"], reply["error"]["limit"]) == (429, "max_memory_mb", 100)
        small = exec_action("b", trajectory="t1")
        small["spec"]["memory_mb"] = 32
        code, ran = await live.call("POST", "/v1/actions?wait=true", json=small)
        assert code == 200 and ran["state"] == "succeeded"  # 64 + 32 MiB fit in 100

        known = len(live.broker.actions)
        code, reply = await live.call("POST", "/v1/actions:batch", json={"actions": [
            exec_action("c", trajectory="t1"), exec_action("c", trajectory="t1"), exec_action("c", trajectory="t2")]})
        assert (code, reply["error"]["cap"]) == (429, "max_environments")
        assert len(live.broker.actions) == known  # nothing of the refused batch
        code, reply = await live.call("POST", "/v1/actions:batch", json={"actions": [
            exec_action("c", trajectory="t1"), exec_action("c", trajectory="t1")]})
        assert (code, reply["created"]) == (200, 2)  # two actions, one new environment


async def test_queued_first_actions_count_against_environments_and_the_pass_starts_none_beyond(db, run_dir):
    """With the one core busy, a's first actions of two trajectories wait; they already count, so creating another
    environment is refused (but not t1's own). Once the cap is lowered to one, the pass starts t1's action in its
    environment and leaves t2's queued, while b's later action runs on the core it does not take."""
    config = {"cpu": local_cpu(run_dir), "tasks": {"a": {"max_environments": 2}}}
    async with live_broker(config, db) as live:
        _, busy = await live.call("POST", "/v1/actions", json=exec_action("b", "sleep 60", trajectory="busy"))
        await until_state(live, busy["id"], "running")
        _, first = await live.call("POST", "/v1/actions", json=exec_action("a", trajectory="t1"))
        _, second = await live.call("POST", "/v1/actions", json=exec_action("a", trajectory="t2"))
        code, reply = await live.call("POST", "/v1/environments", json={"task": "a"})
        assert (code, reply["error"]["cap"]) == (429, "max_environments")
        code, env = await live.call("POST", "/v1/environments", json={"task": "a", "trajectory": "t1"})
        assert code == 201  # the one t1's queued action would have made: not counted twice
        live.broker.set_tenancy(Tenancy(tasks={"a": TaskCaps(max_environments=1)}))  # as POST /v1/admin/reload does
        assert (await live.call("DELETE", f"/v1/actions/{busy['id']}"))[0] == 200
        _, done = await live.call("GET", f"/v1/actions/{first['id']}?wait=true&wait_timeout_s=60")
        assert done["state"] == "succeeded" and done["result"]["environment"] == env["id"]
        code, other = await live.call("POST", "/v1/actions?wait=true&wait_timeout_s=60",
                                      json=exec_action("b", trajectory="later"))
        assert code == 200 and other["state"] == "succeeded"
        assert await states(live, [second["id"]]) == ["queued"]
        assert (await live.call("DELETE", f"/v1/actions/{second['id']}"))[0] == 200
