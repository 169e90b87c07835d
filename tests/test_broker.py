"""Broker behaviour beyond single requests: coalescing, learned durations that survive a restart."""

from __future__ import annotations

import asyncio

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
