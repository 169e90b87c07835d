"""What the GPU manager shows of itself: each node's pool (``GET /v1/resources``, the status page) and each
service's state, instances and share of the placement (``GET /v1/services``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from managers.gpu.catalog import ServiceCatalog
from managers.gpu.live_placement import LivePlacement
from managers.gpu.node import RESOURCE, GpuNode
from managers.gpu.service_demand import ServiceDemand
from managers.gpu.slot import SlotState
from tangram.core.seam import PoolStatus


def node_pools(nodes: Iterable[GpuNode]) -> list[PoolStatus]:
    """Each node's GPUs, in use and free, with the instances holding GPU memory and its host tier."""
    rows = []
    for node in nodes:
        resident = [slot.to_json() for slot in node.residency.slots.values() if slot.holds_memory]
        rows.append(PoolStatus(RESOURCE, node.name, node.config.gpus, node.config.gpus - node.chunks.free_gpus,
                               extra={"device_type": node.config.device_type, "lost": node.lost,
                                      "free_chunks": sorted([c.start, c.size] for c in node.chunks.free),
                                      "gpu_memory_mb": node.config.gpu_memory_mb,
                                      "gpu_memory_booked_mb": list(node.residency.used_mb),
                                      "resident": resident,
                                      "host_tier": node.tier.to_json() if node.tier is not None else None}))
    return rows


def describe_services(services: ServiceCatalog, nodes: Mapping[str, GpuNode], demand: ServiceDemand,
                      live: LivePlacement | None) -> list[dict[str, Any]]:
    """Every service, where it can run and where it is resident, its run GPU-seconds per action on each type it ran
    on, and its part of the placement in force."""
    learned = demand.learned()
    out = []
    for spec in services.values():
        slots = [slot for node in nodes.values() for slot in node.residency.slots.values()
                 if slot.service == spec.name]
        out.append({"name": spec.name, "state": services.preparing.get(spec.name, "serving"),
                    "backend": spec.backend, "model": spec.model, "task": spec.task,
                    "dops": list(spec.dops), "gpu_memory_mb": spec.gpu_memory_mb,
                    "host_memory_mb": spec.host_memory_mb,
                    "nodes": sorted(n.name for n in nodes.values() if spec.name in n.services),
                    "instances": len(slots),
                    "host_copies": {n.name: n.tier.copies[spec.name].state.value for n in nodes.values()
                                    if n.tier is not None and spec.name in n.tier.copies},
                    "resident": [{"node": n.name, **s.to_json()} for n in nodes.values()
                                 for s in n.residency.slots.values()
                                 if s.service == spec.name and s.state is SlotState.RESIDENT],
                    "run_gpu_s": {kind: round(gpu_s, 6) for kind, gpu_s in learned.get(spec.name, {}).items()},
                    **({"placement": live.describe(spec.name)} if live is not None else {})})
    return out
