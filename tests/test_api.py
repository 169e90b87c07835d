"""The REST service end to end over loopback: real broker, real SQLite, real upstream."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.harness import live_broker, live_upstream

# no CPU manager: `cpu` is a plain counted pool here, and exec actions have no executor (422)
LEASES = {"basic": {"lease.gpu-quota": {"concurrency": 4, "lease_ttl_s": 30.0}}, "pools": {"cpu": {"n0": 8}},
          "cpu": {"enabled": False}}


def lease(**extra):
    return {"task": "t1", "kind": "lease", "demand": {"lease.gpu-quota": 1}, **extra}


#: raw bytes are sent as what they claim to be: JSON (aiohttp would label them application/octet-stream)
AS_JSON = {"Content-Type": "application/json"}


@pytest.fixture
def db(tmp_path):
    return str(tmp_path / "tangram.db")


BAD = [
    (b"{not json", "body", 400),
    (b"[]", "body", 400),
    (b'{"kind": "lease", "demand": {"lease.gpu-quota": 1}}', "task", 400),
    (b'{"task": "t", "kind": "teleport", "demand": {"lease.gpu-quota": 1}}', "kind", 400),
    (b'{"task": "t", "kind": "lease", "demand": {"lease.nope": 1}}', "demand.lease.nope", 400),
    (b'{"task": "t", "kind": "lease", "demand": {"lease.gpu-quota": {"min": 3, "max": 2}}}',
     "demand.lease.gpu-quota", 422),  # well-formed by the document's schema, which cannot order min and max
    (b'{"task": "t", "kind": "lease", "demand": {"lease.gpu-quota": 0}}', "demand.lease.gpu-quota", 400),
    (b'{"task": "t", "kind": "lease", "demand": {"lease.gpu-quota": -2}}', "demand.lease.gpu-quota", 400),
    (b'{"task": "t", "kind": "lease", "demand": {"lease.gpu-quota": 5}}', "demand.lease.gpu-quota", 422),
    (b'{"task": "t", "kind": "lease", "demand": {}}', "demand", 400),
    (b'{"task": "t", "kind": "lease", "demand": {"lease.gpu-quota": 1}, "timeout_s": -1}', "timeout_s", 400),
    (b'{"task": "t", "kind": "lease", "demand": {"lease.gpu-quota": 1}, "colour": "red"}', "colour", 400),
    (b'{"task": "t", "kind": "exec", "demand": {"cpu": 1}}', "kind", 422),
    ((b'{"task": "t", "kind": "lease", "demand": {"cpu": {"choices": [1, 2]}}, '
      b'"elasticity": {"resource": "cpu", "efficiency": {"2": 1.5}}}'), "elasticity.efficiency.2", 400),
    (b'{"task": "t", "kind": "lease", "demand": {"lease.gpu-quota": {"min": 1, "max": 2}}, '
     b'"elasticity": {"resource": "lease.gpu-quota", "efficiency": {' +
     b", ".join(b'"%d": 1.0' % m for m in range(1, 1026)) + b"}}}", "elasticity.efficiency", 400),
]


@pytest.mark.parametrize("body,field,status", BAD)
async def test_bad_input_gets_4xx_naming_the_field(db, body, field, status):
    async with live_broker(LEASES, db) as live:
        code, reply = await live.call("POST", "/v1/actions", data=body, headers=AS_JSON)
        assert (code, reply["error"]["field"]) == (status, field), reply
        assert reply["error"]["reason"]
        assert len(live.broker.queue) == 0


async def test_limits_on_size_batch_and_ids(db):
    async with live_broker({**LEASES, "server": {"max_body_bytes": 4096, "max_batch": 3}}, db) as live:
        code, reply = await live.call("POST", "/v1/actions", data=b'{"task": "' + b"x" * 5000 + b'"}', headers=AS_JSON)
        assert (code, reply["error"]["field"]) == (413, "body")
        code, reply = await live.call("POST", "/v1/actions:batch", json={"actions": [lease()] * 4})
        assert (code, reply["error"]["field"]) == (413, "actions")
        code, reply = await live.call("POST", "/v1/actions:batch", json={"actions": [lease(), {"task": "t"}]})
        assert (code, reply["error"]["field"]) == (400, "actions[1].kind")
        assert len(live.broker.queue) == 0 and not live.broker.actions  # nothing of a bad batch is queued
        for method, path in (("GET", "/v1/actions/act_nope"), ("DELETE", "/v1/actions/act_nope"),
                             ("DELETE", "/v1/leases/act_nope")):
            code, reply = await live.call(method, path)
            assert (code, reply["error"]["field"]) == (404, "id")
        code, reply = await live.call("GET", "/v1/actions/x?wait=maybe")
        assert (code, reply["error"]["field"]) == (400, "wait")
        code, reply = await live.call("GET", "/v2/nothing")
        assert code == 404 and reply["error"]["field"] == "path"


async def test_lease_lifecycle_wait_release_and_idempotency(db):
    async with live_broker(LEASES, db) as live:
        code, granted = await live.call("POST", "/v1/actions?wait=true",
                                        json=lease(demand={"lease.gpu-quota": 3}, idempotency_key="k1"))
        assert code == 200 and granted["state"] == "succeeded"
        assert granted["result"]["lease_id"] == granted["id"]
        assert granted["timings"]["act_s"] >= granted["timings"]["queue_s"] >= 0
        # 3 of 4 units are held; a 2-unit lease must wait until the first is returned
        code, waiting = await live.call("POST", "/v1/actions", json=lease(demand={"lease.gpu-quota": 2}))
        assert code == 201
        await asyncio.sleep(0.1)
        assert (await live.call("GET", f"/v1/actions/{waiting['id']}"))[1]["state"] == "queued"
        code, replay = await live.call("POST", "/v1/actions", json=lease(demand={"lease.gpu-quota": 3},
                                                                       idempotency_key="k1"))
        assert code == 200 and replay["id"] == granted["id"]
        code, returned = await live.call("DELETE", f"/v1/leases/{granted['id']}")
        assert code == 200 and returned["result"]["returned"] == "released"
        code, second = await live.call("GET", f"/v1/actions/{waiting['id']}?wait=true&wait_timeout_s=5")
        assert second["state"] == "succeeded"
        code, _ = await live.call("DELETE", f"/v1/leases/{granted['id']}")
        assert code == 409
        _, resources = await live.call("GET", "/v1/resources")
        row = next(r for r in resources["resources"] if r["resource"] == "lease.gpu-quota")
        assert (row["capacity"], row["in_use"], row["queued"]) == (4, 2, 0)


async def test_cancel_queued_action_and_queued_deadline(db):
    async with live_broker(LEASES, db) as live:
        await live.call("POST", "/v1/actions?wait=true", json=lease(demand={"lease.gpu-quota": 4}))
        _, queued = await live.call("POST", "/v1/actions", json=lease())
        code, cancelled = await live.call("DELETE", f"/v1/actions/{queued['id']}")
        assert code == 200 and cancelled["state"] == "cancelled"
        assert (await live.call("DELETE", f"/v1/actions/{queued['id']}"))[0] == 409
        _, doomed = await live.call("POST", "/v1/actions", json=lease(timeout_s=0.3))
        code, final = await live.call("GET", f"/v1/actions/{doomed['id']}?wait=true&wait_timeout_s=5")
        assert final["state"] == "timed_out" and final["error"]["code"] == "timed_out"
        assert len(live.broker.queue) == 0


async def test_abandoned_lease_comes_back_after_its_ttl(db):
    async with live_broker(LEASES, db) as live:
        _, held = await live.call("POST", "/v1/actions?wait=true",
                                  json=lease(demand={"lease.gpu-quota": 4}, spec={"ttl_s": 0.3}))
        assert held["state"] == "succeeded"
        code, next_one = await live.call("POST", "/v1/actions?wait=true&wait_timeout_s=5", json=lease())
        assert code == 200 and next_one["state"] == "succeeded"
        _, record = await live.call("GET", f"/v1/actions/{held['id']}")
        assert record["result"]["returned"] == "expired"


@pytest.mark.slow  # seconds: left out of the fast lane
async def test_thousand_api_actions_respect_concurrency_and_end_exactly_once(db):
    limit = 4
    async with live_upstream(delay_s=0.002) as upstream:
        config = {"basic": {"api.search": {"concurrency": limit, "upstream": {"base_url": upstream.url}}}}
        async with live_broker(config, db) as live:
            ids = []
            for batch in range(10):
                actions = [{"task": "search", "kind": "api", "demand": {"api.search": 1},
                            "spec": {"method": "POST", "path": "/q", "body": {"n": batch * 100 + i}}}
                           for i in range(100)]
                code, reply = await live.call("POST", "/v1/actions:batch", json={"actions": actions})
                assert code == 200 and reply["created"] == 100
                ids += [record["id"] for record in reply["actions"]]
            finals = await asyncio.gather(*(live.call("GET", f"/v1/actions/{i}?wait=true&wait_timeout_s=60")
                                            for i in ids))
            assert all(record["state"] == "succeeded" for _, record in finals)
            assert sorted(record["result"]["body"]["echo"]["n"] for _, record in finals) == list(range(1000))
            assert sorted(body["n"] for body in upstream.seen) == list(range(1000))  # each served exactly once
            assert upstream.max_in_flight == limit  # the limit was used, and never exceeded
            await live.broker.store.flush()
            assert len(set(ids)) == 1000


async def test_leases_with_a_quota_per_period_never_exceed_it(db):
    quota, period = 50, 0.5
    config = {"basic": {"lease.q": {"quota": quota, "period_s": period}}}
    async with live_broker(config, db) as live:
        actions = [{"task": "q", "kind": "lease", "demand": {"lease.q": 1}} for _ in range(150)]
        started = time.monotonic()
        _, reply = await live.call("POST", "/v1/actions:batch", json={"actions": actions})
        finals = await asyncio.gather(*(live.call("GET", f"/v1/actions/{r['id']}?wait=true&wait_timeout_s=30")
                                        for r in reply["actions"]))
        assert all(record["state"] == "succeeded" for _, record in finals)
        assert time.monotonic() - started >= 2 * period  # 150 grants need three windows
        grants = sorted(record["started_at"] for _, record in finals)
        for i, t in enumerate(grants):  # no sliding window of one period holds more than the quota
            assert sum(1 for u in grants[i:] if u < t + period * 0.98) <= quota
        for _, record in finals:
            assert (await live.call("DELETE", f"/v1/leases/{record['id']}"))[0] == 200


async def test_metrics_openapi_health_and_resources(db):
    async with live_broker(LEASES, db) as live:
        await live.call("POST", "/v1/actions?wait=true", json=lease())
        # the other three units held, a fifth lease waits past its deadline: its end is counted with its code
        for _ in range(3):
            await live.call("POST", "/v1/actions?wait=true", json=lease())
        code, late = await live.call("POST", "/v1/actions?wait=true", json=lease(timeout_s=0.2))
        assert (late["state"], late["error"]["code"]) == ("timed_out", "timed_out"), late
        code, text = await live.call("GET", "/metrics")
        assert code == 200
        for name in ("tangram_action_completion_seconds_bucket", "tangram_schedule_pass_seconds_count",
                     'tangram_units_in_use{pool="default",resource="lease.gpu-quota"} 4.0',
                     'tangram_queue_length{resource="lease.gpu-quota"} 0.0',  # idle resources export a 0
                     'tangram_actions_finished_total{error="",kind="lease",state="succeeded",task="t1"} 4.0',
                     'tangram_actions_finished_total{error="timed_out",kind="lease",state="timed_out",task="t1"} 1.0',
                     'tangram_build_info{version="', "process_resident_memory_bytes ", "python_info{"):
            assert name in text, name
        code, doc = await live.call("GET", "/openapi.json")
        assert code == 200 and doc["openapi"].startswith("3.")
        assert {"/v1/actions", "/v1/actions:batch", "/v1/actions/{id}", "/v1/leases/{id}"} <= set(doc["paths"])
        assert (await live.call("GET", "/healthz")) == (200, {"status": "ok", "queued": 0, "running": 0})


async def test_idempotency_within_a_batch_and_after_memory_forgets(db):
    async with live_broker({**LEASES, "scheduler": {"retain_s": 0.0}}, db) as live:
        batch = [lease(idempotency_key="same"), lease(idempotency_key="same"), lease(idempotency_key="other")]
        code, reply = await live.call("POST", "/v1/actions:batch", json={"actions": batch})
        first, again, other = (record["id"] for record in reply["actions"])
        assert code == 200 and reply["created"] == 2 and first == again != other
        await live.call("DELETE", f"/v1/leases/{first}")
        await live.broker.store.flush()
        live.broker.tick()  # retain_s = 0: the finished record leaves memory, the store still answers
        assert first not in live.broker.actions
        code, replay = await live.call("POST", "/v1/actions", json=lease(idempotency_key="same"))
        assert (code, replay["id"], replay["state"]) == (200, first, "succeeded")
        code, reply = await live.call("POST", "/v1/actions", json=lease(idempotency_key="bad\u0000key"))
        assert (code, reply["error"]["field"]) == (400, "idempotency_key")


async def test_a_key_reused_for_another_request_is_a_409(db):
    """A key names one request: the earlier action's record would be a wrong answer to a different body, whether
    that action is in memory, only in the store, or earlier in the same batch. The same body still replays."""
    async with live_broker({**LEASES, "scheduler": {"retain_s": 0.0}}, db) as live:
        code, first = await live.call("POST", "/v1/actions", json=lease(idempotency_key="k", timeout_s=60))
        assert code == 201
        for other in (lease(idempotency_key="k", timeout_s=61), lease(idempotency_key="k", timeout_s=60,
                                                                     demand={"lease.gpu-quota": 2})):
            code, reply = await live.call("POST", "/v1/actions", json=other)
            assert (code, reply["error"]["field"], reply["error"]["action"]) == (409, "idempotency_key", first["id"])
            assert "another request" in reply["error"]["reason"]
        code, replay = await live.call("POST", "/v1/actions", json=lease(idempotency_key="k", timeout_s=60.0))
        assert (code, replay["id"]) == (200, first["id"])
        await live.call("DELETE", f"/v1/leases/{first['id']}")
        await live.broker.store.flush()
        live.broker.tick()  # retain_s = 0: the record leaves memory; the store answers for the key
        assert first["id"] not in live.broker.actions
        code, reply = await live.call("POST", "/v1/actions", json=lease(idempotency_key="k", signature="other"))
        assert (code, reply["error"]["field"]) == (409, "idempotency_key") and "signature" in reply["error"]["reason"]
        code, replay = await live.call("POST", "/v1/actions", json=lease(idempotency_key="k", timeout_s=60))
        assert (code, replay["id"]) == (200, first["id"])
        batch = [lease(idempotency_key="b"), lease(), lease(idempotency_key="b", trajectory="t-2")]
        code, reply = await live.call("POST", "/v1/actions:batch", json={"actions": batch})
        assert (code, reply["error"]["field"]) == (409, "actions[2].idempotency_key"), reply
        assert len(live.broker.queue) == 0 and list(live.broker.actions) == []  # nothing of the batch was queued


async def test_running_api_action_is_cancelled_or_timed_out_and_frees_its_unit(db):
    async with live_upstream() as upstream:
        config = {"basic": {"api.slow": {"concurrency": 1, "upstream": {"base_url": upstream.url}}}}
        async with live_broker(config, db) as live:
            slow = {"task": "t", "kind": "api", "demand": {"api.slow": 1},
                    "spec": {"method": "POST", "path": "/s", "body": {"sleep_s": 5}}}
            _, running = await live.call("POST", "/v1/actions", json=slow)
            for _ in range(100):
                if upstream.in_flight:
                    break
                await asyncio.sleep(0.02)
            assert (await live.call("GET", f"/v1/actions/{running['id']}"))[1]["state"] == "running"
            code, cancelled = await live.call("DELETE", f"/v1/actions/{running['id']}")
            assert (code, cancelled["state"]) == (200, "cancelled")
            _, doomed = await live.call("POST", "/v1/actions?wait=true", json={**slow, "timeout_s": 0.3})
            assert doomed["state"] == "timed_out" and doomed["timings"]["execution_s"] >= 0.2
            _, resources = await live.call("GET", "/v1/resources")
            assert [r["in_use"] for r in resources["resources"] if r["resource"] == "api.slow"] == [0]
            fast = {**slow, "spec": {**slow["spec"], "body": {"sleep_s": 0}}}
            assert (await live.call("POST", "/v1/actions?wait=true", json=fast))[1]["state"] == "succeeded"


async def test_learned_profiles_are_listed_most_observed_first_with_a_bounded_limit(db):
    async with live_broker(LEASES, db) as live:
        for task in ("t1", "t1", "t1", "t2"):
            assert (await live.call("POST", "/v1/actions?wait=true", json=lease(task=task)))[0] == 200
        code, body = await live.call("GET", "/v1/profiles")
        assert code == 200 and body["total"] == 2
        assert [(p["task"], p["samples"]) for p in body["profiles"]] == [("t1", 3), ("t2", 1)]
        signature = body["profiles"][0]["signature"]
        assert signature == body["profiles"][1]["signature"] and body["profiles"][0]["t1_s"] >= 0
        assert body["profiles"][0]["speedup"] is None  # a lease is not elastic: no speed-up model
        code, body = await live.call("GET", "/v1/profiles?task=t2&limit=1")
        assert (code, body["total"], [p["task"] for p in body["profiles"]]) == (200, 1, ["t2"])
        for bad in ("0", "10001", "x", "-1"):
            code, reply = await live.call("GET", f"/v1/profiles?limit={bad}")
            assert (code, reply["error"]["field"]) == (400, "limit"), bad


async def test_manager_endpoints_answer_by_what_the_broker_has(db):
    """Environments and services are found by capability: a broker without a CPU or GPU manager says so."""
    async with live_broker(LEASES, db) as live:
        code, body = await live.call("POST", "/v1/environments", json={"task": "t1"})
        assert code == 422 and body["error"]["field"] == "path" and "CPU manager" in body["error"]["reason"]
        code, body = await live.call("GET", "/v1/services")
        assert code == 200 and body == {"services": []}
        code, body = await live.call("GET", "/v1/services/rm")
        assert code == 404 and body["error"]["field"] == "name"
