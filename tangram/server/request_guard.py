"""What a request must be before any handler sees it, and how long the broker waits for it.

* A body is JSON and says so: a request with a body (any method) must carry ``Content-Type: application/json``
  (415 otherwise), or the one other type its route takes (``OTHER_BODIES``: a tar of files). A web page can send ``text/plain`` or a form to any address without asking first; it cannot
  send ``application/json`` elsewhere without a CORS preflight, which this API never grants. A request without a
  body (``DELETE /v1/leases/{id}``, ``POST /v1/admin/drain`` with no options) needs no ``Content-Type``.
* While auth is off, the broker answers only requests addressed to this host by a loopback name (``Host``) and,
  when a browser says where the request comes from (``Origin``), only pages of this host (403 otherwise): a page
  that rebinds its own name to this host's address, or one of another site, cannot drive the broker through its
  visitor's browser. With auth on every route but the open ones needs a bearer token, which no browser adds.
* A header must arrive within ``[server] header_timeout_s`` (aiohttp's keep-alive timer, set by
  ``http_settings``); a body within ``body_timeout_s`` of its header, or the answer is a 408 and the connection is
  closed (once aiohttp's lingering read of what is left of the body, at most 10 s, lets the client see the 408): a
  client that sends half a request no longer holds a connection forever.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import hdrs, web

from tangram.config import ServerConfig
from tangram.core.errors import Forbidden, UnsupportedMediaType
from tangram.server.auth import AUTH
from tangram.server.common import SERVER, json_response
from tangram.server.loopback import host_header_is_loopback, origin_is_loopback

JSON = "application/json"
#: the routes that also take another body than JSON, and its type: like JSON, one that no page can send to another
#: site without a CORS preflight (a tar of files for an environment)
OTHER_BODIES = {("PUT", "/v1/environments/{id}/files"): "application/x-tar"}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
TURN_AUTH_ON = ("to serve other hosts or pages, turn auth on ([auth] required = true with a token: `tangram token "
                "create --admin`; a start on a non-loopback address does it by itself)")


def http_settings(server: ServerConfig) -> dict[str, Any]:
    """The settings of aiohttp's connection handler for ``server``: its keep-alive timer closes a connection that
    has not sent a whole header ``header_timeout_s`` after it opened or after its last answer."""
    return {"keepalive_timeout": server.header_timeout_s}


@web.middleware
async def guard_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """415 for a body not declared JSON; 403 for a non-loopback ``Host`` or ``Origin`` while auth is off."""
    if request.body_exists and request.content_type != JSON and request.content_type != _other_body(request):
        declared = request.headers.get(hdrs.CONTENT_TYPE)
        other = _other_body(request)
        raise UnsupportedMediaType("content-type", f"must be {JSON}{'' if other is None else ' or ' + other} for a "
                                                   f"request with a body (got "
                                                   f"{'none' if declared is None else repr(declared)})")
    if not request.app[AUTH].enabled:
        host = request.headers.get(hdrs.HOST)
        if host is not None and not host_header_is_loopback(host):
            raise Forbidden("host", f"this broker runs without auth, so it answers only requests addressed to "
                                    f"localhost, 127.0.0.1 or [::1] (Host was {host!r}); {TURN_AUTH_ON}")
        origin = request.headers.get(hdrs.ORIGIN)
        if origin is not None and not origin_is_loopback(origin):
            raise Forbidden("origin", f"this broker runs without auth, so it answers no web page of another host "
                                      f"(Origin was {origin!r}); {TURN_AUTH_ON}")
    return await handler(request)


def _other_body(request: web.Request) -> str | None:
    """The other body type the request's route takes, if any (``OTHER_BODIES``)."""
    resource = request.match_info.route.resource
    return None if resource is None else OTHER_BODIES.get((request.method, resource.canonical))


@web.middleware
async def body_in_time(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Read the whole body (bounded by ``client_max_size``) within ``body_timeout_s``; handlers then read it from
    memory. Past the bound: 408, and the connection is closed (what is left of the body is never read)."""
    if request.body_exists and not request.content.is_eof():  # a body already in whole needs no timer
        timeout = request.app[SERVER].body_timeout_s
        try:
            async with asyncio.timeout(timeout):
                await request.read()
        except TimeoutError:
            response = json_response({"error": {"field": "body", "reason": f"not received within {timeout:g} s of "
                                                                           f"the request's header"}}, status=408)
            response.force_close()
            return response
    return await handler(request)
