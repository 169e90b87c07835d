"""The records a broker answers from without the store: every action until ``retain_s`` after its end (a lease's,
after it is returned), by id and by idempotency key, and the last ends for the views. The store keeps them all."""

from __future__ import annotations

import collections
from collections.abc import Container

from tangram.core.action import Action
from tangram.idempotency import IdempotencyIndex

#: how many of the last ends the views read (ACT percentiles, the status page's history)
RECENT = 1000


class ActionMemory:
    def __init__(self, retain_s: float, idempotency: IdempotencyIndex) -> None:
        self.retain_s = retain_s
        self.idempotency = idempotency
        self.by_id: dict[str, Action] = {}
        #: the last ends, in finishing order
        self.recent: collections.deque[Action] = collections.deque(maxlen=RECENT)
        #: their ACTs, in the same order (the views poll the percentiles often)
        self.recent_acts: collections.deque[float] = collections.deque(maxlen=RECENT)
        self._forget: collections.deque[tuple[float, str]] = collections.deque()

    def remember(self, action: Action) -> None:
        self.by_id[action.id] = action
        self.idempotency.remember(action)

    def ended(self, action: Action, at: float) -> None:
        self.recent.append(action)
        self.recent_acts.append(action.act_s or 0.0)
        self._forget.append((at, action.id))

    def returned(self, action_id: str, at: float) -> None:
        """A lease given back: kept past ``retain_s`` after its end while it was held, now kept from ``at``."""
        self._forget.append((at, action_id))

    def forget_old(self, now: float, held: Container[str]) -> None:
        """Drop what ended more than ``retain_s`` ago, except the leases still ``held``."""
        while self._forget and self._forget[0][0] + self.retain_s < now:
            _, action_id = self._forget.popleft()
            if action_id not in held:
                action = self.by_id.pop(action_id, None)
                if action is not None:
                    self.idempotency.forget(action)
