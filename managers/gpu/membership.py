"""GPU nodes behind agents join, leave and come back with their Ray nodes (``RayMembership`` tells of them): a lost
node takes no new actions, comes back with every instance made afresh, and a new node joins once its services are
admitted and prepared."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from managers.gpu.admission import admit
from managers.gpu.catalog import ServiceCatalog
from managers.gpu.config import GpuNodeConfig
from managers.gpu.node import GpuNode
from managers.gpu.nodes import GpuNodes
from managers.gpu.preparation import renew
from managers.gpu.slot import SlotState
from managers.remote.broker.agent_services import AgentServiceBackend
from reward_services.backend import ServiceError
from tangram.core.errors import ConfigError

if TYPE_CHECKING:
    from managers.remote.broker.ray_membership import RayMembership

log = logging.getLogger("tangram.gpu")

#: how long a node coming back waits for the actions that were on it when it was lost to end
SETTLE_S = 30.0


class GpuMembership:
    """Follows the Ray cluster for the nodes behind agents and those that may join (``[gpu.join]``)."""

    def __init__(self, nodes: GpuNodes, services: ServiceCatalog, changed: Callable[[], None]) -> None:
        """``changed`` is told when a node leaves, comes back or joins."""
        self._nodes = nodes
        self._services = services
        self._changed = changed
        self._ray: RayMembership | None = None

    async def start(self) -> None:
        """Follow the Ray cluster, if a node is behind an agent or nodes may join."""
        config = self._services.config
        if config.join is not None or any(node.config.agent for node in self._nodes.values()):
            from managers.remote.broker.ray_cluster import (
                GPU_NODE_RESOURCE_PREFIX,  # Ray is imported only for agent nodes
            )
            from managers.remote.broker.ray_membership import RayMembership

            self._ray = RayMembership(config.ray, GPU_NODE_RESOURCE_PREFIX, self.node_joined, self.node_left)
            await self._ray.start()

    async def stop(self) -> None:
        if self._ray is not None:
            await self._ray.stop()

    async def node_left(self, name: str, reason: str) -> None:
        """Its Ray node is gone: new actions go elsewhere, actions that were on it end ``node_lost``, its GPUs
        leave the pool and its agents are let go (their device memory went with them)."""
        node = self._nodes.get(name)
        if node is None or node.lost is not None:
            return
        node.lose(reason)
        log.warning("GPU node %s lost: %s", name, reason)
        self._changed()
        for backend in node.backends.values():
            await backend.close()

    async def node_joined(self, name: str) -> None:
        """A Ray node carrying ``name``'s resource is alive: a new node joins if ``[gpu.join]`` lets nodes join;
        for a lost node, once the actions that were on it have ended, every instance is made afresh on new agents
        (prepared, nothing on the GPUs) and the node serves again."""
        node = self._nodes.get(name)
        join = self._services.config.join
        if node is None and join is not None:
            await self._join(join.node(name))
            return
        if node is None or node.lost is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_all_free(node), SETTLE_S)
        try:
            for slot in node.residency.slots.values():
                if slot.holds_memory:
                    node.residency.unbook(slot)
                slot.state = SlotState.PREPARED
                await renew(node, slot, self._services[slot.service])
        except ServiceError as error:
            log.warning("GPU node %s is back but not in service: %s", name, error.message)
            for backend in node.backends.values():  # let its new agents go; it stays lost
                await backend.close()
            return
        node.returned()
        self._changed()
        log.info("GPU node %s is back: %d instance(s) prepared", name, len(node.residency.slots))

    async def _join(self, node_config: GpuNodeConfig) -> None:
        """A new node behind agents: sized by its agent on its host, its services admitted and prepared, then in
        service. A node that cannot hold them is left out, with the reason logged."""
        backends = self._nodes.backends(node_config)
        try:
            agent = next((b for b in backends.values() if isinstance(b, AgentServiceBackend)), None)
            if agent is None:
                raise ConfigError("gpu.services", "no service to host")
            sized = await agent.node_on_its_host()  # as its agent holds it: with agent = false
            node = GpuNode(replace(sized, agent=True), backends)
            admit(node, self._services.config.services)
            await self._nodes.prepare(node)
        except (ServiceError, ConfigError) as error:
            log.warning("GPU node %s not joined: %s", node_config.name, error)
            for backend in backends.values():
                await backend.close()
            return
        self._nodes.add(node)
        self._changed()
        log.info("GPU node %s joined: %d GPU(s) of %d MiB, %d MiB of host memory", node.name, node.config.gpus,
                 node.config.gpu_memory_mb, node.config.host_memory_mb)


async def _all_free(node: GpuNode) -> None:
    """Until no action holds any of the node's GPUs."""
    while node.chunks.free_gpus < node.config.gpus:
        await asyncio.sleep(0.1)
