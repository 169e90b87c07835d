"""REST view and admission of the tasks' SLO plans (admin only): ``GET /v1/tasks/slo``,
``PUT /v1/tasks/{task}/slo`` and ``DELETE /v1/tasks/{task}/slo``."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web
from pydantic import TypeAdapter

from tangram.core.errors import Unprocessable
from tangram.core.names import NAME, NAME_REASON
from tangram.core.schema import parse_json
from tangram.server.common import json_response, read_body
from tangram.slo.admission import SloAdmission
from tangram.slo.plan import SloPlan

SLO = web.AppKey("slo", SloAdmission)
PLAN = TypeAdapter(SloPlan)


def _task(request: web.Request) -> str:
    task = request.match_info["task"]
    if not NAME.match(task):
        raise Unprocessable("task", NAME_REASON)
    return task


async def list_plans(request: web.Request) -> web.Response:
    return json_response(request.app[SLO].describe())


async def put_plan(request: web.Request) -> web.Response:
    """Admit the body as the task's plan: 200 with every task's prediction, 400 naming a malformed field, 409 naming
    the task whose SLO would break, 422 naming a service the pool lacks; nothing changes on a refusal."""
    task = _task(request)
    plan = parse_json(PLAN, await read_body(request))
    slo = request.app[SLO]
    await slo.put(task, plan)
    return json_response(slo.describe())


async def delete_plan(request: web.Request) -> web.Response:
    await request.app[SLO].delete(_task(request))
    return web.Response(status=204)


async def _loading(app: web.Application) -> AsyncIterator[None]:
    await app[SLO].load()
    yield


def add_slo_routes(app: web.Application, slo: SloAdmission) -> None:
    """Serve ``slo``'s routes; it admits the store's plans as the app starts."""
    app[SLO] = slo
    app.cleanup_ctx.append(_loading)
    app.router.add_get("/v1/tasks/slo", list_plans)
    app.router.add_put("/v1/tasks/{task}/slo", put_plan)
    app.router.add_delete("/v1/tasks/{task}/slo", delete_plan)
