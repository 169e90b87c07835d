"""The GPU nodes a GPU manager holds, configured or joined: each built on its backends, its services admitted and
prepared, and let go at the end. Read-only outside: a node enters through ``add``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping, Sequence

from managers.gpu.admission import admit
from managers.gpu.catalog import ServiceCatalog
from managers.gpu.config import GpuConfig, GpuNodeConfig
from managers.gpu.dict_view import DictView
from managers.gpu.node import GpuNode
from managers.gpu.preparation import prepare_instances
from reward_services.backend import ServiceBackend, ServiceSpec
from tangram.core.errors import Unavailable

log = logging.getLogger("tangram.gpu")

#: builds a node's backend for a service kind (torch, sglang)
BackendFactory = Callable[[str, GpuNodeConfig, GpuConfig], ServiceBackend]


class GpuNodes(DictView[str, GpuNode]):
    """Each node by name, in the order they came."""

    def __init__(self, catalog: ServiceCatalog, make_backend: BackendFactory) -> None:
        self._catalog = catalog
        self._make_backend = make_backend
        super().__init__({})

    def add(self, node: GpuNode) -> None:
        self._items[node.name] = node

    def type_of(self, name: str) -> str | None:
        """A node's GPU type; None for a node unknown."""
        node = self._items.get(name)
        return node.config.type if node is not None else None

    def backends(self, node: GpuNodeConfig, services: Sequence[ServiceSpec] | None = None,
                 made: Mapping[str, ServiceBackend] | None = None) -> dict[str, ServiceBackend]:
        """The node's backend for each kind of ``services`` (the config's by default), those ``made`` kept."""
        made = made or {}
        config = self._catalog.config
        return {spec.backend: made.get(spec.backend) or self._make_backend(spec.backend, node, config)
                for spec in (config.services if services is None else services)}

    def admitted(self, config: GpuNodeConfig) -> GpuNode:
        """A configured node built on its backends, with the services admitted (``ConfigError`` otherwise)."""
        node = GpuNode(config, self.backends(config))
        admit(node, self._catalog.config.services)
        return node

    async def prepare(self, node: GpuNode, only: Collection[str] | None = None) -> None:
        """Prepare the node's instances (of the services in ``only``, when given); ``ConfigError`` naming one."""
        await prepare_instances(node, self._catalog, only)

    async def prepare_in_service(self, names: Collection[str]) -> None:
        """Prepare the instances of ``names`` on every node in service (a lost node prepares them when it is back)."""
        for node in self._items.values():
            if node.lost is None:
                await self.prepare(node, names)

    def admit_added(self, added: Sequence[ServiceSpec]) -> None:
        """Admit services added at runtime on every node, its admission run anew over all its services, old and
        new; nothing changes unless every node admits them (``ConfigError`` naming the service or the node's
        budget, as at start). Their instances are left to prepare."""
        services = [*self._catalog.config.services, *added]
        names = {spec.name for spec in added}
        admitted: dict[str, GpuNode] = {}
        for node in self._items.values():  # nothing is changed before every node admits them
            scratch = GpuNode(node.config, self.backends(node.config, services, node.backends))
            admit(scratch, services)
            admitted[node.name] = scratch
        for node in self._items.values():
            scratch = admitted[node.name]
            node.backends.update(scratch.backends)
            node.services = scratch.services
            for slot in scratch.residency.slots.values():
                if slot.service in names:
                    node.residency.add(slot)
            if scratch.tier is not None:
                if node.tier is None:
                    node.tier = scratch.tier
                else:
                    node.tier.budget_mb = scratch.tier.budget_mb
                    node.tier.copies.update({name: copy for name, copy in scratch.tier.copies.items()
                                             if name in names})

    def check_serving(self, service: str) -> None:
        """``Unavailable`` while no node that serves ``service`` is in service."""
        serving = [node for node in self._items.values() if service in node.services]
        if all(node.lost is not None for node in serving):
            why = "; ".join(f"{node.name}: {node.lost}" for node in serving) or "none has joined yet"
            raise Unavailable("spec.service", f"no GPU node of service {service!r} is in service now ({why}); retry "
                                              f"once one is", retry_after_s=5)

    async def close(self) -> None:
        """Close every instance and backend of the nodes in service (a lost node's agents were let go with it)."""
        for node in self._items.values():
            await asyncio.gather(*node.loads.values())  # loads never raise
            if node.lost is not None:
                continue
            results = await asyncio.gather(*(slot.instance.close() for slot in node.residency.slots.values()),
                                           return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    log.warning("closing a service instance on %s failed: %r", node.name, result)
            for backend in node.backends.values():
                await backend.close()
