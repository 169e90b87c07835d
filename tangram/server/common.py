"""What every REST handler module shares: the app keys and JSON in and out."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from tangram.broker import Broker
from tangram.config import ServerConfig
from tangram.core.errors import BadRequest
from tangram.parse import Limits

BROKER = web.AppKey("broker", Broker)
SERVER = web.AppKey("server", ServerConfig)
LIMITS = web.AppKey("limits", Limits)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json", headers=headers)


async def read_body(request: web.Request) -> bytes:
    """The request's bytes, for a typed parser that reads JSON itself; an empty body is a 400."""
    raw = await request.read()
    if not raw:
        raise BadRequest("body", "is empty; expected a JSON object")
    return raw


async def read_json(request: web.Request) -> Any:
    raw = await read_body(request)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise BadRequest("body", f"is not valid JSON: {error}") from None
