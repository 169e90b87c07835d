"""Broker behaviour beyond single requests: coalescing, learned durations that survive a restart, allocations
that fail."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

from tangram.sched.backoff import ATTEMPTS, FIRST_DELAY_S, AllocationBackoff
from tests.harness import live_broker, live_upstream


async def test_a_burst_of_submits_coalesces_into_few_passes(tmp_path):
    config = {"basic": {"lease.x": {"concurrency": 1000}}}
    async with live_broker(config, str(tmp_path / "db")) as live:
        actions = [{"task": "t", "kind": "lease", "demand": {"lease.x": 1}} for _ in range(300)]
        _, reply = await live.call("POST", "/v1/actions:batch", json={"actions": actions})
        for record in reply["actions"]:
            _, final = await live.call("GET", f"/v1/actions/{record['id']}?wait=true&wait_timeout_s=10")
            assert final["state"] == "succeeded"
        assert 1 <= live.broker.passes <= 5  # 300 submits and 300 grants, a handful of passes


async def test_durations_are_learned_per_signature_and_survive_a_restart(tmp_path):
    db = str(tmp_path / "db")
    async with live_upstream() as upstream:
        config = {"basic": {"api.slow": {"concurrency": 4, "upstream": {"base_url": upstream.url}}}}
        action = {"task": "t", "kind": "api", "demand": {"api.slow": 1}, "signature": "slow-call",
                  "spec": {"method": "POST", "path": "/x", "body": {"sleep_s": 0.2}}}
        async with live_broker(config, db) as live:
            for _ in range(3):
                _, record = await live.call("POST", "/v1/actions?wait=true", json=action)
                assert record["state"] == "succeeded"
            profile = live.broker.durations.profiles[("t", "slow-call")]
            assert profile.samples == 3 and 0.2 <= profile.t1 < 1.0
            learned = profile.t1
        async with live_broker(config, db) as live:
            restored = live.broker.durations.profiles[("t", "slow-call")]
            assert (restored.samples, round(restored.t1, 6)) == (3, round(learned, 6))
            _, record = await live.call("POST", "/v1/actions", json={**action, "spec": {**action["spec"],
                                                                                        "body": {"sleep_s": 0}}})
            assert record["id"]
            assert (await live.call("GET", f"/v1/actions/{record['id']}?wait=true"))[1]["state"] == "succeeded"


async def test_records_outlive_memory_in_the_store(tmp_path):
    db = str(tmp_path / "db")
    config = {"basic": {"lease.x": {"concurrency": 2}}}
    async with live_broker(config, db) as live:
        _, record = await live.call("POST", "/v1/actions?wait=true",
                                    json={"task": "t", "kind": "lease", "demand": {"lease.x": 1}})
        await live.call("DELETE", f"/v1/leases/{record['id']}")
    async with live_broker(config, db) as live:
        code, again = await live.call("GET", f"/v1/actions/{record['id']}")
        assert code == 200 and again["state"] == "succeeded" and again["result"]["returned"] == "released"
        _, fresh = await live.call("POST", "/v1/actions", json={"task": "t", "kind": "lease",
                                                               "demand": {"lease.x": 1}})
        assert fresh["id"] != record["id"]
        assert live.broker.actions[fresh["id"]].seq > 1  # sequence numbers continue after a restart
    await asyncio.sleep(0)


def wrap_allocate(manager: Any, failures: int, calls: list[float]) -> None:
    """Make ``manager`` refuse its first ``failures`` allocations (a manager that refuses what its fit accepted)."""
    allocate = manager.allocate

    def refusing(action: Any, units: Any, pools: Any) -> Any:
        calls.append(time.monotonic())
        if len(calls) <= failures:
            raise RuntimeError("refused by the device")
        return allocate(action, units, pools)

    manager.allocate = refusing


async def test_an_allocation_that_keeps_failing_backs_off_then_fails_the_action(tmp_path):
    async with live_broker({"basic": {"lease.x": {"concurrency": 2}}}, str(tmp_path / "db")) as live:
        calls: list[float] = []
        wrap_allocate(live.broker.owner["lease.x"], 10**6, calls)
        _, record = await live.call("POST", "/v1/actions?wait=true&wait_timeout_s=20",
                                    json={"task": "t", "kind": "lease", "demand": {"lease.x": 1}})
        assert record["state"] == "failed", record
        assert record["error"]["code"] == "allocation_failed"
        assert "refused by the device" in record["error"]["message"] and "5 times" in record["error"]["message"]
        assert len(calls) == ATTEMPTS  # no retry after it was failed
        gaps = [b - a for a, b in itertools.pairwise(calls)]
        assert all(gap >= FIRST_DELAY_S * 2 ** i * 0.99 for i, gap in enumerate(gaps)), gaps  # doubling delays
        assert not live.broker.cycle.backoff and len(live.broker.queue) == 0  # nothing kept for it
        del live.broker.owner["lease.x"].allocate  # the manager's own again
        _, other = await live.call("POST", "/v1/actions?wait=true&wait_timeout_s=10",
                                   json={"task": "t", "kind": "lease", "demand": {"lease.x": 1}})
        assert other["state"] == "succeeded"  # the broker goes on


async def test_an_allocation_that_fails_once_is_retried_with_nothing_else_happening(tmp_path):
    async with live_broker({"basic": {"lease.x": {"concurrency": 2}}}, str(tmp_path / "db")) as live:
        calls: list[float] = []
        wrap_allocate(live.broker.owner["lease.x"], 1, calls)
        _, record = await live.call("POST", "/v1/actions?wait=true&wait_timeout_s=10",
                                    json={"task": "t", "kind": "lease", "demand": {"lease.x": 1}})
        assert record["state"] == "succeeded", record
        assert len(calls) == 2 and not live.broker.cycle.backoff


def test_backoff_doubles_its_delay_and_gives_up_at_its_bound():
    backoff = AllocationBackoff(attempts=4, first_delay_s=1.0, max_delay_s=3.0)
    assert not backoff and not backoff.waiting("a", 0.0)
    assert [backoff.failed("a", 10.0) for _ in range(3)] == [1.0, 2.0, 3.0]  # capped at 3 s
    assert backoff.waiting("a", 12.9) and not backoff.waiting("a", 13.0) and backoff.count("a") == 3
    assert backoff.failed("a", 13.0) is None and not backoff  # spent: forgotten, to be failed
    backoff.failed("b", 0.0)
    backoff.forget("b")
    assert not backoff.waiting("b", 0.0) and backoff.count("b") == 0
