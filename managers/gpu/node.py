"""One GPU node as the GPU manager holds it: its buddy chunks, the service instances resident on them, its backends
and, with a disk tier, its host memory's copies and the loads in flight."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from managers.gpu.chunks import Chunk, ChunkAllocator, Preference
from managers.gpu.config import GpuNodeConfig
from managers.gpu.host_tier import HostTier
from managers.gpu.residency import Residency
from managers.gpu.slot import SlotState
from managers.remote.broker.node_standing import NodeStanding
from reward_services.backend import ServiceBackend

#: the resource a GPU node's units are
RESOURCE = "gpu"


class GpuNode(NodeStanding):
    """One node's chunks, residency and backends."""

    def __init__(self, config: GpuNodeConfig, backends: dict[str, ServiceBackend]) -> None:
        super().__init__()
        self.name = config.name
        self.config = config
        self.chunks = ChunkAllocator(config.gpus)
        self.residency = Residency(config.gpus, config.gpu_memory_mb)
        self.backends = backends
        self.services: dict[str, int] = {}  # admitted service -> GPU memory it needs per GPU
        #: host memory over the services that spill to the node's disk tier (None: no disk tier)
        self.tier: HostTier | None = None
        #: each tiered service's load from disk in flight or last done: its error message, or None
        self.loads: dict[str, asyncio.Task[str | None]] = {}

    def chunk_key(self, service: str) -> Preference:
        """The allocator's preference among equal chunks: the service resident there, then least to evict."""
        need = self.services.get(service, 0)

        def key(chunk: Chunk) -> tuple[int, int]:
            slot = self.residency.slot(service, chunk)
            resident = slot is not None and slot.state is SlotState.RESIDENT
            return (0 if resident else 1, self.residency.shortfall_mb(chunk, need))
        return key

    def resident_services(self) -> set[str]:
        return {slot.service for slot in self.residency.slots.values() if slot.state is SlotState.RESIDENT}

    def resident_on_free_chunk(self, service: str, dops: Sequence[int], free: ChunkAllocator) -> bool:
        return any(slot.state is SlotState.RESIDENT and slot.chunk.size in dops
                   and any(parent.contains(slot.chunk) for parent in free.free)
                   for (name, _), slot in self.residency.slots.items() if name == service)
