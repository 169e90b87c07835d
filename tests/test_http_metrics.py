"""HTTP requests counted by the route they matched, never the raw path (issue 39), read from a live broker's
``/metrics``; and the leader gauge of a broker that runs alone."""

from __future__ import annotations

from tests.harness import live_broker
from tests.scrape import scrape

LEASE = {"task": "t", "kind": "lease", "demand": {"lease.l": 1}, "spec": {"ttl_s": 60}}


async def test_requests_are_counted_and_timed_by_route_template_and_status(tmp_path) -> None:
    async with live_broker({"basic": {"lease.l": {"concurrency": 2}}}, str(tmp_path / "t.db")) as live:
        status, record = await live.call("POST", "/v1/actions?wait=true", json=LEASE)
        assert status == 200, record
        assert (await live.call("GET", f"/v1/actions/{record['id']}"))[0] == 200
        assert (await live.call("GET", "/v1/actions/act-missing"))[0] == 404
        assert (await live.call("GET", "/no/such/path"))[0] == 404
        assert (await live.call("PROPFIND", "/v1/actions"))[0] == 405
        metrics = await scrape(live)
    requests = "tangram_http_requests_total"
    assert metrics.value(requests, method="POST", route="/v1/actions", status="200") == 1
    assert metrics.value(requests, method="GET", route="/v1/actions/{id}", status="200") == 1
    assert metrics.value(requests, method="GET", route="/v1/actions/{id}", status="404") == 1
    assert metrics.value(requests, method="GET", route="unmatched", status="404") == 1
    assert metrics.value(requests, method="other", route="unmatched", status="405") == 1
    assert metrics.value("tangram_http_request_seconds_count", method="GET", route="/v1/actions/{id}") == 2
    routes = {labels["route"] for labels in metrics.labelled(requests)}
    assert not any(record["id"] in route or "missing" in route or "/no/" in route for route in routes), routes
    assert metrics.value("tangram_leader") == 1  # a broker without leader election leads
