"""The status page's sampler on a real broker: bounded, per-interval ACT, utilization summed over pools."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import pytest

from managers.counted import CountedUnitsManager
from tangram.parse import parse_action
from tangram.server.broker_views import broker_stats, resource_rows
from tangram.server.history import History
from tests.harness import Live, live_broker

CONFIG = {"basic": {"lease.x": {"concurrency": 3}}, "pools": {"sim_cores": {"n0": 4, "n1": 4}},
          "cpu": {"enabled": False}}
LEASE = {"task": "t", "kind": "lease", "demand": {"lease.x": 1}}


@pytest.fixture
def db(tmp_path):
    return str(tmp_path / "tangram.db")


async def granted_leases(live: Live, count: int) -> list[dict[str, Any]]:
    """``count`` one-unit leases, each returned once granted."""
    replies = await asyncio.gather(*(live.call("POST", "/v1/actions?wait=true&wait_timeout_s=10", json=LEASE)
                                     for _ in range(count)))
    assert all(record["state"] == "succeeded" for _, record in replies), replies
    return [record for _, record in replies]


async def test_ring_buffer_keeps_only_the_latest_keep_s_of_samples(db):
    async with live_broker(CONFIG, db) as live:
        history = History(live.broker, interval_s=1.0, keep_s=5.0)
        t0 = time.time()
        for i in range(12):
            history.sample(t0 + i)
        assert [s.t for s in history.samples] == [t0 + i for i in range(7, 12)]


async def test_since_returns_only_newer_samples_oldest_first(db):
    async with live_broker(CONFIG, db) as live:
        history = History(live.broker, interval_s=1.0, keep_s=60.0)
        t0 = time.time()
        for i in range(5):
            history.sample(t0 + i)
        assert [s.t for s in history.since(t0 + 2)] == [t0 + 3, t0 + 4]
        assert [s.t for s in history.since(t0 - 10)] == [t0 + i for i in range(5)]
        assert history.since(t0 + 4) == []


async def test_act_percentiles_cover_only_the_actions_finished_in_each_interval(db):
    """Three quick grants, then three grants that waited in the queue, then an idle interval: each sample sees
    its own actions only, so the ACT chart is a time series and not one recent window drawn again."""
    async with live_broker(CONFIG, db) as live:
        history = History(live.broker, interval_s=60.0)
        history.sample(time.time())  # opens the first interval; nothing finished before it
        first = await granted_leases(live, 3)
        quick = history.sample(time.time())

        _, waiting = zip(*await asyncio.gather(*(live.call("POST", "/v1/actions", json=LEASE) for _ in range(3))))
        assert all(record["state"] == "queued" for record in waiting)
        for record in first:
            await live.call("DELETE", f"/v1/leases/{record['id']}")
        finals = [(await live.call("GET", f"/v1/actions/{r['id']}?wait=true&wait_timeout_s=10"))[1] for r in waiting]
        assert all(record["state"] == "succeeded" for record in finals)
        queued = history.sample(time.time())
        idle = history.sample(time.time())

        for taken, records in ((quick, first), (queued, finals)):
            acts = sorted(record["timings"]["act_s"] for record in records)
            assert taken.finished == 3
            assert taken.act_s == {"act_p50_s": acts[1], "act_p90_s": acts[2], "act_p99_s": acts[2]}
        assert idle.finished == 0
        assert idle.act_s == {"act_p50_s": None, "act_p90_s": None, "act_p99_s": None}


@pytest.mark.slow  # seconds: left out of the fast lane
async def test_the_count_of_finished_actions_is_exact_beyond_the_recent_window(db):
    """``broker.recent`` keeps 1000 actions; the count comes from the finished counter, so it does not stop there."""
    async with live_broker({"basic": {"lease.many": {"concurrency": 1500}}, "cpu": {"enabled": False}}, db) as live:
        history = History(live.broker, interval_s=60.0)
        actions = [{"task": "t", "kind": "lease", "demand": {"lease.many": 1}}] * 1200
        _, reply = await live.call("POST", "/v1/actions:batch", json={"actions": actions})
        finals = await asyncio.gather(*(live.call("GET", f"/v1/actions/{r['id']}?wait=true&wait_timeout_s=30")
                                        for r in reply["actions"]))
        assert all(record["state"] == "succeeded" for _, record in finals)
        taken = history.sample()
        assert taken.finished == 1200 and taken.act_s["act_p50_s"] is not None


async def test_utilization_sums_units_over_each_resources_pools(db):
    async with live_broker(CONFIG, db) as live:
        await granted_leases(live, 1)
        counted = next(m for m in live.broker.managers if isinstance(m, CountedUnitsManager))
        holder = parse_action({"task": "t", "kind": "lease", "demand": {"sim_cores": 3}})
        held = [counted.allocate(holder, {"sim_cores": 3}, {"sim_cores": "n0"}),
                counted.allocate(holder, {"sim_cores": 2}, {"sim_cores": "n1"})]
        rows = {(r["resource"], r["pool"]): r["in_use"] for r in resource_rows(live.broker)}
        assert rows == {("lease.x", "default"): 1, ("sim_cores", "n0"): 3, ("sim_cores", "n1"): 2}
        taken = History(live.broker).sample()
        assert taken.utilization == {"lease.x": 1 / 3, "sim_cores": 5 / 8}
        for allocation in held:
            counted.release(allocation)
        assert History(live.broker).sample().utilization["sim_cores"] == 0.0


async def test_queue_depth_and_counts_are_the_brokers(db):
    async with live_broker(CONFIG, db) as live:
        await granted_leases(live, 3)
        for _ in range(2):
            code, _ = await live.call("POST", "/v1/actions", json=LEASE)
            assert code == 201
        taken = History(live.broker).sample()
        assert taken.queued == {"lease.x": 2, "sim_cores": 0}
        assert (taken.queued_total, taken.running, taken.leases) == (2, 0, 3)
        assert taken.to_json()["queued_total"] == broker_stats(live.broker)["queued"]


async def test_the_periodic_task_keeps_sampling_until_cancelled(db):
    async with live_broker(CONFIG, db) as live:
        history = History(live.broker, interval_s=0.05, keep_s=10.0)
        task = asyncio.create_task(history.run())
        while len(history.samples) < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        times = [s.t for s in history.samples]
        assert times == sorted(times) and len(set(times)) == len(times)


async def test_a_bad_interval_or_keep_is_refused(db):
    async with live_broker(CONFIG, db) as live:
        for interval_s, keep_s in ((0.0, 10.0), (-1.0, 10.0), (math.nan, 10.0), (2.0, 1.0), (2.0, math.inf)):
            with pytest.raises(ValueError, match="interval_s|keep_s"):
                History(live.broker, interval_s=interval_s, keep_s=keep_s)
