"""Do-nothing service instances for the GPU manager's scheduling decisions (which node, whether to wait), with a
virtual clock: admission, chunks, residency and the host tier stay the manager's own. The real torch worker's
restores and loads are in ``test_gpu_manager.py`` and ``test_disk_tier.py``."""

from __future__ import annotations

from typing import Any

from reward_services.backend import ServiceBackend, ServiceInstance, ServiceSpec
from tangram.core.action import Action, Demand, Kind


class IdleInstance(ServiceInstance):
    async def prepare(self) -> None: ...

    async def restore(self) -> None: ...

    async def evict(self) -> None: ...

    async def infer(self, request: Any) -> dict[str, Any]:
        return {}

    async def close(self) -> None: ...


class IdleBackend(ServiceBackend):
    """Shares one host copy per service per node, like the torch worker, and can spill it to a disk tier."""

    shares_host_copy = True
    tiered = True

    def instance(self, spec: ServiceSpec, devices: tuple[int, ...]) -> ServiceInstance:
        return IdleInstance(spec, devices)

    async def spill(self, spec: ServiceSpec) -> None: ...

    async def drop_host(self, spec: ServiceSpec) -> None: ...

    async def load_host(self, spec: ServiceSpec) -> None: ...


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def reward(service: str, submitted_at: float) -> Action:
    """A reward action for ``service`` on one GPU."""
    return Action(task="t", kind=Kind.REWARD, demands={"gpu": Demand((1,))}, submitted_at=submitted_at,
                  spec={"service": service, "input": {"pairs": [["x", "y"]]}})
