"""REST endpoints for trajectory environments (``/v1/environments``), served by the CPU manager. A task's token sees
only its task's environments; another task's are 404, as if they did not exist."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from aiohttp import web
from pydantic import Field, TypeAdapter

from managers.cpu.config import EgressConfig
from managers.cpu.environment import Environment
from managers.cpu.environments import Environments
from managers.cpu.exec_spec import (
    ExecLimits,
    Files,
    Image,
    MemoryMb,
    NetworkBody,
    SandboxUser,
    decode_files,
    parse_network,
)
from tangram.broker import Broker
from tangram.core.action import Kind
from tangram.core.errors import NotFound, Unprocessable
from tangram.core.names import Name
from tangram.core.schema import Schema, parse_json
from tangram.core.seam import EnvironmentHost
from tangram.server.auth import listed_task, principal_of, required_task
from tangram.server.common import BROKER, json_response, read_body


class EnvironmentRequest(Schema):
    """A trajectory's sandbox, created ahead of its first action."""

    task: Name | None = None
    trajectory: Name | None = None
    image: Image | None = None
    memory_mb: MemoryMb | None = None
    sandbox_user: SandboxUser | None = None
    files: Files | None = Field(default=None, description='relative path -> text or {"base64": "..."}')
    network: NetworkBody | None = Field(default=None, description='{"mode": "none"} (the default) or {"mode": '
                                                                  '"proxy", "allow": ["host", "host:port", '
                                                                  '"*.suffix", ...]}')


ENVIRONMENT_REQUEST = TypeAdapter(EnvironmentRequest)


class _Limited(Protocol):
    limits: ExecLimits
    egress: EgressConfig


@runtime_checkable
class EnvironmentManager(EnvironmentHost, Protocol):
    """What these endpoints need of the manager that executes ``exec`` actions: its trajectory environments and
    their per-task use for the caps (the CPU manager's; a manager is found by what it can do, not by its class)."""

    config: _Limited
    environments: Environments


def environment_manager(request: web.Request) -> EnvironmentManager:
    manager = request.app[BROKER].executor.get(Kind.EXEC)
    if not isinstance(manager, EnvironmentManager):
        raise Unprocessable("path", "this broker has no CPU manager (enable [cpu] in its config)")
    return manager


def largest_node_memory(broker: Broker) -> int | None:
    """The most memory (MiB) one environment may reserve now: the largest CPU node's in service; None without
    a CPU manager or a node."""
    manager = broker.executor.get(Kind.EXEC)
    return manager.environments.largest_memory_mb() if isinstance(manager, EnvironmentManager) else None


async def create_environment(request: web.Request) -> web.Response:
    manager = environment_manager(request)
    body = parse_json(ENVIRONMENT_REQUEST, await read_body(request))
    task = required_task(body.task, principal_of(request))
    trajectory, image, memory = body.trajectory, body.image, body.memory_mb
    files = decode_files(body.files or {}, "files", manager.config.limits)
    network = parse_network(body.network, "network")
    manager.config.egress.admit(network, "network")
    ledger = request.app[BROKER].ledger
    env = await manager.environments.create(task, trajectory, image, memory, files,
                                            admit=lambda mb: ledger.check_environment(task, trajectory, mb, manager),
                                            sandbox_user=body.sandbox_user, network=network)
    return json_response(env.to_json(), status=201, headers={"Location": f"/v1/environments/{env.id}"})


async def list_environments(request: web.Request) -> web.Response:
    manager = environment_manager(request)
    task = listed_task(request)
    envs = [e.to_json() for e in manager.environments.values() if task is None or e.task == task]
    return json_response({"environments": envs})


def environment_named(request: web.Request, manager: EnvironmentManager) -> Environment:
    """The environment the path names, if the caller may see it; 404 otherwise."""
    env_id = request.match_info["id"]
    env = manager.environments.named(env_id)
    own = principal_of(request).task
    if own is not None and env.task != own:
        raise NotFound("id", f"no environment {env_id!r}")
    return env


async def get_environment(request: web.Request) -> web.Response:
    return json_response(environment_named(request, environment_manager(request)).to_json())


async def delete_environment(request: web.Request) -> web.Response:
    manager = environment_manager(request)
    env = await manager.environments.delete(environment_named(request, manager).id)
    return json_response(env.to_json())


def add_environment_routes(app: web.Application) -> None:
    app.router.add_post("/v1/environments", create_environment)
    app.router.add_get("/v1/environments", list_environments)
    app.router.add_get("/v1/environments/{id}", get_environment)
    app.router.add_delete("/v1/environments/{id}", delete_environment)
