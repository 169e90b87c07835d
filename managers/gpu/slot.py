"""One service instance on one chunk of a GPU node (an instance is one service at one DoP on one chunk), and the
state its GPU memory is in: the unit that residency books and a switch evicts or restores."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import StrEnum

from managers.gpu.chunks import Chunk
from reward_services.backend import ServiceInstance


class SlotState(StrEnum):
    PREPARED = "prepared"  # weights in host memory only
    RESTORING = "restoring"
    RESIDENT = "resident"
    EVICTING = "evicting"
    BROKEN = "broken"  # a failed operation left the device state unknown: memory stays booked until it is evicted


@dataclass(eq=False)
class Slot:
    service: str
    chunk: Chunk
    instance: ServiceInstance
    state: SlotState = SlotState.PREPARED
    last_used: int = 0
    restores: int = 0
    evictions: int = 0
    #: the eviction in flight, awaited by whoever needs its memory
    eviction: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def holds_memory(self) -> bool:
        return self.state is not SlotState.PREPARED

    @property
    def need_mb(self) -> int:
        """GPU memory it books on each of its chunk's GPUs while it holds memory."""
        return self.instance.spec.gpu_memory_mb

    def to_json(self) -> dict[str, object]:
        return {"service": self.service, "dop": self.chunk.size, "gpus": list(self.chunk.gpus),
                "state": self.state.value, "restores": self.restores, "evictions": self.evictions,
                **self.instance.describe()}
