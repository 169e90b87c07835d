"""What the upstream APIs answered and how often the broker asked again (issue 39), read from a live broker's
``/metrics`` after real calls to a loopback upstream that rate-limits once, and to a port nobody listens on."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from tests.harness import live_broker, serving
from tests.scrape import scrape


def api_call(resource: str) -> dict[str, Any]:
    return {"task": "t", "kind": "api", "demand": {resource: 1}, "spec": {"method": "GET", "path": "/q"}}


async def test_answers_by_status_and_retries_are_counted_per_api(tmp_path) -> None:
    answered = 0

    async def rate_limit_once(request: web.Request) -> web.Response:
        nonlocal answered
        answered += 1
        if answered == 1:
            return web.json_response({"error": "slow down"}, status=429, headers={"Retry-After": "0"})
        return web.json_response({"ok": True})

    async with serving(rate_limit_once) as url:
        config = {"basic": {"api.limited": {"concurrency": 1, "upstream": {"base_url": url, "backoff_s": 0.0}},
                            "api.down": {"concurrency": 1, "upstream": {"base_url": "http://127.0.0.1:9",
                                                                        "max_retries": 0}}}}
        async with live_broker(config, str(tmp_path / "t.db")) as live:
            _, done = await live.call("POST", "/v1/actions?wait=true", json=api_call("api.limited"))
            _, failed = await live.call("POST", "/v1/actions?wait=true", json=api_call("api.down"))
            metrics = await scrape(live)
    assert done["state"] == "succeeded" and done["result"]["attempts"] == 2, done
    assert failed["error"]["code"] == "upstream_unavailable", failed
    responses = "tangram_upstream_responses_total"
    assert metrics.value(responses, api="api.limited", status="429") == 1
    assert metrics.value(responses, api="api.limited", status="200") == 1
    assert metrics.value(responses, api="api.down", status="no_answer") == 1
    assert metrics.value("tangram_upstream_retries_total", api="api.limited") == 1
    assert metrics.value("tangram_upstream_retries_total", api="api.down") == 0
