"""Which cores each running command of one sandbox holds, so the sandbox itself widens to their union before a
command runs and narrows (or freezes) after it ends.

The sandbox keeps this rather than its caller so that a command costs its caller one call (``Sandbox.execute``),
which matters when the sandbox sits behind a node agent on another host: pin, run and settle were three round
trips there. A resize that reaches the sandbox before its command started (calls to an agent may be reordered) is
remembered, and the command starts on those cores, as the executor does for its own re-pins.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

#: cores sent for tags that never start (their action was cancelled first) must not pile up
MAX_EARLY_TAGS = 1024


class CorePins:
    """Running commands' cores by tag, and cores sent for tags not started yet."""

    def __init__(self) -> None:
        self.running: dict[str, frozenset[int]] = {}
        self._early: OrderedDict[str, frozenset[int]] = OrderedDict()
        #: held around each cgroup change, so the union written is never an older one
        self.lock = asyncio.Lock()

    def union(self) -> frozenset[int]:
        return frozenset(core for cores in self.running.values() for core in cores)

    def start(self, tag: str, cores: frozenset[int]) -> frozenset[int]:
        """Register the command tagged ``tag``; answers the cores it starts on (those of an earlier resize)."""
        cores = self._early.pop(tag, cores)
        self.running[tag] = cores
        return cores

    def end(self, tag: str) -> None:
        self.running.pop(tag, None)

    def move(self, tag: str, cores: frozenset[int]) -> bool:
        """Give the running command tagged ``tag`` these cores (True), or remember them for its start (False)."""
        if tag in self.running:
            self.running[tag] = cores
            return True
        self._early[tag] = cores
        self._early.move_to_end(tag)
        while len(self._early) > MAX_EARLY_TAGS:
            self._early.popitem(last=False)
        return False
