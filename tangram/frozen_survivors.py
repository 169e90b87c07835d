"""Full collections that skip the records a full collection has already scanned.

A broker holds every action's record for a while (a lease's for its whole TTL): hundreds of thousands of tracked
objects at a large job's scale. Python's collector scans all of them at each full collection, one stall of the event
loop each, though a record that has survived one full collection rarely joins a cycle later. So after each full
collection the survivors are frozen (``gc.freeze``) and the next one scans only what is newer. Once the frozen set
has grown ``RESCAN_GROWTH``-fold since the last complete scan, it is unfrozen instead, and the next full collection
scans everything once: cycles among old records are still found, and what a frozen cycle can hold is bounded.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

#: how many times the frozen set may grow between two full collections that scan everything
RESCAN_GROWTH = 2.0


class FrozenSurvivors:
    """Freezes what each full collection leaves, on ``loop``, from ``start`` until ``stop``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, growth: float = RESCAN_GROWTH) -> None:
        self._loop = loop
        self._growth = growth
        #: objects frozen after the last full collection that scanned everything; None: the next one does
        self._scanned: int | None = None
        self.freezes = 0
        self.rescans = 0

    def start(self) -> None:
        gc.callbacks.append(self._collected)

    def stop(self) -> None:
        if self._collected in gc.callbacks:
            gc.callbacks.remove(self._collected)

    def _collected(self, phase: str, info: dict[str, Any]) -> None:
        """A collector callback, in whichever thread allocated: the freeze runs on the loop, just after."""
        if phase == "stop" and info["generation"] == 2 and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.after_full_collection)

    def after_full_collection(self) -> None:
        frozen = gc.get_freeze_count()
        if self._scanned is not None and frozen > self._growth * self._scanned:
            gc.unfreeze()
            self._scanned = None
            self.rescans += 1
            return
        gc.freeze()
        self.freezes += 1
        if self._scanned is None:
            self._scanned = gc.get_freeze_count()
