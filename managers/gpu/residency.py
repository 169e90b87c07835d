"""Which service instances hold GPU memory on one node (EOE, §5.3), booked per GPU.

Memory is booked when a decision is made, before any await: a restore books its memory and the instances it evicts
(``switch_plan.py`` decides which) give theirs up at once, so two actions deciding at the same time on disjoint
chunks never count the same free memory twice.
"""

from __future__ import annotations

import asyncio
import itertools

from managers.gpu.chunks import Chunk
from managers.gpu.slot import Slot, SlotState
from managers.gpu.switch_plan import SwitchPlan, plan_switch


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

    def shortfall_mb(self, chunk: Chunk, need_mb: int) -> int:
        """Memory that would have to be evicted from ``chunk``'s GPUs to fit ``need_mb`` on each."""
        return sum(max(0, self.used_mb[g] + need_mb - self.budget_mb) for g in chunk.gpus)

    def plan_restore(self, slot: Slot) -> list[tuple[Slot, bool]]:
        """Decide (``plan_switch``) and book the switch that makes ``slot`` resident; returns the victims to evict,
        each with whether it was broken."""
        plan = plan_switch(self, slot)
        self.commit(plan)
        return list(plan.victims)

    def commit(self, plan: SwitchPlan) -> None:
        """Book a switch that ``plan_switch`` decided: the victims' memory is free and theirs to give up
        (``evicted``), the restored instance's is taken (``restored`` once done)."""
        if not plan.restore:
            return
        if plan.renew:
            self.unbook(plan.slot)
        for victim, _ in plan.victims:
            self.unbook(victim)
            victim.state = SlotState.EVICTING
        self.book(plan.slot)
        plan.slot.state = SlotState.RESTORING

    def evicted(self, slot: Slot) -> None:
        """An eviction that a committed switch chose is done: the instance holds host memory only."""
        slot.state = SlotState.PREPARED
        slot.evictions += 1

    def restored(self, slot: Slot) -> None:
        """A restore that a committed switch booked is done: the instance serves from its chunk's GPUs."""
        slot.state = SlotState.RESIDENT
        slot.restores += 1

    def pending_evictions(self, chunk: Chunk) -> list[asyncio.Task[None]]:
        """Evictions in flight on ``chunk``'s GPUs: their memory is booked free but not yet really free."""
        gpus = set(chunk.gpus)
        return [s.eviction for s in self.slots.values()
                if s.eviction is not None and not s.eviction.done() and gpus.intersection(s.chunk.gpus)]

    def book(self, slot: Slot) -> None:
        for g in slot.chunk.gpus:
            self.used_mb[g] += slot.need_mb

    def unbook(self, slot: Slot) -> None:
        for g in slot.chunk.gpus:
            self.used_mb[g] -= slot.need_mb
