"""REST API (aiohttp + orjson). Every client error is a 4xx whose JSON body names the field and the reason."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tangram.action import Action
from tangram.api_common import BROKER, LIMITS, SERVER, json_response, read_json
from tangram.broker import Broker
from tangram.config import ServerConfig
from tangram.environments_api import add_environment_routes
from tangram.errors import BadRequest
from tangram.openapi import openapi_document
from tangram.parse import Limits, parse_action
from tangram.services_api import add_service_routes
from tangram.status_page import add_status_routes

log = logging.getLogger("tangram.api")


@web.middleware
async def errors_as_json(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as error:
        return json_response(error.to_json(), status=error.status)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        field = "body" if error.status == 413 else "path" if error.status in (404, 405) else "request"
        reason = error.reason if error.status != 413 else error.text or "request body too large"
        # a 405 must keep aiohttp's Allow header naming the methods the path takes (RFC 9110 15.5.6)
        kept = {name: error.headers[name] for name in ("Allow",) if name in error.headers}
        return json_response({"error": {"field": field, "reason": reason}}, status=error.status, headers=kept)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return json_response({"error": {"field": "server", "reason": "internal error; see broker log"}}, 500)


def _flag(request: web.Request, name: str) -> bool:
    value = request.query.get(name, "false").lower()
    if value not in ("true", "false", "1", "0"):
        raise BadRequest(name, "must be true or false")
    return value in ("true", "1")


def _wait_timeout(request: web.Request) -> float:
    server = request.app[SERVER]
    raw = request.query.get("wait_timeout_s")
    if raw is None:
        return server.max_wait_s
    try:
        value = float(raw)
    except ValueError:
        raise BadRequest("wait_timeout_s", "must be a number of seconds") from None
    if not 0 <= value <= server.max_wait_s:
        raise BadRequest("wait_timeout_s", f"must be between 0 and {server.max_wait_s}")
    return value


async def submit_action(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    wait = _flag(request, "wait")
    timeout = _wait_timeout(request)  # checked even without wait: a bad query is an error, never ignored
    action = parse_action(await read_json(request), request.app[LIMITS])
    [(record, created)] = await broker.submit([action])
    if wait:
        record = await broker.wait(record.id, timeout)
        status = 200 if record.state.terminal else 202
    else:
        status = 201 if created else 200
    return json_response(record.to_json(), status=status, headers={"Location": f"/v1/actions/{record.id}"})


async def submit_batch(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    body = await read_json(request)
    if not isinstance(body, dict) or set(body) != {"actions"}:
        raise BadRequest("body", 'must be an object {"actions": [...]}')
    items = body["actions"]
    limit = request.app[SERVER].max_batch
    if not isinstance(items, list) or not items:
        raise BadRequest("actions", "must be a non-empty list")
    if len(items) > limit:
        raise BadRequest("actions", f"has {len(items)} actions; at most {limit} per batch", status=413)
    limits = request.app[LIMITS]
    actions = [parse_action(item, limits, where=f"actions[{i}].") for i, item in enumerate(items)]
    results = await broker.submit(actions)
    return json_response({"actions": [record.to_json() for record, _ in results],
                          "created": sum(created for _, created in results)}, status=200)


async def get_action(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    action_id = request.match_info["id"]
    timeout = _wait_timeout(request)
    if _flag(request, "wait"):
        action = await broker.wait(action_id, timeout)
    else:
        action = await broker.get(action_id)
    return json_response(action.to_json())


async def cancel_action(request: web.Request) -> web.Response:
    action: Action = await request.app[BROKER].cancel(request.match_info["id"])
    return json_response(action.to_json())


async def release_lease(request: web.Request) -> web.Response:
    action = await request.app[BROKER].release_lease(request.match_info["id"])
    return json_response(action.to_json())


async def resources(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    return json_response({"resources": broker.resources(), "stats": broker.stats()})


async def healthz(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    return json_response({"status": "ok", "queued": len(broker.queue), "running": len(broker.running)})


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[BROKER].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    return json_response(openapi_document(request.app[SERVER], request.app[LIMITS], list(request.app[BROKER].owner)))


def build_app(broker: Broker, server: ServerConfig, limits: Limits) -> web.Application:
    app = web.Application(middlewares=[errors_as_json], client_max_size=server.max_body_bytes)
    app[BROKER] = broker
    app[SERVER] = server
    app[LIMITS] = limits
    app.router.add_post("/v1/actions", submit_action)
    app.router.add_post("/v1/actions:batch", submit_batch)
    app.router.add_get("/v1/actions/{id}", get_action)
    app.router.add_delete("/v1/actions/{id}", cancel_action)
    app.router.add_delete("/v1/leases/{id}", release_lease)
    app.router.add_get("/v1/resources", resources)
    add_environment_routes(app)
    add_service_routes(app)
    add_status_routes(app, interval_s=server.status_interval_s, keep_s=server.status_keep_s)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    return app
