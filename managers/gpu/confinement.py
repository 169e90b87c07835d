"""Which GPU nodes each reward service's actions may start on: a placement's variants (``managers/gpu/placement.py``,
given by the manager's own live placement or by the simulator's), every node where none is given."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from managers.gpu.node import GpuNode


class ServiceConfinement:
    """The nodes a placement confines each service to; the fit, setup costs and prefetch ask ``may_run``."""

    def __init__(self, nodes: Mapping[str, GpuNode]) -> None:
        self._nodes = nodes
        #: service -> the nodes its reward actions may run on; a service absent: every node
        self.allowed: dict[str, frozenset[str]] = {}

    def place_services(self, allowed: Mapping[str, Collection[str]] | None = None) -> None:
        """Confine each service's reward actions to the nodes named for it; ``None``, the default, lets every
        service run on every node. An empty or missing entry, or one naming no node in service (unknown or lost),
        also means every node: a placement can slow a service down but never leave it unservable. Only where new
        actions start changes: instances resident elsewhere stay until evicted, and a resident instance on a node
        outside counts for nothing."""
        self.allowed = {service: frozenset(nodes) for service, nodes in (allowed or {}).items() if nodes}

    def place_on_types(self, types: Mapping[str, Iterable[str]]) -> None:
        """Confine each service to the nodes of the types (node groups) it has a variant on."""
        kinds = {service: set(names) for service, names in types.items()}
        self.place_services({service: [name for name, node in self._nodes.items() if node.config.type in mine]
                             for service, mine in kinds.items()})

    def may_run(self, service: str, node: GpuNode) -> bool:
        """Whether ``service``'s actions may start on ``node``."""
        allowed = self.allowed.get(service)
        if allowed is None or node.name in allowed:
            return True
        return not any(self._nodes[name].lost is None for name in allowed if name in self._nodes)
