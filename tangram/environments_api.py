"""REST endpoints for trajectory environments (``/v1/environments``), served by the CPU manager."""

from __future__ import annotations

from aiohttp import web

from managers.cpu import CpuManager
from managers.exec_spec import parse_files, parse_image, parse_memory_mb
from tangram.action import Kind
from tangram.api_common import BROKER, json_response, read_json
from tangram.errors import BadRequest, Unprocessable
from tangram.parse import parse_name, without_nulls

FIELDS = frozenset({"task", "trajectory", "image", "memory_mb", "files"})


def _manager(request: web.Request) -> CpuManager:
    manager = request.app[BROKER].executor.get(Kind.EXEC)
    if not isinstance(manager, CpuManager):
        raise Unprocessable("path", "this broker has no CPU manager (enable [cpu] in its config)")
    return manager


async def create_environment(request: web.Request) -> web.Response:
    manager = _manager(request)
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    body = without_nulls(body)
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise BadRequest(unknown[0], f"unknown field; environments take {sorted(FIELDS)}")
    task = parse_name(body.get("task"), "task", required=True)
    trajectory = parse_name(body.get("trajectory"), "trajectory", required=False)
    image = parse_image(body.get("image"), "image")
    memory = parse_memory_mb(body.get("memory_mb"), "memory_mb")
    files = parse_files(body.get("files", {}), "files", manager.config.limits)
    assert task is not None
    env = await manager.create_environment(task, trajectory, image, memory, files)
    return json_response(env.to_json(), status=201, headers={"Location": f"/v1/environments/{env.id}"})


async def list_environments(request: web.Request) -> web.Response:
    manager = _manager(request)
    task = request.query.get("task")
    envs = [e.to_json() for e in manager.environments.values() if task is None or e.task == task]
    return json_response({"environments": envs})


async def get_environment(request: web.Request) -> web.Response:
    return json_response(_manager(request).get_environment(request.match_info["id"]).to_json())


async def delete_environment(request: web.Request) -> web.Response:
    env = await _manager(request).delete_environment(request.match_info["id"])
    return json_response(env.to_json())


def add_environment_routes(app: web.Application) -> None:
    app.router.add_post("/v1/environments", create_environment)
    app.router.add_get("/v1/environments", list_environments)
    app.router.add_get("/v1/environments/{id}", get_environment)
    app.router.add_delete("/v1/environments/{id}", delete_environment)
