"""Which services' host copies one GPU node holds in host memory, and which only on its disk (issue 18).

A restore copies a service's weights from host memory to GPUs. When a node's services need more host memory than
it has, the copies spill to a disk tier (one file per service, written once at start; the weights never change):
a restore of a spilled service first loads its file into host memory (disk to host), then copies it on (host to
GPU). Host memory is a second cache below the GPUs': a load drops the least recently used copies that nothing is
using; a copy is pinned while a restore reads it or while it is loading.

Prefetch (``GpuManager.prefetch_plan``) hides the disk stage: from the queue's order, the scheduler loads the next
services that no node holds before their actions start, dropping only copies that no earlier queued action needs.

Bookkeeping only, as ``residency.py`` is for GPU memory: the GPU manager performs the loads and drops this plans,
and the simulator times them on its virtual clock, so both run the same decisions. Decisions are booked before any
await (a load's memory is booked when it is planned), so concurrent plans never count the same free memory twice.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum


class CopyState(StrEnum):
    DISK = "disk"  # only its file on disk: a restore must load it first
    LOADING = "loading"  # being read into host memory (booked)
    HOST = "host"  # in host memory: a restore copies it straight to GPUs


@dataclass(eq=False)
class HostCopy:
    service: str
    size_mb: int
    state: CopyState = CopyState.DISK
    last_used: int = 0
    pins: int = 0  # restores reading it, and its own load while LOADING
    loads: int = 0  # the first, at start, included
    drops: int = 0


class HostTierFull(Exception):
    """A copy cannot be loaded: the copies in use leave too little host memory."""


class HostTier:
    """Host memory of one node over its tiered services' copies. Services that cannot spill (their backend keeps
    its own host copies, like SGLang's servers) are never entered: their memory is taken off ``budget_mb``.
    Every copy starts on disk: the manager loads each in turn at start (prepares it, writes its file)."""

    def __init__(self, budget_mb: int, sizes: Mapping[str, int]) -> None:
        self.budget_mb = budget_mb
        self.copies = {service: HostCopy(service, size_mb) for service, size_mb in sizes.items()}
        self._clock = itertools.count(1)

    @property
    def used_mb(self) -> int:
        return sum(copy.size_mb for copy in self.copies.values() if copy.state is not CopyState.DISK)

    def plan_load(self, service: str, keep: Iterable[str] = (), spare: Iterable[str] = ()) -> list[HostCopy]:
        """Book room for ``service``'s copy, dropping least recently used unpinned copies, those in ``spare`` last
        and never one in ``keep``; returns the copies to drop. Raises ``HostTierFull`` when pinned and kept copies
        leave too little room."""
        copy = self.copies[service]
        kept, spared = set(keep), set(spare)
        victims: list[HostCopy] = []
        free = self.budget_mb - self.used_mb
        candidates = sorted((c for c in self.copies.values() if c.state is CopyState.HOST and not c.pins
                             and c is not copy and c.service not in kept),
                            key=lambda c: (c.service in spared, c.last_used))
        for victim in candidates:
            if free >= copy.size_mb:
                break
            victims.append(victim)
            free += victim.size_mb
        if free < copy.size_mb:
            busy = sorted(c.service for c in self.copies.values() if c.state is not CopyState.DISK)
            raise HostTierFull(f"{service} needs {copy.size_mb} MiB of host memory; {self.budget_mb - self.used_mb} "
                               f"MiB of {self.budget_mb} are free and the copies of {busy} are in use or needed "
                               f"sooner")
        for victim in victims:
            self.dropped(victim)
        copy.state = CopyState.LOADING
        copy.pins += 1
        return victims

    def loaded(self, service: str) -> None:
        """A load that ``plan_load`` booked is done."""
        copy = self.copies[service]
        copy.state = CopyState.HOST
        copy.pins -= 1
        copy.loads += 1
        copy.last_used = next(self._clock)

    def load_failed(self, service: str) -> None:
        copy = self.copies[service]
        copy.state = CopyState.DISK
        copy.pins -= 1

    def dropped(self, copy: HostCopy) -> None:
        copy.state = CopyState.DISK
        copy.drops += 1

    def pin(self, service: str) -> None:
        """A restore reads the copy (it must be in host memory): not dropped until ``unpin``."""
        copy = self.copies.get(service)
        if copy is not None:
            copy.pins += 1
            copy.last_used = next(self._clock)

    def unpin(self, service: str) -> None:
        copy = self.copies.get(service)
        if copy is not None:
            copy.pins -= 1

    @property
    def loading(self) -> bool:
        """Whether a load is in flight (prefetch starts one at a time: a disk reads one file fastest alone)."""
        return any(copy.state is CopyState.LOADING for copy in self.copies.values())

    def holds(self, service: str) -> bool:
        """Whether ``service``'s copy is in host memory or on its way there (an untiered service's always is)."""
        copy = self.copies.get(service)
        return copy is None or copy.state is not CopyState.DISK

    def to_json(self) -> dict[str, object]:
        return {"budget_mb": self.budget_mb, "used_mb": self.used_mb,
                "copies": {c.service: {"state": c.state.value, "size_mb": c.size_mb, "loads": c.loads,
                                       "drops": c.drops} for c in self.copies.values()}}
