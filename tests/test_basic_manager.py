"""Basic manager (§5.1): fits, allocation, validation, leases, and the API proxy against a real loopback upstream."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from managers.basic.manager import BasicManager, BasicResourceConfig, UpstreamConfig
from tangram.core.action import Action, Demand, Kind
from tangram.core.errors import ActionFailed, BadRequest, ConfigError, RequestError, Unprocessable
from tangram.server.http_errors import status_of


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def api(resource: str = "api.search", units: int = 1, **spec: Any) -> Action:
    spec.setdefault("path", "/search")
    return Action(task="t", kind=Kind.API, demands={resource: Demand.fixed(units)}, spec=spec)


def lease(demands: dict[str, int], **spec: Any) -> Action:
    return Action(task="t", kind=Kind.LEASE, demands={r: Demand.fixed(n) for r, n in demands.items()}, spec=spec)


def allocate(manager: BasicManager, action: Action):
    units = action.min_units()
    return manager.allocate(action, units, dict.fromkeys(units, "default"))


def row(manager: BasicManager, resource: str):
    return next(r for r in manager.status() if r.resource == resource)


# -- a scriptable upstream on loopback -------------------------------------------------------------------

Step = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes
    at: float


@dataclass
class ScriptedUpstream:
    url: str = ""
    script: deque[Step] = field(default_factory=deque)
    seen: list[Seen] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            self.seen.append(Seen(request.method, request.path, dict(request.query), dict(request.headers),
                                  await request.read(), time.monotonic()))
            step = self.script.popleft() if self.script else reply(200, {"ok": True})
            return await step(request)
        finally:
            self.in_flight -= 1


def reply(status: int, payload: Any = None, headers: dict[str, str] | None = None, text: str | None = None) -> Step:
    async def step(request: web.Request) -> web.StreamResponse:
        if text is not None:
            return web.Response(status=status, text=text, headers=headers)
        return web.json_response(payload, status=status, headers=headers)
    return step


def echo() -> Step:
    async def step(request: web.Request) -> web.StreamResponse:
        return web.json_response({"method": request.method, "query": dict(request.query),
                                  "body": (await request.read()).decode()})
    return step


def hang(upstream: ScriptedUpstream) -> Step:
    async def step(request: web.Request) -> web.StreamResponse:
        await upstream.stop.wait()
        return web.Response(status=200)
    return step


def delay(seconds: float) -> Step:
    async def step(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(seconds)
        return web.json_response({"ok": True})
    return step


def streamed(size: int) -> Step:
    """A chunked body with no Content-Length, so the cap must be enforced while reading."""
    async def step(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for _ in range(size // 1024):
            await response.write(b"x" * 1024)
        await response.write_eof()
        return response
    return step


@pytest.fixture
async def upstream() -> AsyncIterator[ScriptedUpstream]:
    up = ScriptedUpstream()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", up.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    up.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield up
    up.stop.set()
    await runner.cleanup()


@pytest.fixture
async def make(upstream: ScriptedUpstream) -> AsyncIterator[Callable[..., Awaitable[BasicManager]]]:
    """Build and start a manager with one upstream-backed resource ``api.search``."""
    started: list[BasicManager] = []

    async def build(concurrency: int | None = 4, quota: int | None = None, period_s: float = 60.0,
                    clock: Callable[[], float] = time.monotonic, **upstream_kw: Any) -> BasicManager:
        upstream_kw.setdefault("backoff_s", 0.01)
        config = BasicResourceConfig("api.search", concurrency=concurrency, quota=quota, period_s=period_s,
                                     upstream=UpstreamConfig(upstream.url, **upstream_kw))
        manager = BasicManager([config], clock=clock)
        await manager.start()
        started.append(manager)
        return manager

    yield build
    for manager in started:
        await manager.close()


async def run(manager: BasicManager, action: Action) -> dict[str, Any]:
    manager.validate(action)
    allocation = allocate(manager, action)
    try:
        return (await manager.execute(action, allocation)).result
    finally:
        manager.release(allocation)


# -- configuration ----------------------------------------------------------------------------------------

def test_a_resource_needs_a_concurrency_or_a_quota() -> None:
    with pytest.raises(ConfigError) as err:
        BasicManager([BasicResourceConfig("api.search")])
    assert err.value.key == "basic.api.search.concurrency"


@pytest.mark.parametrize("config, key", [
    (BasicResourceConfig("api.a", quota=0), "basic.api.a.quota"),
    (BasicResourceConfig("api.a", concurrency=2, period_s=0), "basic.api.a.period_s"),
    (BasicResourceConfig("api.a", concurrency=1, upstream=UpstreamConfig("ftp://x")),
     "basic.api.a.upstream.base_url"),
    (BasicResourceConfig("api.a", concurrency=1, upstream=UpstreamConfig("http://h/?q=1")),
     "basic.api.a.upstream.base_url"),
    (BasicResourceConfig("api.a", concurrency=1, upstream=UpstreamConfig("http://h", max_retries=-1)),
     "basic.api.a.upstream.max_retries"),
])
def test_bad_settings_name_their_key(config: BasicResourceConfig, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        BasicManager([config])
    assert err.value.key == key


def test_duplicate_resource_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="twice"):
        BasicManager([BasicResourceConfig("api.a", quota=1), BasicResourceConfig("api.a", quota=2)])


def test_capacity_is_concurrency_else_quota_and_largest_pool_the_tighter_limit() -> None:
    manager = BasicManager([BasicResourceConfig("api.a", concurrency=8, quota=600),
                            BasicResourceConfig("api.b", quota=5),
                            BasicResourceConfig("lease.c", concurrency=3, quota=2)])
    assert dict(manager.resources) == {"api.a": 8, "api.b": 5, "lease.c": 3}
    assert [manager.largest_pool(r) for r in ("api.a", "api.b", "lease.c")] == [8, 5, 2]


# -- fit, allocate, release ------------------------------------------------------------------------------

def test_fit_respects_concurrency_and_remove_undoes_try_add() -> None:
    manager = BasicManager([BasicResourceConfig("lease.a", concurrency=3)], clock=Clock())
    allocate(manager, lease({"lease.a": 1}))
    fit = manager.fit()
    assert fit.free_before("lease.a", "default") == 2
    first, second, third = (lease({"lease.a": 1}) for _ in range(3))
    assert fit.try_add(first, {"lease.a": 1})
    assert fit.try_add(second, {"lease.a": 1})
    assert not fit.try_add(third, {"lease.a": 1})
    fit.remove(first)
    assert fit.try_add(third, {"lease.a": 1})
    assert not fit.try_add(first, {"lease.a": 1})
    assert fit.pool_of(third, "lease.a") == "default"
    assert row(manager, "lease.a").in_use == 1  # the fit is scratch: the manager did not change


def test_fit_respects_the_quota_window_which_release_does_not_refill() -> None:
    clock = Clock()
    manager = BasicManager([BasicResourceConfig("api.a", concurrency=10, quota=3, period_s=60)], clock=clock)
    for _ in range(2):
        manager.release(allocate(manager, lease({"api.a": 1})))
    fit = manager.fit()
    assert fit.free_before("api.a", "default") == 1  # concurrency is free (10) but only 1 quota unit is left
    assert fit.try_add(lease({"api.a": 1}), {"api.a": 1})
    assert not fit.try_add(lease({"api.a": 1}), {"api.a": 1})
    clock.now += 60
    assert manager.fit().free_before("api.a", "default") == 3


def test_a_refused_try_add_leaves_the_fit_unchanged() -> None:
    manager = BasicManager([BasicResourceConfig("lease.a", concurrency=2),
                            BasicResourceConfig("lease.b", concurrency=1)], clock=Clock())
    fit = manager.fit()
    assert not fit.try_add(lease({"lease.a": 2, "lease.b": 2}), {"lease.a": 2, "lease.b": 2})
    assert fit.try_add(lease({"lease.a": 2}), {"lease.a": 2})  # lease.a was not partly taken by the refusal


def test_allocate_takes_both_limits_and_release_is_idempotent() -> None:
    manager = BasicManager([BasicResourceConfig("api.a", concurrency=2, quota=5)], clock=Clock())
    allocation = allocate(manager, lease({"api.a": 2}))
    assert allocation.placement == {"resource": {"api.a": 2}}
    assert allocation.pools == {"api.a": "default"}
    status = row(manager, "api.a")
    assert (status.in_use, status.extra["quota_used_in_window"]) == (2, 2)
    manager.release(allocation)
    manager.release(allocation)
    status = row(manager, "api.a")
    assert (status.in_use, status.extra["quota_used_in_window"]) == (0, 2)
    assert status.extra == {"concurrency": 2, "quota": 5, "period_s": 60.0, "quota_used_in_window": 2,
                            "held": 0, "leases": 0}


def test_allocate_refuses_what_does_not_fit_and_changes_nothing() -> None:
    manager = BasicManager([BasicResourceConfig("api.a", concurrency=1, quota=5)], clock=Clock())
    allocate(manager, lease({"api.a": 1}))
    with pytest.raises(RuntimeError, match="over-allocation"):
        allocate(manager, lease({"api.a": 1}))
    assert row(manager, "api.a").extra["quota_used_in_window"] == 1


# -- validation -------------------------------------------------------------------------------------------

@pytest.fixture
def checker() -> BasicManager:
    return BasicManager([BasicResourceConfig("api.search", concurrency=2, upstream=UpstreamConfig("http://h:1")),
                         BasicResourceConfig("api.other", concurrency=2, upstream=UpstreamConfig("http://h:2")),
                         BasicResourceConfig("api.budget", quota=100),
                         BasicResourceConfig("lease.slot", concurrency=4, lease_ttl_s=30)])


@pytest.mark.parametrize("path", ["http://evil", "//evil", "/a/../b", "/a/%2e%2E/b", "/..", "relative", "0",
                                  "/x?y=1", "/a b", "", "/a\\..\\b", "/a://evil", "/%zz"])
def test_paths_that_could_leave_the_upstream_are_rejected(checker: BasicManager, path: str) -> None:
    """Refused as malformed: the document's schema states the path's grammar (its pattern is the validator)."""
    with pytest.raises(BadRequest) as err:
        checker.validate(api(path=path))
    assert err.value.field == "spec.path"


@pytest.mark.parametrize("spec, field", [
    ({"method": "TRACE"}, "spec.method"),
    ({"query": {"q": True}}, "spec.query.q"),
    ({"query": ["q"]}, "spec.query"),
    ({"headers": {"X-A": 1}}, "spec.headers.X-A"),
    ({"headers": {"X-A": "a\r\nInjected: 1"}}, "spec.headers.X-A"),
    ({"headers": {"bad name": "v"}}, "spec.headers.bad name"),
    ({"headers": {"X-A\n": "v"}}, "spec.headers.X-A\n"),
    ({"url": "http://evil"}, "spec.url"),
])
def test_bad_api_specs_name_the_field(checker: BasicManager, spec: dict[str, Any], field: str) -> None:
    with pytest.raises(BadRequest) as err:
        checker.validate(api(**spec))
    assert err.value.field == field


def test_a_body_and_a_text_body_together_are_unprocessable(checker: BasicManager) -> None:
    with pytest.raises(Unprocessable) as err:
        checker.validate(api(body={}, body_text="x"))
    assert err.value.field == "spec.body_text"


def test_good_api_spec_passes(checker: BasicManager) -> None:
    checker.validate(api(method="POST", path="/v1/search/%20x", query={"q": "a", "n": 3},
                         headers={"Authorization": "Bearer t"}, body={"k": [1, 2]}))


def test_api_action_routes_to_exactly_one_upstream(checker: BasicManager) -> None:
    both = Action(task="t", kind=Kind.API, spec={"path": "/"},
                  demands={"api.search": Demand.fixed(1), "api.other": Demand.fixed(1)})
    none = Action(task="t", kind=Kind.API, spec={"path": "/"}, demands={"api.budget": Demand.fixed(1)})
    for action in (both, none):
        with pytest.raises(Unprocessable) as err:
            checker.validate(action)
        assert err.value.field == "demand"
    checker.validate(Action(task="t", kind=Kind.API, spec={"path": "/"},
                            demands={"api.search": Demand.fixed(1), "api.budget": Demand.fixed(1)}))


def test_demand_beyond_capacity_is_unprocessable(checker: BasicManager) -> None:
    with pytest.raises(Unprocessable) as err:
        checker.validate(api(units=3))
    assert (err.value.field, status_of(err.value)) == ("demand.api.search", 422)


def test_foreign_resources_are_rejected_for_basic_kinds(checker: BasicManager) -> None:
    with pytest.raises(Unprocessable) as err:
        checker.validate(lease({"lease.slot": 1, "cpu": 1}))
    assert err.value.field == "demand.cpu"


@pytest.mark.parametrize("spec, field, refusal", [
    ({"ttl_s": 0}, "spec.ttl_s", BadRequest), ({"ttl_s": "5"}, "spec.ttl_s", BadRequest),
    ({"ttl": 5}, "spec.ttl", BadRequest),
    ({"ttl_s": 31}, "spec.ttl_s", Unprocessable)])  # over this resource's lease_ttl_s, which the schema cannot know
def test_lease_spec_bounds(checker: BasicManager, spec: dict[str, Any], field: str,
                           refusal: type[RequestError]) -> None:
    with pytest.raises(refusal) as err:
        checker.validate(lease({"lease.slot": 1}, **spec))
    assert err.value.field == field
    checker.validate(lease({"lease.slot": 1}, ttl_s=30))


# -- leases and time-driven changes --------------------------------------------------------------------------

async def test_lease_is_held_until_its_ttl_then_reported_until_released() -> None:
    clock = Clock()
    manager = BasicManager([BasicResourceConfig("lease.slot", concurrency=2, lease_ttl_s=30)], clock=clock)
    action = lease({"lease.slot": 2}, ttl_s=10)
    allocation = allocate(manager, action)
    outcome = manager.grant(action, allocation)
    assert outcome.hold
    assert outcome.result == {"lease_id": action.id, "expires_in_s": 10.0, "units": {"lease.slot": 2}}
    assert (row(manager, "lease.slot").in_use, row(manager, "lease.slot").extra["leases"]) == (2, 1)
    assert manager.next_change_in() == pytest.approx(10.0)
    clock.now += 9.5
    assert manager.expired_leases() == []
    assert manager.next_change_in() == pytest.approx(0.5)
    clock.now += 0.5
    assert manager.expired_leases() == [action.id]
    assert manager.expired_leases() == [action.id]  # still reported: the broker has not released it yet
    assert manager.next_change_in() == 0.0
    manager.release(allocation)
    assert manager.expired_leases() == []
    assert manager.next_change_in() is None
    assert (row(manager, "lease.slot").in_use, row(manager, "lease.slot").extra["leases"]) == (0, 0)


async def test_lease_ttl_defaults_to_the_resource_maximum_and_early_release_clears_it() -> None:
    clock = Clock()
    manager = BasicManager([BasicResourceConfig("lease.slot", concurrency=2, lease_ttl_s=30),
                            BasicResourceConfig("lease.wide", concurrency=2, lease_ttl_s=300)], clock=clock)
    short, long = lease({"lease.slot": 1, "lease.wide": 1}), lease({"lease.wide": 1})
    short_alloc, long_alloc = allocate(manager, short), allocate(manager, long)
    assert manager.grant(short, short_alloc).result["expires_in_s"] == 30.0
    assert manager.grant(long, long_alloc).result["expires_in_s"] == 300.0
    assert manager.next_change_in() == pytest.approx(30.0)
    manager.release(short_alloc)  # the client returned it early
    assert manager.next_change_in() == pytest.approx(300.0)
    clock.now += 300
    assert manager.expired_leases() == [long.id]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grant", "release", "regrant", "wait"]), st.integers(0, 3),
                          st.floats(0.5, 40.0)), max_size=60))
def test_expired_leases_are_those_due_by_now_soonest_first_however_held_and_released(
        steps: list[tuple[str, int, float]]) -> None:
    """The walk of the expiry heap answers what a scan of every held lease would: each lease due by now (once,
    by its current expiry), soonest first, ties by id."""
    clock = Clock()
    manager = BasicManager([BasicResourceConfig("lease.slot", concurrency=1000, lease_ttl_s=60)], clock=clock)
    actions = [lease({"lease.slot": 1}) for _ in range(4)]
    held: dict[int, Any] = {}
    expiries: dict[str, float] = {}
    for op, which, seconds in steps:
        action = actions[which]
        if op == "grant" and which not in held:
            held[which] = allocate(manager, action)
            manager.grant(action, held[which])
            expiries[action.id] = clock.now + 60  # the resource's lease_ttl_s: the spec asks for none
        elif op == "release" and which in held:
            manager.release(held.pop(which))
            expiries.pop(action.id)
        elif op == "regrant" and which not in held:  # a lease a previous process granted, held again
            action.units = {"lease.slot": 1}
            held[which] = manager.regrant(action, seconds)
            expiries[action.id] = clock.now + seconds
        elif op == "wait":
            clock.now += seconds
        due = sorted((at, action_id) for action_id, at in expiries.items() if at <= clock.now)
        assert manager.expired_leases() == [action_id for _, action_id in due]


def test_next_change_in_reports_when_a_quota_refused_demand_fits_again() -> None:
    clock = Clock(0.0)
    manager = BasicManager([BasicResourceConfig("api.a", concurrency=5, quota=2, period_s=60)], clock=clock)
    assert manager.next_change_in() is None
    allocate(manager, lease({"api.a": 1}))
    clock.now = 10.0
    allocate(manager, lease({"api.a": 1}))
    clock.now = 20.0
    fit = manager.fit()
    assert not fit.try_add(lease({"api.a": 2}), {"api.a": 2})
    assert manager.next_change_in() == pytest.approx(50.0)  # both units are back at t=70
    fit = manager.fit()
    assert not fit.try_add(lease({"api.a": 1}), {"api.a": 1})
    assert manager.next_change_in() == pytest.approx(40.0)  # one unit is back at t=60
    manager.fit()  # a pass with nothing refused: nothing to wake up for
    assert manager.next_change_in() is None


def test_a_concurrency_refusal_needs_no_timer() -> None:
    manager = BasicManager([BasicResourceConfig("api.a", concurrency=1, quota=10)], clock=Clock())
    allocate(manager, lease({"api.a": 1}))
    assert not manager.fit().try_add(lease({"api.a": 1}), {"api.a": 1})
    assert manager.next_change_in() is None  # a release, not time, frees it


# -- the proxy ---------------------------------------------------------------------------------------------

async def test_proxy_forwards_method_path_query_headers_and_json_body(make, upstream: ScriptedUpstream) -> None:
    manager = await make()
    upstream.script.append(reply(201, {"hits": [1, 2]}, headers={"X-RateLimit-Remaining": "7", "X-Secret": "s"}))
    result = await run(manager, api(method="POST", path="/v1/search", query={"q": "cat", "n": 2},
                                    headers={"Authorization": "Bearer t", "Host": "evil.example",
                                             "Connection": "close, X-Authorization", "Upgrade": "websocket"},
                                    body={"k": "v"}))
    assert result["status"] == 201 and result["attempts"] == 1
    assert result["body"] == {"hits": [1, 2]}
    assert result["headers"]["content-type"].startswith("application/json")
    assert result["headers"]["x-ratelimit-remaining"] == "7" and "x-secret" not in result["headers"]
    seen = upstream.seen[0]
    assert (seen.method, seen.path, seen.query) == ("POST", "/v1/search", {"q": "cat", "n": "2"})
    assert seen.headers["Authorization"] == "Bearer t"
    assert seen.headers["Host"] == upstream.url.removeprefix("http://")
    assert "Upgrade" not in seen.headers and "close" not in seen.headers.get("Connection", "")
    assert seen.body == b'{"k": "v"}'


async def test_proxy_sends_text_and_returns_text(make, upstream: ScriptedUpstream) -> None:
    manager = await make()
    upstream.script.append(reply(200, text="plain answer"))
    result = await run(manager, api(method="PUT", path="/doc", body_text="raw body"))
    assert result["body"] == "plain answer"
    assert upstream.seen[0].body == b"raw body"


async def test_upstream_4xx_is_a_result_not_a_retry(make, upstream: ScriptedUpstream) -> None:
    manager = await make()
    upstream.script.append(reply(404, {"error": "no such doc"}))
    result = await run(manager, api())
    assert (result["status"], result["body"], result["attempts"]) == (404, {"error": "no such doc"}, 1)
    assert len(upstream.seen) == 1


async def test_redirects_are_returned_not_followed(make, upstream: ScriptedUpstream) -> None:
    manager = await make()
    upstream.script.append(reply(302, text="", headers={"Location": "http://169.254.169.254/latest"}))
    result = await run(manager, api())
    assert (result["status"], result["headers"]["location"]) == (302, "http://169.254.169.254/latest")
    assert len(upstream.seen) == 1


async def test_retries_a_500_then_succeeds(make, upstream: ScriptedUpstream) -> None:
    manager = await make()
    upstream.script.extend([reply(500, {"e": 1}), reply(200, {"ok": 1})])
    result = await run(manager, api())
    assert (result["status"], result["body"], result["attempts"]) == (200, {"ok": 1}, 2)
    assert len(upstream.seen) == 2


async def test_429_retry_after_is_honoured(make, upstream: ScriptedUpstream) -> None:
    manager = await make(backoff_s=0.001)
    upstream.script.extend([reply(429, {}, headers={"Retry-After": "1"}), reply(200, {"ok": 1})])
    result = await run(manager, api())
    assert result["attempts"] == 2
    assert upstream.seen[1].at - upstream.seen[0].at >= 0.95


async def test_retry_after_beyond_a_minute_falls_back_to_backoff(make, upstream: ScriptedUpstream) -> None:
    manager = await make(backoff_s=0.01)
    upstream.script.extend([reply(429, {}, headers={"Retry-After": "3600"}), reply(200, {"ok": 1})])
    result = await asyncio.wait_for(run(manager, api()), 5)
    assert result["attempts"] == 2
    assert upstream.seen[1].at - upstream.seen[0].at < 1.0


async def test_retries_spend_quota(make, upstream: ScriptedUpstream) -> None:
    manager = await make(quota=2, period_s=60)
    upstream.script.extend([reply(500, {}), reply(200, {"ok": 1})])
    result = await run(manager, api())
    assert result["attempts"] == 2
    assert row(manager, "api.search").extra["quota_used_in_window"] == 2
    assert manager.fit().free_before("api.search", "default") == 0


async def test_retries_wait_for_quota_instead_of_exceeding_it(make, upstream: ScriptedUpstream) -> None:
    manager = await make(quota=1, period_s=0.5)
    upstream.script.extend([reply(503, {}), reply(200, {"ok": 1})])
    result = await run(manager, api())
    assert result["attempts"] == 2
    assert upstream.seen[1].at - upstream.seen[0].at >= 0.45  # the retry waited for the window to free a unit


async def test_exhausted_retries_fail_with_attempts_and_last_status(make, upstream: ScriptedUpstream) -> None:
    manager = await make(max_retries=2)
    upstream.script.extend([reply(503, {})] * 3 + [reply(200, {"ok": 1})])
    with pytest.raises(ActionFailed) as err:
        await run(manager, api())
    assert err.value.code == "upstream_unavailable"
    assert err.value.details == {"status": 503, "attempts": 3}
    assert len(upstream.seen) == 3
    assert row(manager, "api.search").in_use == 0


async def test_connection_errors_are_retried_then_fail_without_status(upstream: ScriptedUpstream) -> None:
    dead = BasicResourceConfig("api.search", concurrency=1,
                               upstream=UpstreamConfig("http://127.0.0.1:1", max_retries=1, backoff_s=0.01))
    manager = BasicManager([dead])
    await manager.start()
    try:
        with pytest.raises(ActionFailed) as err:
            await run(manager, api())
    finally:
        await manager.close()
    assert err.value.details == {"status": None, "attempts": 2}


async def test_timeout_applies_per_attempt(make, upstream: ScriptedUpstream) -> None:
    manager = await make(timeout_s=0.3, max_retries=1)
    upstream.script.extend([hang(upstream), reply(200, {"ok": 1})])
    started = time.monotonic()
    result = await run(manager, api())
    assert (result["status"], result["attempts"]) == (200, 2)
    assert 0.3 <= time.monotonic() - started < 2.0


async def test_timeouts_exhaust_retries(make, upstream: ScriptedUpstream) -> None:
    manager = await make(timeout_s=0.2, max_retries=1)
    upstream.script.extend([hang(upstream), hang(upstream)])
    with pytest.raises(ActionFailed) as err:
        await run(manager, api())
    assert err.value.details["attempts"] == 2
    assert "timed out" in err.value.message


@pytest.mark.parametrize("chunked", [False, True])
async def test_response_body_cap(make, upstream: ScriptedUpstream, chunked: bool) -> None:
    manager = await make(max_body_bytes=4096)
    upstream.script.append(streamed(8192) if chunked else reply(200, text="x" * 8192))
    with pytest.raises(ActionFailed) as err:
        await run(manager, api())
    assert err.value.code == "upstream_body_too_large"
    assert len(upstream.seen) == 1  # a too-large answer is final, not retried
    upstream.script.append(streamed(4096) if chunked else reply(200, text="x" * 4096))
    assert len((await run(manager, api()))["body"]) == 4096


async def test_concurrency_limit_holds_at_the_upstream(make, upstream: ScriptedUpstream) -> None:
    """A minimal broker loop (fit -> allocate -> execute -> release) never has more than 2 calls in flight."""
    manager = await make(concurrency=2)
    upstream.script.extend(delay(0.05) for _ in range(8))
    queue = deque(api() for _ in range(8))
    wake = asyncio.Event()
    tasks: list[asyncio.Task[Any]] = []

    async def start(action: Action) -> None:
        allocation = allocate(manager, action)
        try:
            await manager.execute(action, allocation)
        finally:
            manager.release(allocation)
            wake.set()

    while queue:
        fit = manager.fit()
        while queue and fit.try_add(queue[0], queue[0].min_units()):
            tasks.append(asyncio.create_task(start(queue.popleft())))
        wake.clear()
        await wake.wait()
    await asyncio.gather(*tasks)
    assert len(upstream.seen) == 8
    assert upstream.max_in_flight == 2
