"""The decision behind a switch (evict-on-execution, §5.3): what to evict so that a service becomes resident on a
chunk of a node's GPUs, and whether to restore it at all.

A pure function of the node's booked memory: no I/O and no clock, so that the GPU manager, which carries the plan
out with real evictions and restores (``managers/gpu/switch.py``), and the simulator, which times it with its cost
model (``tangram/sim/broker_station.py``), decide alike. Victims are the instances sharing a GPU with the chunk,
broken ones first (their memory is in doubt), then least recently used, until the service fits on every GPU of
the chunk. None of them can be running: the chunk's GPUs belong to the deciding action alone (one action per GPU),
and a running instance's chunk is held by its own action.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from managers.gpu.chunks import Chunk
from managers.gpu.slot import Slot, SlotState


class BookedMemory(Protocol):
    """What the decision reads of one node's residency (``Residency``)."""

    @property
    def budget_mb(self) -> int: ...
    @property
    def used_mb(self) -> Sequence[int]: ...
    @property
    def slots(self) -> Mapping[tuple[str, Chunk], Slot]: ...


class SwitchBlocked(Exception):
    """The service cannot fit: memory booked by broken instances on other chunks cannot be freed from here."""


@dataclass(frozen=True)
class SwitchPlan:
    """What makes ``slot`` resident: nothing when it is (``restore`` false); else the instances to evict first, each
    with whether it was broken (then it is closed and made afresh rather than evicted), and whether ``slot``'s own
    instance is made afresh before its restore (``renew``: it was broken)."""

    slot: Slot
    restore: bool = False
    victims: tuple[tuple[Slot, bool], ...] = ()
    renew: bool = False


def plan_switch(booked: BookedMemory, slot: Slot) -> SwitchPlan:
    """The switch that makes ``slot`` resident, from the memory ``booked`` on its node; raises ``SwitchBlocked``
    when evicting every instance on its GPUs would still leave too little. A broken ``slot``'s own booking counts
    as freed: it is made afresh."""
    if slot.state is SlotState.RESIDENT:
        return SwitchPlan(slot)
    renew = slot.state is SlotState.BROKEN
    need = slot.need_mb
    gpus = set(slot.chunk.gpus)
    used = list(booked.used_mb)  # as it would be after the evictions chosen so far
    if renew:
        for g in slot.chunk.gpus:
            used[g] -= need
    before = list(used)
    holders = sorted((s for s in booked.slots.values()
                      if s is not slot and s.state in (SlotState.RESIDENT, SlotState.BROKEN)
                      and gpus.intersection(s.chunk.gpus)),
                     key=lambda s: (s.state is not SlotState.BROKEN, s.last_used))
    victims: list[tuple[Slot, bool]] = []
    for victim in holders:
        if all(used[g] + need <= booked.budget_mb for g in gpus):
            break
        victims.append((victim, victim.state is SlotState.BROKEN))
        for g in victim.chunk.gpus:
            used[g] -= victim.need_mb
    if any(used[g] + need > booked.budget_mb for g in gpus):
        raise SwitchBlocked(f"{slot.service} needs {need} MiB on GPUs {sorted(gpus)} that cannot be freed: "
                            f"booked {[before[g] for g in sorted(gpus)]} of {booked.budget_mb} MiB")
    return SwitchPlan(slot, restore=True, victims=tuple(victims), renew=renew)
