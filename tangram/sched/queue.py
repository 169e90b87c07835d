"""The unified waiting queue: one queue for every action type, ordered by a pluggable policy.

The policy decides only the *order* in which a scheduling pass considers actions. How that order is applied
across different resource types (per-resource FCFS, so an action waiting for CPUs never blocks one that needs
only API quota) lives in the scheduler's candidate selection.
"""

from __future__ import annotations

import abc
from collections import Counter
from collections.abc import Iterator

from tangram.core.action import Action


class QueuePolicy(abc.ABC):
    """Waiting actions in scheduling order."""

    @abc.abstractmethod
    def push(self, action: Action) -> None: ...

    @abc.abstractmethod
    def remove(self, action_id: str) -> Action | None:
        """Take an action out (scheduled or cancelled); None if it is not queued."""

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Action]: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __contains__(self, action_id: str) -> bool: ...

    def depth_by_resource(self) -> Counter[str]:
        """Queued actions per resource they demand (one action counts once per resource)."""
        depth: Counter[str] = Counter()
        for action in self:
            depth.update(action.demands.keys())
        return depth


class FCFSQueue(QueuePolicy):
    """First come, first served by submission sequence number (the paper's choice against starvation)."""

    def __init__(self) -> None:
        self._actions: dict[str, Action] = {}
        self._last_seq = -1

    def push(self, action: Action) -> None:
        if action.seq < self._last_seq:
            # Rare (recovery re-queues older actions): rebuild to keep the dict in sequence order.
            self._actions[action.id] = action
            self._actions = dict(sorted(self._actions.items(), key=lambda item: item[1].seq))
        else:
            self._actions[action.id] = action
            self._last_seq = action.seq

    def remove(self, action_id: str) -> Action | None:
        return self._actions.pop(action_id, None)

    def __iter__(self) -> Iterator[Action]:
        return iter(list(self._actions.values()))

    def __len__(self) -> int:
        return len(self._actions)

    def __contains__(self, action_id: str) -> bool:
        return action_id in self._actions
