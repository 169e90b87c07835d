"""GPUs reserved for SLO-planned tasks (issue 18): the order that makes a reservation hold.

SLO admission (``tangram/slo/plan.py``) reserves ``g_k`` GPUs for a task whose SLO the shared pool's bound cannot
keep. The reservation is not a partition: nothing is set aside while the task does not use it. Instead, each pass
puts the task's queued actions ahead of every other action on the resource while the GPUs its running actions hold,
plus the minimum units of those put ahead, stay within ``g_k``; its other actions, and every unreserved task's, keep
the order they had. With the reservations summing to at most the pool, a reserved task waits for its GPUs only as
long as the actions holding them run, and the scheduler's per-resource blocking keeps later actions from taking a
GPU it is owed. Among the actions put ahead, the order they had (FCFS, or HRRS with ``[scheduler] queue_order``) stands.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from tangram.core.action import Action


class ReservedShares:
    """Orders ``resource``'s queued actions so that each reserved task's, up to its reservation, go first."""

    def __init__(self, resource: str) -> None:
        self.resource = resource
        #: task -> units of ``resource`` reserved for it
        self.reserved: dict[str, int] = {}

    def reserve(self, reserved: Mapping[str, int]) -> None:
        """The reservations from now on (every admission replaces them all)."""
        self.reserved = {task: units for task, units in reserved.items() if units > 0}

    def order(self, queue: Iterable[Action], running: Iterable[Action]) -> Iterable[Action]:
        """``queue`` with the actions owed a reservation first; ``queue`` itself when there are none."""
        if not self.reserved:
            return queue
        held: Counter[str] = Counter()
        for action in running:
            units = action.units.get(self.resource)
            if units and action.task in self.reserved:
                held[action.task] += units
        owed: list[Action] = []
        rest: list[Action] = []
        for action in queue:
            demand = action.demands.get(self.resource)
            reserved = self.reserved.get(action.task, 0)
            if demand is not None and held[action.task] + demand.min <= reserved:
                held[action.task] += demand.min
                owed.append(action)
            else:
                rest.append(action)
        return owed + rest
