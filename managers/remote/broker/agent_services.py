"""A GPU node's reward services driven through its service agent (``managers/remote/node/service_agent.py``): a
``ServiceBackend`` like the torch worker and SGLang, so the GPU manager runs a node behind an agent exactly as one
on its own host (issue 17).

The transport is a ``ServiceLink``; ``managers/remote/broker/ray_service_agents.py`` makes one over a Ray actor. A
transport failure (the agent or its node gone) arrives as an error reply like any other: ``service_unavailable`` or
``node_lost``, after which the GPU manager makes the instance afresh before it answers again.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from managers.gpu.config import GpuNodeConfig
from managers.remote.replies import Reply
from reward_services.backend import ServiceBackend, ServiceError, ServiceInstance, ServiceSpec


class ServiceLink(Protocol):
    """The way to one node's service agent."""

    node: str

    async def call(self, method: str, *args: Any) -> Reply:
        """One call to the agent; its failures come back as error replies."""

    async def release(self) -> None:
        """Close what the agent holds and let it go."""


def answer(reply: Reply) -> Any:
    """The reply's value, or its error raised as the ``ServiceError`` the agent met."""
    error = reply.get("error")
    if error is not None:
        raise ServiceError(error["code"], error["message"])
    return reply["ok"]


class AgentServiceInstance(ServiceInstance):
    """One instance on the agent's node, by the id this broker gave it."""

    def __init__(self, link: ServiceLink, spec: ServiceSpec, devices: tuple[int, ...], instance_id: int) -> None:
        super().__init__(spec, devices)
        self._link = link
        self._id = instance_id
        self._description: dict[str, Any] = {}

    async def prepare(self) -> None:
        self._description = answer(await self._link.call("prepare", self._id, self.spec, self.devices))

    async def restore(self) -> None:
        answer(await self._link.call("restore", self._id))

    async def evict(self) -> None:
        answer(await self._link.call("evict", self._id))

    async def infer(self, request: Mapping[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = answer(await self._link.call("infer", self._id, dict(request)))
        return result

    async def close(self) -> None:
        answer(await self._link.call("close", self._id))

    def describe(self) -> dict[str, Any]:
        return {**self._description, "agent": self._link.node}


class AgentServiceBackend(ServiceBackend):
    """The instances of one backend kind on one node, through its agent."""

    def __init__(self, link: ServiceLink, shares_host_copy: bool, tiered: bool) -> None:
        """``shares_host_copy``, ``tiered``: as the backend on the agent's node (``ServiceBackend``)."""
        self._link = link
        self.shares_host_copy = shares_host_copy
        self.tiered = tiered
        self._ids = itertools.count(1)

    def instance(self, spec: ServiceSpec, devices: tuple[int, ...]) -> AgentServiceInstance:
        return AgentServiceInstance(self._link, spec, devices, next(self._ids))

    async def disk_room_mb(self, names: Sequence[str]) -> int:
        room: int = answer(await self._link.call("disk_room_mb", list(names)))
        return room

    async def spill(self, spec: ServiceSpec) -> None:
        answer(await self._link.call("spill", spec))

    async def drop_host(self, spec: ServiceSpec) -> None:
        answer(await self._link.call("drop_host", spec))

    async def load_host(self, spec: ServiceSpec) -> None:
        answer(await self._link.call("load_host", spec))

    async def node_on_its_host(self) -> GpuNodeConfig:
        """The agent's node with the sizes its config left at 0 read on its host (a node that joins)."""
        sized: GpuNodeConfig = answer(await self._link.call("node_on_its_host"))
        return sized

    async def close(self) -> None:
        await self._link.release()
