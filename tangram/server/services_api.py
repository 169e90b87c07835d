"""REST view of the reward services the GPU manager hosts (``GET /v1/services``)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from aiohttp import web

from managers.gpu.config import GpuConfig
from tangram.broker import Broker
from tangram.core.action import Kind
from tangram.core.errors import NotFound
from tangram.server.common import BROKER, json_response


@runtime_checkable
class ServiceCatalog(Protocol):
    """What these endpoints need of the manager that executes ``reward`` actions (the GPU manager's)."""

    def describe_services(self) -> list[dict[str, Any]]: ...

    def describe_placement(self) -> dict[str, Any] | None:
        """The placement of services over GPU types in force, None without one (``GET /v1/resources``)."""

    def reconfigure(self, new: GpuConfig) -> list[str]:
        """Admit the services ``new`` adds (``POST /v1/admin/reload``); returns their names."""


def catalog_of(broker: Broker) -> ServiceCatalog | None:
    manager = broker.executor.get(Kind.REWARD)
    return manager if isinstance(manager, ServiceCatalog) else None


def _manager(request: web.Request) -> ServiceCatalog | None:
    return catalog_of(request.app[BROKER])


async def list_services(request: web.Request) -> web.Response:
    manager = _manager(request)
    return json_response({"services": manager.describe_services() if manager else []})


async def get_service(request: web.Request) -> web.Response:
    manager = _manager(request)
    name = request.match_info["name"]
    for service in manager.describe_services() if manager else []:
        if service["name"] == name:
            return json_response(service)
    raise NotFound("name", f"no reward service {name!r}")


def add_service_routes(app: web.Application) -> None:
    app.router.add_get("/v1/services", list_services)
    app.router.add_get("/v1/services/{name}", get_service)
