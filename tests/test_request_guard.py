"""What a request must be before a handler sees it (``tangram/server/request_guard.py``), against real brokers on
loopback: bodies declared JSON, only loopback ``Host`` and ``Origin`` while auth is off, and half-sent requests
dropped."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest

from tangram.core.action import Kind
from tangram.server.auth import token_sha256
from tests.docker_nodes import local_cpu
from tests.harness import Live, live_broker, until

pytestmark = pytest.mark.slow  # waits out the server's request timeouts

LEASES: dict[str, Any] = {"basic": {"lease.local": {"concurrency": 4, "lease_ttl_s": 30.0}}, "cpu": {"enabled": False}}
ADMIN = "tgm_request-guard-admin"
#: the cross-site request that ran `id` as root: a page's form or fetch in no-cors mode sends text/plain
ATTACK = b'{"task": "t", "kind": "exec", "demand": {"cpu": 1}, "spec": {"command": "id"}}'


def lease(**extra: Any) -> dict[str, Any]:
    return {"task": "t", "kind": "lease", "demand": {"lease.local": 1}, **extra}


@pytest.fixture
def db(tmp_path: Path) -> str:
    return str(tmp_path / "tangram.db")


async def test_a_cross_site_text_plain_post_runs_nothing(db: str, run_dir: str) -> None:
    """The attack of issue 35, on a broker with a CPU manager and auth off: a page of another site posts an exec
    action as text/plain (no preflight needed). Refused before any handler; no action exists afterwards."""
    async with live_broker({"cpu": local_cpu(run_dir)}, db) as live:
        for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
            undeclared = {"skip_auto_headers": ["Content-Type"]} if content_type is None else {}
            headers = {"Origin": "http://evil.example"} | ({"Content-Type": content_type} if content_type else {})
            code, reply = await live.call("POST", "/v1/actions?wait=true", data=ATTACK, headers=headers,
                                          **undeclared)
            assert (code, reply["error"]["field"]) == (415, "content-type"), reply
        # declared JSON (a page cannot send that elsewhere without a preflight, but a rebound name could): the
        # foreign Origin is refused while auth is off
        code, reply = await live.call("POST", "/v1/actions?wait=true", data=ATTACK,
                                      headers={"Origin": "http://evil.example", "Content-Type": "application/json"})
        assert (code, reply["error"]["field"]) == (403, "origin") and "auth" in reply["error"]["reason"], reply
        assert not live.broker.actions and not any(r.action.kind is Kind.EXEC for r in live.broker.running.values())
        # this host's own page, and a client that sends no Origin, are served
        code, record = await live.call("POST", "/v1/actions?wait=true", data=ATTACK.replace(b"id", b"true"),
                                       headers={"Origin": "http://127.0.0.1:3000", "Content-Type": "application/json"})
        assert code == 200 and record["state"] == "succeeded", record


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v1/actions", b'{"task": "t", "kind": "lease", "demand": {"lease.local": 1}}'),
    ("POST", "/v1/actions:batch", b'{"actions": []}'),
    ("DELETE", "/v1/actions/act_nope", b"{}"),
    ("GET", "/v1/resources", b"{}")])
async def test_a_body_must_be_declared_json(db: str, method: str, path: str, body: bytes) -> None:
    async with live_broker(LEASES, db) as live:
        for content_type in ("text/plain", "application/jsonx", "multipart/form-data; boundary=x"):
            code, reply = await live.call(method, path, data=body, headers={"Content-Type": content_type})
            assert (code, reply["error"]["field"]) == (415, "content-type"), reply
            assert content_type in reply["error"]["reason"]
        assert not live.broker.actions


async def test_requests_without_a_body_need_no_content_type_and_json_may_name_its_charset(db: str) -> None:
    async with live_broker(LEASES, db) as live:
        code, record = await live.call("POST", "/v1/actions?wait=true", data=b'{"task": "t", "kind": "lease", '
                                       b'"demand": {"lease.local": 1}}',
                                       headers={"Content-Type": "application/json; charset=utf-8"})
        assert code == 200 and record["state"] == "succeeded"
        async with live.http.delete(f"{live.url}/v1/leases/{record['id']}", skip_auto_headers=["Content-Type"]) \
                as response:
            assert response.status == 200 and "Content-Type" not in response.request_info.headers


@pytest.mark.parametrize("host", ["evil.example", "evil.example:80", "0.0.0.0:8300", "10.0.0.1", "127.0.0.1.nip.io",
                                  "localhost.evil.example", "[::]:80", "a@127.0.0.1"])
async def test_without_auth_only_loopback_names_are_answered(db: str, host: str) -> None:
    """DNS rebinding: a page whose name now resolves to this host sends its own name as Host."""
    async with live_broker(LEASES, db) as live:
        code, reply = await live.call("POST", "/v1/actions", json=lease(), headers={"Host": host})
        assert (code, reply["error"]["field"]) == (403, "host") and "auth" in reply["error"]["reason"], reply
        code, reply = await live.call("GET", "/v1/resources", headers={"Host": host})
        assert code == 403
        assert not live.broker.actions


async def test_loopback_names_and_pages_are_answered(db: str) -> None:
    async with live_broker(LEASES, db) as live:
        for host in ("127.0.0.1", "localhost:8300", "LOCALHOST", "127.3.2.1:1", "[::1]:8300", "[::1]"):
            code, _ = await live.call("GET", "/v1/resources", headers={"Host": host})
            assert code == 200, host
        for origin in ("http://localhost:3000", "https://127.0.0.1", "http://[::1]:9"):
            code, _ = await live.call("GET", "/v1/resources", headers={"Origin": origin})
            assert code == 200, origin
        for origin in ("null", "http://evil.example", "http://127.0.0.1.evil.example", "file://"):
            code, reply = await live.call("GET", "/v1/resources", headers={"Origin": origin})
            assert (code, reply["error"]["field"]) == (403, "origin"), origin


async def test_with_auth_on_other_names_are_answered_to_a_token(db: str) -> None:
    """Auth replaces the loopback rule: a browser never adds a bearer token by itself."""
    config = {**LEASES, "auth": {"admin_token_sha256": token_sha256(ADMIN)}}
    async with live_broker(config, db) as live:
        headers = {"Host": "broker.example:8300", "Origin": "https://dashboard.example"}
        code, reply = await live.call("POST", "/v1/actions", json=lease(), headers=headers)
        assert (code, reply["error"]["field"]) == (401, "authorization")
        code, record = await live.call("POST", "/v1/actions", json=lease(),
                                       headers={**headers, "Authorization": f"Bearer {ADMIN}"})
        assert code == 201, record
        code, reply = await live.call("POST", "/v1/actions", data=b"{}", headers={
            **headers, "Authorization": f"Bearer {ADMIN}", "Content-Type": "text/plain"})
        assert (code, reply["error"]["field"]) == (415, "content-type")


HALF_SENT = 500


async def open_half_sent(live: Live, count: int) -> list[socket.socket]:
    """``count`` connections on loopback, each sending half a request: every other one a header that never ends,
    the rest a whole header whose Content-Length body never comes in full."""
    port = int(live.url.rsplit(":", 1)[1])
    connections = []
    for i in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        if i % 2:
            sock.send(b"POST /v1/actions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"task\": ")
        else:
            sock.send(b"GET /v1/resources HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        connections.append(sock)
    return connections


def closed_by_the_broker(sock: socket.socket) -> bool:
    """The broker closed it: reading gives EOF (after a 408 answer, for a body that never came)."""
    try:
        while sock.recv(65536):
            pass
        return True
    except BlockingIOError:
        return False  # open, nothing to read
    except ConnectionResetError:
        return True


async def test_half_sent_requests_are_dropped_after_the_timeouts(db: str) -> None:
    """500 connections that send half a request (issue 35 found them open forever) are all closed by the broker
    once [server] header_timeout_s / body_timeout_s pass; the broker serves meanwhile and afterwards."""
    config = {**LEASES, "server": {"header_timeout_s": 1.0, "body_timeout_s": 1.0}}
    async with live_broker(config, db) as live:
        connections = await open_half_sent(live, HALF_SENT)
        try:
            code, _ = await live.call("GET", "/healthz")
            assert code == 200
            await until(lambda: all(closed_by_the_broker(sock) for sock in connections), timeout_s=60)
        finally:
            for sock in connections:
                sock.close()
        code, record = await live.call("POST", "/v1/actions?wait=true", json=lease())
        assert code == 200 and record["state"] == "succeeded"


async def test_a_body_that_stops_coming_gets_a_408(db: str) -> None:
    config = {**LEASES, "server": {"body_timeout_s": 0.5}}
    async with live_broker(config, db) as live:
        port = int(live.url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/actions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"task\": ")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout=30)  # read() returns at EOF: the broker closed it
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and b'"field":"body"' in body, answer
        assert not live.broker.actions
