"""Real brokers and real upstreams on loopback for end-to-end tests."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from tangram.broker import Broker
from tangram.config import Config, load_config, parse_config
from tangram.core.seam import ResourceManager
from tangram.server.request_guard import http_settings
from tangram.service import running_broker
from tests.docker_nodes import new_broker_id


@dataclass
class Live:
    broker: Broker
    url: str
    http: aiohttp.ClientSession

    async def call(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
        async with self.http.request(method, self.url + path, **kwargs) as response:
            body = await response.json(content_type=None) if response.content_type == "application/json" \
                else await response.text()
            return response.status, body


@asynccontextmanager
async def live_broker(raw: dict[str, Any], db_path: str, store_url: str | None = None) -> AsyncIterator[Live]:
    """A broker on a loopback port; its store is SQLite at ``db_path`` unless ``store_url`` names another."""
    raw = {**raw, "store": {"url": store_url or f"sqlite+aiosqlite:///{db_path}"}}
    # the default CPU manager adopts its broker id's sandboxes at start: never a developer's running broker's
    raw.setdefault("cpu", {"broker_id": new_broker_id()})
    config = parse_config(raw)
    async with running_broker(config) as (broker, app):
        server = TestServer(app, host="127.0.0.1")
        await server.start_server(**http_settings(config.server))
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=200)) as http:
                yield Live(broker, str(server.make_url("")).rstrip("/"), http)
        finally:
            await server.close()


@asynccontextmanager
async def broker_from_file(path: Path, managers: Callable[[Config], list[ResourceManager]] | None = None
                           ) -> AsyncIterator[Live]:
    """A broker started the way ``tangram serve --config`` starts one, so reload can read the file again;
    ``managers``: its managers made from the config otherwise (stand-in reward services)."""
    config = load_config(path)
    async with running_broker(config, None if managers is None else managers(config)) as (broker, app):
        server = TestServer(app, host="127.0.0.1")
        await server.start_server(**http_settings(config.server))
        try:
            async with aiohttp.ClientSession() as http:
                yield Live(broker, str(server.make_url("")).rstrip("/"), http)
        finally:
            await server.close()


@dataclass
class Upstream:
    """An upstream API that records concurrency and every request body it served."""

    delay_s: float = 0.01
    in_flight: int = 0
    max_in_flight: int = 0
    seen: list[Any] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            body = await request.json()
            await asyncio.sleep(body.get("sleep_s", self.delay_s))
            self.seen.append(body)
            return web.json_response({"echo": body, "path": request.path})
        finally:
            self.in_flight -= 1


@asynccontextmanager
async def serving(handler: Any) -> AsyncIterator[str]:
    """Serve every method and path with ``handler`` on a loopback port; yields the base URL."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@asynccontextmanager
async def live_upstream(**settings: Any) -> AsyncIterator[Upstream]:
    upstream = Upstream(**settings)
    async with serving(upstream.handle) as upstream.url:
        yield upstream


async def until(check: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    """``check()``'s first true answer (awaited when it is awaitable), polled every 0.1 s; fails the test past
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = check()
        if inspect.isawaitable(answer):
            answer = await answer
        if answer:
            return answer
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)
