"""REST endpoints for trajectory environments (``/v1/environments``), served by the CPU manager. A task's token sees
only its task's environments; another task's are 404, as if they did not exist."""

from __future__ import annotations

from aiohttp import web

from managers.cpu import CpuManager
from managers.environment import Environment
from managers.exec_spec import parse_files, parse_image, parse_memory_mb
from tangram.api_common import BROKER, json_response, read_json
from tangram.auth import claim_task, listed_task, principal_of
from tangram.core.action import Kind
from tangram.core.errors import NotFound, Unprocessable
from tangram.parse import known_fields, parse_name

FIELDS = frozenset({"task", "trajectory", "image", "memory_mb", "files"})


def _manager(request: web.Request) -> CpuManager:
    manager = request.app[BROKER].executor.get(Kind.EXEC)
    if not isinstance(manager, CpuManager):
        raise Unprocessable("path", "this broker has no CPU manager (enable [cpu] in its config)")
    return manager


async def create_environment(request: web.Request) -> web.Response:
    manager = _manager(request)
    body = known_fields(claim_task(await read_json(request), principal_of(request)), FIELDS, "environments")
    task = parse_name(body.get("task"), "task", required=True)
    trajectory = parse_name(body.get("trajectory"), "trajectory", required=False)
    image = parse_image(body.get("image"), "image")
    memory = parse_memory_mb(body.get("memory_mb"), "memory_mb")
    files = parse_files(body.get("files", {}), "files", manager.config.limits)
    assert task is not None
    ledger = request.app[BROKER].ledger
    env = await manager.create_environment(task, trajectory, image, memory, files,
                                           admit=lambda mb: ledger.check_environment(task, trajectory, mb, manager))
    return json_response(env.to_json(), status=201, headers={"Location": f"/v1/environments/{env.id}"})


async def list_environments(request: web.Request) -> web.Response:
    manager = _manager(request)
    task = listed_task(request)
    envs = [e.to_json() for e in manager.environments.values() if task is None or e.task == task]
    return json_response({"environments": envs})


def _environment(request: web.Request, manager: CpuManager) -> Environment:
    """The environment the path names, if the caller may see it; 404 otherwise."""
    env_id = request.match_info["id"]
    env = manager.get_environment(env_id)
    own = principal_of(request).task
    if own is not None and env.task != own:
        raise NotFound("id", f"no environment {env_id!r}")
    return env


async def get_environment(request: web.Request) -> web.Response:
    return json_response(_environment(request, _manager(request)).to_json())


async def delete_environment(request: web.Request) -> web.Response:
    manager = _manager(request)
    env = await manager.delete_environment(_environment(request, manager).id)
    return json_response(env.to_json())


def add_environment_routes(app: web.Application) -> None:
    app.router.add_post("/v1/environments", create_environment)
    app.router.add_get("/v1/environments", list_environments)
    app.router.add_get("/v1/environments/{id}", get_environment)
    app.router.add_delete("/v1/environments/{id}", delete_environment)
