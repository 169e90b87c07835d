"""REST API (aiohttp + orjson). Every client error is a 4xx whose JSON body names the field and the reason.

Requests are authenticated by ``tangram.server.auth`` (bearer tokens, when auth is on): a task's token sees and changes
only its task's actions, leases and environments (another task's ids are 404, as if they did not exist); the
admin's sees everything and alone may drain the broker, reload its tokens and caps, and plan the tasks' SLOs.
Before that, ``tangram.server.request_guard`` refuses bodies not declared JSON and, while auth is off, requests from
other hosts' names or pages, and bounds how long a request may take to arrive.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tangram.broker import Broker
from tangram.config import AccessConfig, ServerConfig, load_config
from tangram.core.action import Action
from tangram.core.errors import BadRequest, ConfigError, Conflict, RequestError, TooLarge, Unprocessable
from tangram.parse import FLAGS, Limits, parse_action_json, parse_batch_json, to_action
from tangram.server.action_output_api import add_action_output_routes
from tangram.server.auth import AUTH, add_auth, authenticate, own_task, principal_of
from tangram.server.broker_views import broker_stats, resource_rows
from tangram.server.common import BROKER, LIMITS, SERVER, json_response, read_body, read_json
from tangram.server.environment_files_api import add_environment_file_routes
from tangram.server.environment_fork_api import add_environment_fork_routes, max_fork
from tangram.server.environments_api import add_environment_routes, largest_node_memory
from tangram.server.http_errors import headers_of, status_of
from tangram.server.http_metrics import http_metrics
from tangram.server.images_api import add_image_routes
from tangram.server.openapi import openapi_document
from tangram.server.profiles_api import add_profile_routes
from tangram.server.request_guard import body_in_time, guard_requests
from tangram.server.sandbox_fusion_api import add_sandbox_fusion_routes
from tangram.server.services_api import add_service_routes, catalog_of
from tangram.server.status_page import add_status_routes
from tangram.slo.admission import SloAdmission
from tangram.slo.api import SLO, add_slo_routes
from tangram.tracing import traceparent_of

log = logging.getLogger("tangram.server.api")


@web.middleware
async def errors_as_json(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as error:
        return json_response(error.to_json(), status=status_of(error), headers=headers_of(error))
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
    value = FLAGS.get(request.query.get(name, "false"))
    if value is None:
        raise BadRequest(name, f"must be one of {list(FLAGS)}")
    return value


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
    limits = request.app[LIMITS]
    body = parse_action_json(await read_body(request), limits)
    action = to_action(body, limits, own_task(body.task, principal_of(request)))
    action.traceparent = traceparent_of(request.headers)
    [(record, created)] = await broker.submit([action])
    if wait:
        record = await broker.wait(record.id, timeout)
        status = 200 if record.state.terminal else 202
    else:
        status = 201 if created else 200
    return json_response(record.to_json(), status=status, headers={"Location": f"/v1/actions/{record.id}"})


async def submit_batch(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    limits = request.app[LIMITS]
    bodies = parse_batch_json(await read_body(request), limits)
    limit = request.app[SERVER].max_batch
    if len(bodies) > limit:
        raise TooLarge("actions", f"has {len(bodies)} actions; at most {limit} per batch")
    principal = principal_of(request)
    actions = [to_action(body, limits, own_task(body.task, principal, f"actions[{i}].task"), where=f"actions[{i}].")
               for i, body in enumerate(bodies)]
    traceparent = traceparent_of(request.headers)
    for action in actions:
        action.traceparent = traceparent
    results = await broker.submit(actions)
    return json_response({"actions": [record.to_json() for record, _ in results],
                          "created": sum(created for _, created in results)}, status=200)


async def get_action(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    action_id = request.match_info["id"]
    timeout = _wait_timeout(request)
    wait = _flag(request, "wait")
    action = await broker.get(action_id, principal_of(request).task)
    if wait:
        action = await broker.wait(action_id, timeout)
    return json_response(action.to_json())


async def cancel_action(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    await broker.get(request.match_info["id"], principal_of(request).task)
    action: Action = await broker.cancel(request.match_info["id"])
    return json_response(action.to_json())


async def release_lease(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    await broker.get(request.match_info["id"], principal_of(request).task)
    action = await broker.release_lease(request.match_info["id"])
    return json_response(action.to_json())


async def resources(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    catalog = catalog_of(broker)
    return json_response({"resources": resource_rows(broker), "stats": broker_stats(broker),
                          "slo": request.app[SLO].summary(),
                          "placement": catalog.describe_placement() if catalog is not None else None})


async def healthz(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    return json_response({"status": "ok", "queued": len(broker.queue), "running": len(broker.running)})


async def readyz(request: web.Request) -> web.Response:
    """Readiness, apart from liveness: a draining broker still serves its running actions' results (alive) but
    takes no new work, so a load balancer should stop sending it any."""
    broker = request.app[BROKER]
    if broker.draining:
        return json_response({"status": "draining"}, status=503)
    return json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[BROKER].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    auth = request.app[AUTH]
    broker = request.app[BROKER]
    specs = {kind.value: manager.spec_types[kind] for kind, manager in broker.executor.items()
             if kind in manager.spec_types}
    return json_response(openapi_document(request.app[SERVER], request.app[LIMITS], list(broker.owner), specs,
                                          secured=auth.enabled, public_status=auth.access.auth.public_status,
                                          max_memory_mb=largest_node_memory(broker), max_fork=max_fork(broker)))


async def _optional_json(request: web.Request) -> dict[str, Any]:
    """An optional JSON object body: an empty body is ``{}``."""
    if not await request.read():
        return {}
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    return body


async def drain(request: web.Request) -> web.Response:
    """Stop taking and starting actions for good (until a restart), give the running ones ``timeout_s`` (default
    ``server.drain_s``; 0 answers at once) to finish, and say what is left."""
    broker = request.app[BROKER]
    server = request.app[SERVER]
    body = await _optional_json(request)
    unknown = sorted(set(body) - {"timeout_s"})
    if unknown:
        raise BadRequest(unknown[0], "unknown field; drain takes timeout_s")
    timeout = body.get("timeout_s", server.drain_s)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= server.max_wait_s:
        raise BadRequest("timeout_s", f"must be a number of seconds between 0 and {server.max_wait_s}")
    still_running = await broker.drain(float(timeout))
    return json_response({"draining": True, "running": still_running, "queued": len(broker.queue)})


async def reload(request: web.Request) -> web.Response:
    """Re-read tokens, per-task caps and SLO plans ([auth], [tasks]) from the config file and the store, and admit
    the reward services [gpu] adds, without a restart. Nothing else is reloaded: other changes need a restart (409
    naming the field). A file that no longer parses, or a service that does not fit, changes nothing (422); nor do
    changed SLO plans under which a task's SLO would break (409 naming ``tasks.NAME.slo``)."""
    auth = request.app[AUTH]
    broker = request.app[BROKER]
    slo = request.app[SLO]
    source = auth.access.source
    access = auth.access
    config = None
    if source is not None:
        try:
            config = load_config(source)
        except ConfigError as error:
            raise Unprocessable("config", f"{source}: {error}; nothing was reloaded") from None
        access = config.access
    await auth.refresh()
    added: list[str] = []
    catalog = catalog_of(broker)
    async with slo.lock:
        # plans are checked only when they change: the pool's learned restore times move by themselves
        plans_changed = config is not None and dict(config.access.slo_plans) != slo.config_plans
        if config is not None and plans_changed:
            refusal = slo.refusal({**slo.stored, **config.access.slo_plans}, config.gpu.services)
            if refusal is not None:
                refused = Conflict if refusal.breach is not None else Unprocessable
                raise refused(f"tasks.{refusal.task}.{refusal.field}", f"{refusal.reason}; nothing was reloaded")
        if config is not None and catalog is not None:
            try:
                added = catalog.reconfigure(config.gpu)
            except ConfigError as error:
                raise Unprocessable(error.key, f"{error.reason}; nothing was reloaded") from None
        elif config is not None and config.gpu.services:
            raise Conflict("gpu.services", "this broker runs without reward services: adding them needs a restart")
        auth.configure(access)
        broker.set_tenancy(access.tenancy)
        slo.configure(access.slo_plans)
    return json_response({"config": source, "reloaded": ["auth", "tasks", "store tokens", "gpu services added"],
                          "added_services": added, "needs_restart": "every other change", "auth": auth.enabled,
                          "tokens": sum(1 for token in auth.describe() if token["revoked_at"] is None)})


def build_app(broker: Broker, server: ServerConfig, limits: Limits, slo: SloAdmission,
              access: AccessConfig | None = None) -> web.Application:
    """The REST app; ``slo``: the SLO admission the broker's cycle runs; ``access`` (tokens and per-task caps)
    defaults to none: open, no caps."""
    access = access or AccessConfig()
    app = web.Application(middlewares=[http_metrics(broker.metrics.registry), errors_as_json, guard_requests,
                                       authenticate, body_in_time],
                          client_max_size=server.max_body_bytes)
    app[BROKER] = broker
    app[SERVER] = server
    app[LIMITS] = limits
    broker.set_tenancy(access.tenancy)
    add_auth(app, access)
    app.router.add_post("/v1/admin/drain", drain)
    app.router.add_post("/v1/admin/reload", reload)
    app.router.add_post("/v1/actions", submit_action)
    app.router.add_post("/v1/actions:batch", submit_batch)
    app.router.add_get("/v1/actions/{id}", get_action)
    app.router.add_delete("/v1/actions/{id}", cancel_action)
    add_action_output_routes(app)
    app.router.add_delete("/v1/leases/{id}", release_lease)
    app.router.add_get("/v1/resources", resources)
    add_environment_routes(app)
    add_environment_file_routes(app)
    add_environment_fork_routes(app)
    add_image_routes(app)
    add_sandbox_fusion_routes(app)
    add_profile_routes(app)
    add_service_routes(app)
    add_slo_routes(app, slo)
    add_status_routes(app, interval_s=server.status_interval_s, keep_s=server.status_keep_s)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    return app
