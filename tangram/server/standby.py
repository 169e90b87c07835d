"""A broker standing by (``[store] leader_election``): until it leads, it answers every request with a 503 that
says where the leader is, and its liveness probe with 200, so an orchestrator keeps it alive but routes nothing to
it (``/readyz`` is a 503 too). Its ``/metrics`` says ``tangram_leader 0``, so a scrape finds it up and standing by."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from tangram.config import ServerConfig
from tangram.core.errors import Unavailable
from tangram.leadership import Leadership
from tangram.metrics import leader_gauge
from tangram.server.common import json_response
from tangram.server.http_errors import headers_of
from tangram.server.request_guard import http_settings

log = logging.getLogger("tangram")


def standby_app(leadership: Leadership) -> web.Application:
    async def answer(request: web.Request) -> web.Response:
        leader = leadership.leader_url
        if request.path == "/healthz":
            return json_response({"status": "standby", "leader": leader})
        where = f"the leader is at {leader}" if leader else "no broker leads yet"
        error = Unavailable("broker", f"this broker stands by; {where}", retry_after_s=1, code="standby",
                            leader=leader)
        return json_response(error.to_json(), status=503, headers=headers_of(error))

    registry = CollectorRegistry()
    leader_gauge(registry, lambda: False)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_route("*", "/{path:.*}", answer)
    return app


async def stand_by(server: ServerConfig, leadership: Leadership, stop: asyncio.Event) -> bool:
    """Serve the standby's answers on the broker's address until this broker leads (True) or ``stop`` is set
    (False). It asks for the lock once before it serves: a broker that can lead at once never stands by, and one
    that cannot names the leader from its first answer."""
    if await leadership.try_to_lead():
        return True
    runner = web.AppRunner(standby_app(leadership), access_log=None, **http_settings(server))
    await runner.setup()
    await web.TCPSite(runner, server.host, server.port).start()
    log.info("standing by on http://%s:%d: another broker leads this store", server.host, server.port)
    acquiring = asyncio.create_task(leadership.acquire())
    stopping = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait({acquiring, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if acquiring in done:
            acquiring.result()  # the database's error, if asking for the lock failed
            return True
        return False
    finally:
        for task in (acquiring, stopping):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await runner.cleanup()
