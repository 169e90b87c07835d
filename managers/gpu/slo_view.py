"""The GPU manager as SLO admission plans with it (``tangram/slo/pool.py``'s ``GpuPool``): GPUs in service and
each service's expected restore, read live, so admission follows nodes lost and restores learned."""

from __future__ import annotations

from collections.abc import Sequence

from managers.gpu.manager import GpuManager
from managers.gpu.node import RESOURCE
from managers.gpu.setup_costs import RESTORE_PRIOR_MB_PER_S
from reward_services.backend import ServiceSpec
from tangram.core.action import Action


class GpuSloView:
    resource = RESOURCE

    def __init__(self, manager: GpuManager) -> None:
        self.manager = manager

    def gpus_in_service(self) -> int:
        return sum(node.config.gpus for node in self.manager.nodes.values() if node.lost is None)

    def expected_restore_s(self, adding: Sequence[ServiceSpec] = ()) -> dict[str, float]:
        """At the manager's learned estimate; a service being added at the manager's prior."""
        restore = {name: self.manager.restore_time.estimate(name) for name in self.manager.services}
        for spec in adding:
            restore.setdefault(spec.name, spec.host_memory_mb / RESTORE_PRIOR_MB_PER_S)
        return restore

    def service_of(self, action: Action) -> str:
        return self.manager.reward_request(action).service
