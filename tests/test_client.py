"""The Python client against a real broker over loopback HTTP: typed records and errors, idempotent retries through
a front that loses answers or sheds load, waits, leases, environments on a real Docker engine, and the blocking
twin."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, fields

import aiohttp
import pytest
from aiohttp import web

from tangram.records import ActionRecord as DocumentedRecord
from tangram.records import EnvironmentRecord
from tangram_client import (
    ActionError,
    AsyncTangramClient,
    BadRequestError,
    BrokerUnreachable,
    ConflictError,
    NotFoundError,
    OverloadedError,
    TangramClient,
    UnprocessableError,
    WaitTimeout,
    unit_demand,
)
from tangram_client.records import ActionRecord
from tests.docker_nodes import cpu_config, docker_engines
from tests.harness import live_broker, serving

LEASES = {"basic": {"lease.local": {"concurrency": 2}}}


@pytest.fixture
def db(tmp_path):
    return str(tmp_path / "tangram.db")


@dataclass
class Front:
    """A front proxy that misbehaves on purpose: it drops the connection after the broker has answered
    (``lose`` times), or answers 503 with Retry-After without forwarding (``shed`` times)."""

    target: str
    lose: int = 0
    shed: int = 0
    forwarded: list[str] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.shed > 0:
            self.shed -= 1
            return web.json_response({"error": {"field": "actions", "reason": "the queue is full; retry later"}},
                                     status=503, headers={"Retry-After": "0"})
        async with aiohttp.ClientSession() as http, http.request(
                request.method, self.target + request.path_qs, data=await request.read(),
                headers={"content-type": request.headers.get("content-type", "application/json")}) as answer:
            body = await answer.read()
            self.forwarded.append(f"{request.method} {request.path} -> {answer.status}")
        if self.lose > 0:
            self.lose -= 1
            assert request.transport is not None
            request.transport.close()  # the broker did the work; the client never hears about it
            return web.Response()
        return web.Response(body=body, status=answer.status, content_type="application/json")


@asynccontextmanager
async def front(target: str, *, lose: int = 0, shed: int = 0) -> AsyncIterator[Front]:
    proxy = Front(target, lose=lose, shed=shed)
    async with serving(proxy.handle) as proxy.url:
        yield proxy


def documented(*records: ActionRecord) -> None:
    """Each record is what the document's ``ActionRecord`` schema (generated from the same model) says, and the
    client's typed fields are fields of it."""
    assert {f.name for f in fields(ActionRecord)} - {"raw"} <= set(DocumentedRecord.model_fields)
    for record in records:
        DocumentedRecord.model_validate_json(json.dumps(record.raw))


def test_unit_demand_shapes():
    assert unit_demand(2) == 2
    assert unit_demand((1, 8)) == {"min": 1, "max": 8}
    assert unit_demand([1, 2, 4]) == {"choices": [1, 2, 4]}
    assert unit_demand({"min": 1, "max": 2}) == {"min": 1, "max": 2}
    with pytest.raises(TypeError):
        unit_demand(True)


async def test_lease_round_trip_and_typed_errors(db):
    async with live_broker(LEASES, db) as live, AsyncTangramClient(live.url, task="client-test") as client:
        assert (await client.health())["status"] == "ok"
        async with client.leased({"lease.local": 2}, ttl_s=30) as lease:
            assert lease.succeeded and lease.kind == "lease" and lease.task == "client-test"
            assert lease.allocation == {"units": {"lease.local": 2}, "placement": lease.raw["allocation"]["placement"]}
            documented(lease)
            row = next(r for r in (await client.resources())["resources"] if r["resource"] == "lease.local")
            assert row["in_use"] == 2
        row = next(r for r in (await client.resources())["resources"] if r["resource"] == "lease.local")
        assert row["in_use"] == 0
        with pytest.raises(ConflictError) as conflict:
            await client.release_lease(lease.id)  # already returned, by this client's first and only attempt
        assert conflict.value.status == 409 and conflict.value.field == "id"
        with pytest.raises(BadRequestError) as bad:
            await client.submit("lease", {"lease.local": 0}, {"ttl_s": 1})
        assert bad.value.field == "demand.lease.local" and "at least" in bad.value.reason
        with pytest.raises(NotFoundError):
            await client.get("act_000000000000000000000000")
        with pytest.raises(UnprocessableError) as unprocessable:
            await client.submit("lease", {"lease.local": 3}, {"ttl_s": 1})  # the resource has 2 units
        assert unprocessable.value.status == 422 and unprocessable.value.field.startswith("demand")
        with pytest.raises(ValueError, match="no task"):
            await AsyncTangramClient(live.url).submit("lease", {"lease.local": 1})


async def test_idempotency_keys_make_resubmission_return_the_same_action(db):
    async with live_broker(LEASES, db) as live, AsyncTangramClient(live.url, task="t") as client:
        first = await client.submit("lease", {"lease.local": 1}, {"ttl_s": 30}, idempotency_key="step-7")
        again = await client.submit("lease", {"lease.local": 1}, {"ttl_s": 30}, idempotency_key="step-7")
        other = await client.submit("lease", {"lease.local": 1}, {"ttl_s": 30})
        assert again.id == first.id and other.id != first.id
        assert first.raw["idempotency_key"] == "step-7" and len(other.raw["idempotency_key"]) == 32
        for record in (first, other):
            await client.release_lease((await client.wait(record.id)).id)


async def test_a_lost_answer_is_retried_without_running_the_action_twice(db):
    async with live_broker(LEASES, db) as live, front(live.url, lose=2) as proxy:
        async with AsyncTangramClient(proxy.url, task="t", retries=3, backoff_s=0.01) as client:
            record = await client.submit("lease", {"lease.local": 1}, {"ttl_s": 30}, wait=True)
        assert record.succeeded
        # the broker saw three submissions of one action: it queued one and answered the other two with it
        assert [line for line in proxy.forwarded if line.startswith("POST")] == [
            "POST /v1/actions -> 200", "POST /v1/actions -> 200", "POST /v1/actions -> 200"]
        assert list(live.broker.leases) == [record.id]
        assert live.broker.metrics.registry.get_sample_value("tangram_actions_submitted_total",
                                                             {"kind": "lease", "task": "t"}) == 1


async def test_overload_is_retried_then_raised_with_the_brokers_reason(db):
    async with live_broker(LEASES, db) as live:
        async with front(live.url, shed=2) as proxy, AsyncTangramClient(proxy.url, task="t", retries=2) as client:
            record = await client.run("lease", {"lease.local": 1}, {"ttl_s": 30})
            assert record.succeeded and proxy.shed == 0
            await client.release_lease(record.id)
        async with front(live.url, shed=5) as proxy, AsyncTangramClient(proxy.url, task="t", retries=1) as client:
            with pytest.raises(OverloadedError) as overloaded:
                await client.get(record.id)
            assert overloaded.value.status == 503 and overloaded.value.attempts == 2
            assert overloaded.value.field == "actions" and "retry later" in overloaded.value.reason
            assert proxy.shed == 3 and not proxy.forwarded


async def test_an_unreachable_broker_is_reported_after_the_retries():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    async with AsyncTangramClient(f"http://127.0.0.1:{port}", task="t", retries=2, backoff_s=0.01) as client:
        with pytest.raises(BrokerUnreachable, match="after 3 attempts"):
            await client.health()


async def test_wait_timeout_cancel_and_action_errors(db):
    async with live_broker(LEASES, db) as live, AsyncTangramClient(live.url, task="t") as client:
        holder = await client.lease({"lease.local": 2}, ttl_s=60)
        blocked = await client.submit("lease", {"lease.local": 1}, {"ttl_s": 30})
        assert blocked.state == "queued" and not blocked.terminal
        with pytest.raises(WaitTimeout) as timeout:
            await client.wait(blocked.id, timeout_s=0.2)
        assert timeout.value.record.state == "queued"
        cancelled = await client.cancel(blocked.id)
        assert cancelled.state == "cancelled" and cancelled.terminal and not cancelled.succeeded
        with pytest.raises(ActionError) as failed:
            cancelled.raise_for_state()
        assert failed.value.record is cancelled
        with pytest.raises(ConflictError):
            await client.cancel(blocked.id)
        short = await client.submit("lease", {"lease.local": 1}, {"ttl_s": 30}, timeout_s=0.3, wait=True)
        assert short.state == "timed_out" and short.error is not None
        documented(holder, blocked, cancelled, short)
        await client.release_lease(holder.id)


async def test_exec_in_a_trajectory_sandbox_and_environments(db):
    config = cpu_config({"n1": {"backend": "docker", "engine": docker_engines()[0], "cores": "0-1",
                                "memory_mb": 2048}})
    async with live_broker(config, db) as live, AsyncTangramClient(live.url, task="client-exec") as client:
        first = await client.exec("echo 42 > /workspace/answer; echo wrote", trajectory="traj-a", memory_mb=256)
        second = await client.exec(["cat", "/workspace/answer"], trajectory="traj-a", cores=(1, 2))
        assert first.result["stdout"] == "wrote\n" and second.result["stdout"] == "42\n"
        env_id = first.result["environment"]
        assert second.result["environment"] == env_id
        failing = await client.exec("exit 3", trajectory="traj-a")
        assert failing.succeeded and failing.result["exit_code"] == 3  # a failing command is still a result
        with pytest.raises(ActionError) as timed_out:
            await client.exec("sleep 30", trajectory="traj-a", timeout_s=1)
        assert timed_out.value.record.state == "timed_out"
        documented(first, second, failing, timed_out.value.record)
        assert [env["id"] for env in await client.environments()] == [env_id]
        made = await client.create_environment(files={"seed.txt": "7"})
        ran = await client.exec("cat seed.txt", environment=made["id"])
        assert ran.result["stdout"] == "7" and ran.result["environment"] == made["id"]
        for env in await client.environments():
            EnvironmentRecord.model_validate_json(json.dumps(env))  # as the document says
            assert (await client.delete_environment(env["id"]))["state"] == "destroyed"
        assert await client.environments() == []


async def test_the_blocking_client_shares_the_async_behaviour(db):
    async with live_broker(LEASES, db) as live:
        def script() -> tuple[str, str, str]:
            with TangramClient(live.url, task="sync") as client:
                with client.leased({"lease.local": 1}, ttl_s=30) as lease:
                    held = next(r for r in client.resources()["resources"] if r["resource"] == "lease.local")
                try:
                    client.get("act_000000000000000000000000")
                except NotFoundError as error:
                    missing = error.field
                return lease.state, f"in_use={held['in_use']}", missing

        assert await asyncio.to_thread(script) == ("succeeded", "in_use=1", "id")
