"""Which service instances hold GPU memory on one node, and whom to evict for a restore (EOE, §5.3).

An instance is one service at one DoP on one chunk. Memory is booked per GPU when a decision is made, before
any await: a restore books its memory and the instances it evicts give theirs up at once, so two actions
deciding at the same time on disjoint chunks never count the same free memory twice. Victims are taken least
recently used first among the instances that share a GPU with the chunk. None of them can be running: the
chunk's GPUs belong to the deciding action alone (one action per GPU), and a running instance's chunk is held by
its own action.
"""

from __future__ import annotations

import asyncio
import itertools
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

    def to_json(self) -> dict[str, object]:
        return {"service": self.service, "dop": self.chunk.size, "gpus": list(self.chunk.gpus),
                "state": self.state.value, "restores": self.restores, "evictions": self.evictions,
                **self.instance.describe()}


class Residency:
    """GPU memory booked per GPU of one node, and its slots."""

    def __init__(self, gpus: int, gpu_memory_mb: int) -> None:
        self.budget_mb = gpu_memory_mb
        self.used_mb = [0] * gpus
        self.slots: dict[tuple[str, Chunk], Slot] = {}
        self._clock = itertools.count(1)

    def add(self, slot: Slot) -> None:
        self.slots[(slot.service, slot.chunk)] = slot

    def slot(self, service: str, chunk: Chunk) -> Slot | None:
        return self.slots.get((service, chunk))

    def touch(self, slot: Slot) -> None:
        slot.last_used = next(self._clock)

    def need_mb(self, slot: Slot) -> int:
        return slot.instance.spec.gpu_memory_mb

    def shortfall_mb(self, chunk: Chunk, need_mb: int) -> int:
        """Memory that would have to be evicted from ``chunk``'s GPUs to fit ``need_mb`` on each."""
        return sum(max(0, self.used_mb[g] + need_mb - self.budget_mb) for g in chunk.gpus)

    def plan_restore(self, slot: Slot) -> list[tuple[Slot, bool]]:
        """Book ``slot``'s memory, evicting LRU instances on its GPUs as needed; returns the victims to evict,
        each with whether it was broken (then it must be closed and made afresh rather than evicted).

        Broken instances go first (their memory is in doubt), then least recently used.
        """
        need = self.need_mb(slot)
        gpus = set(slot.chunk.gpus)
        holders = sorted((s for s in self.slots.values()
                          if s is not slot and s.state in (SlotState.RESIDENT, SlotState.BROKEN)
                          and gpus.intersection(s.chunk.gpus)),
                         key=lambda s: (s.state is not SlotState.BROKEN, s.last_used))
        used = list(self.used_mb)  # as it would be after the evictions chosen so far
        victims: list[tuple[Slot, bool]] = []
        for victim in holders:
            if all(used[g] + need <= self.budget_mb for g in gpus):
                break
            victims.append((victim, victim.state is SlotState.BROKEN))
            for g in victim.chunk.gpus:
                used[g] -= self.need_mb(victim)
        if any(used[g] + need > self.budget_mb for g in gpus):
            raise RuntimeError(f"{slot.service} needs {need} MiB on GPUs {sorted(gpus)} that cannot be freed: "
                               f"booked {[self.used_mb[g] for g in sorted(gpus)]} of {self.budget_mb} MiB")
        for victim, _ in victims:
            self.unbook(victim)
            victim.state = SlotState.EVICTING
        self.book(slot)
        slot.state = SlotState.RESTORING
        return victims

    def evicted(self, slot: Slot) -> None:
        """An eviction that ``plan_restore`` chose is done: the instance holds host memory only."""
        slot.state = SlotState.PREPARED
        slot.evictions += 1

    def restored(self, slot: Slot) -> None:
        """A restore that ``plan_restore`` booked is done: the instance serves from its chunk's GPUs."""
        slot.state = SlotState.RESIDENT
        slot.restores += 1

    def pending_evictions(self, chunk: Chunk) -> list[asyncio.Task[None]]:
        """Evictions in flight on ``chunk``'s GPUs: their memory is booked free but not yet really free."""
        gpus = set(chunk.gpus)
        return [s.eviction for s in self.slots.values()
                if s.eviction is not None and not s.eviction.done() and gpus.intersection(s.chunk.gpus)]

    def book(self, slot: Slot) -> None:
        for g in slot.chunk.gpus:
            self.used_mb[g] += self.need_mb(slot)

    def unbook(self, slot: Slot) -> None:
        for g in slot.chunk.gpus:
            self.used_mb[g] -= self.need_mb(slot)
