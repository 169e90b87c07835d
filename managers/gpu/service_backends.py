"""Which ``ServiceBackend`` holds a GPU node's services of one kind: the torch worker or SGLang servers on this
host, or, for a node with ``agent = true``, the same backend on its own host behind a service agent (issue 17)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from managers.gpu.config import GpuConfig, GpuNodeConfig
from reward_services.backend import ServiceBackend

#: whether a kind's instances share one host copy of a service's weights (``ServiceBackend.shares_host_copy``),
#: known here without importing the backend (torch is heavy), for admission of a node behind an agent
HOST_COPY_SHARED = {"torch": True, "sglang": False}
#: whether a kind's host copies can go down to a node's disk tier (``ServiceBackend.tiered``, given ``disk_dir``)
SPILLS_TO_DISK = {"torch": True, "sglang": False}


def make_service_backend(kind: str, node: GpuNodeConfig, config: GpuConfig) -> ServiceBackend:
    """Backends are imported only when a service uses them (torch is heavy; SGLang needs nothing here, Ray only a
    node behind an agent)."""
    if node.agent:
        from managers.remote.broker.agent_services import AgentServiceBackend
        from managers.remote.broker.ray_service_agents import RayServiceLink

        return AgentServiceBackend(RayServiceLink(kind, replace(node, agent=False), config), HOST_COPY_SHARED[kind],
                                   SPILLS_TO_DISK[kind] and node.disk_dir is not None)
    if kind == "torch":
        from reward_services.torch_worker import TorchBackend
        return TorchBackend(device_type=node.device_type, disk_dir=Path(node.disk_dir) if node.disk_dir else None)
    from reward_services.sglang import NvmlProbe, SglangBackend
    return SglangBackend(log_dir=f"{config.log_dir}/{node.name}",
                         probe=NvmlProbe() if node.device_type == "cuda" else None)
