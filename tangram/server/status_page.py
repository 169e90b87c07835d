"""The status page: ``GET /ui`` (``GET /`` redirects there) and the time series it draws, ``/v1/status/history``.

The page is static HTML, CSS and JS from ``tangram/server/static``, its charts drawn by uPlot vendored there
(``static/THIRD_PARTY.md``); nothing is fetched from elsewhere, so it works offline. It polls the history and
``/v1/resources``. The sampler runs as long as the app
does (an aiohttp cleanup context), so the broker itself knows nothing of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from tangram.core.errors import BadRequest
from tangram.server.common import BROKER, json_response
from tangram.server.history import History

HISTORY = web.AppKey("history", History)
STATIC = Path(__file__).with_name("static")
ASSETS = frozenset(path.name for path in STATIC.iterdir() if path.suffix in (".js", ".css"))
# the page may load only what this broker serves: a third-party or CDN reference fails loudly in the browser
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:", "Cache-Control": "no-cache"}


def add_status_routes(app: web.Application, *, interval_s: float = 2.0, keep_s: float = 900.0) -> None:
    """Serve the page and the history of ``app[BROKER]``, sampled every ``interval_s`` while the app runs."""
    app[HISTORY] = History(app[BROKER], interval_s=interval_s, keep_s=keep_s)
    app.cleanup_ctx.append(_sampling)
    app.router.add_get("/", to_page)
    app.router.add_get("/ui", page)
    app.router.add_get("/ui/{asset}", asset)
    app.router.add_get("/v1/status/history", history)


async def _sampling(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(app[HISTORY].run(), name="tangram-status-history")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def to_page(request: web.Request) -> web.Response:
    raise web.HTTPFound("/ui")


async def page(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)


async def asset(request: web.Request) -> web.FileResponse:
    name = request.match_info["asset"]
    if name not in ASSETS:
        raise web.HTTPNotFound()
    return web.FileResponse(STATIC / name, headers={"Cache-Control": "no-cache"})


def _since(request: web.Request) -> float:
    raw = request.query.get("since")
    if raw is None:
        return -math.inf
    try:
        value = float(raw)
    except ValueError:
        raise BadRequest("since", "must be a number of seconds since the epoch") from None
    if not math.isfinite(value) or value < 0:
        raise BadRequest("since", "must be a finite, non-negative number of seconds since the epoch")
    return value


async def history(request: web.Request) -> web.Response:
    series = request.app[HISTORY]
    since = _since(request)
    return json_response({"interval_s": series.interval_s, "keep_s": series.keep_s,
                          "samples": [taken.to_json() for taken in series.since(since)]})
