"""Setup-aware order of the queue (issue 18): Highest Response Ratio with Setup (PlexRL §4.4, eq. 3-4).

On a GPU pool shared by many reward services, FCFS switches services whenever the next action needs another one,
and each switch costs a restore (and an eviction). HRRS ranks each waiting action by

    P = 1 + W / (E + setup)

with W its wait so far, ``setup`` what it would spend getting its resource ready if it started now (a restore when
its service is not resident; 0 when it is) and E an execution time. Actions of a resident service rise first, so
same-service actions are grouped and the restore is amortised, while every action's priority grows with its wait.

**E is the mean expected execution time of the actions ranked, not each action's own** (a departure from PlexRL,
whose eq. 4 takes each request's). With its own E, the rule also ranks short actions ahead of long ones, as HRRN
does. In ``gpu-hrrs`` at 1,024 with restores at the measured 55 GB/s, that made DeepSearch's judge calls, longer
than the teachers', wait 1.41x FCFS's p99 (seed 1; docs/EVALUATION.md). With one E the order is FCFS with a
handicap for a switch: an action that needs a restore goes ahead of one that does not only once it has waited
``(E + setup) / E`` times as long. Each action's expected time is estimated when it is first ranked (re-estimating
every queued action at every pass cost more than the rest of the pass).

The paper's rule alone can still starve an action: when a resident service overloads the pool, its oldest
actions' ratios grow faster than any other's (``tests/test_setup_order.py``). So an action that is *overdue* goes
ahead of every action that is not, in submission order: whatever the arrivals, once it has waited ``max_wait_s`` it
is ordered as under FCFS among the overdue ones (the bound: ``max_wait_s`` plus its FCFS wait from then on).

How long an action may be passed over sets the trade between grouping and the tail. A fixed time cannot suit both
a short queue and a long one: 10 s kept the p99 wait within 1.2x FCFS's where queues are short but gave up most of
the grouping where every action waits longer than that, and 60 s the reverse (docs/EVALUATION.md). So an action is
overdue once it has waited ``OVERDUE_FACTOR`` times the mean wait of the actions queued with it, never sooner than
``overdue_floor_s`` and never later than ``max_wait_s``: the wait it may lose grows with the queue, as does the
wait it would have had under FCFS.

Only actions that demand a resource ordered by HRRS are reordered, among the queue positions they hold, so every
other resource keeps its FCFS order and the scheduler's per-resource blocking works as before. Algorithm 1 runs on
the order this gives.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence

from tangram.core.action import Action

#: an action is overdue once it has waited this many times the mean wait of the actions queued with it (between the
#: floor and ``max_wait_s``)
OVERDUE_FACTOR = 2.0


class SetupAwareOrder:
    """Reorders the actions that demand one of ``resources`` by HRRS."""

    def __init__(self, resources: Iterable[str], expected_s: Callable[[Action], float],
                 setup_costs: Callable[[Sequence[Action]], Mapping[str, float]], max_wait_s: float,
                 overdue_floor_s: float | None = None) -> None:
        """``expected_s(action)``: its expected execution time; ``setup_costs(actions)``: each one's setup (by
        id; absent: none) if it started now; ``overdue_floor_s`` and ``max_wait_s``: the shortest and longest wait
        after which an action is overdue (no floor: always ``max_wait_s``)."""
        self.resources = frozenset(resources)
        self._expected_s = expected_s
        self._setup_costs = setup_costs
        self.max_wait_s = max_wait_s
        self.overdue_floor_s = max_wait_s if overdue_floor_s is None else min(overdue_floor_s, max_wait_s)
        #: each queued action's expected execution time, from its first ranking
        self._expected: dict[str, float] = {}

    @staticmethod
    def priority(wait_s: float, expected_s: float, setup_s: float) -> float:
        """HRRS's response ratio with setup (eq. 4)."""
        return 1.0 + max(0.0, wait_s) / max(expected_s + setup_s, 1e-9)

    def overdue_after_s(self, waits: Sequence[float]) -> float:
        """The wait after which an action is overdue, with the ordered actions queued for ``waits``."""
        return min(self.max_wait_s, max(self.overdue_floor_s, OVERDUE_FACTOR * statistics.fmean(waits)))

    def order(self, queue: Iterable[Action], now: float) -> list[Action]:
        actions = list(queue)
        slots = [i for i, action in enumerate(actions) if not self.resources.isdisjoint(action.demands)]
        if len(slots) < 2:
            return actions
        chosen = [actions[i] for i in slots]
        overdue_s = self.overdue_after_s([now - action.submitted_at for action in chosen])
        setup = self._setup_costs(chosen)
        known = self._expected
        self._expected = expected = {action.id: known[action.id] if action.id in known else self._expected_s(action)
                                     for action in chosen}
        mean_s = statistics.fmean(expected.values())

        def rank(action: Action) -> tuple[int, float, int]:
            wait_s = now - action.submitted_at
            if wait_s >= overdue_s:
                return (0, 0.0, action.seq)  # overdue: first, in submission order
            return (1, -self.priority(wait_s, mean_s, setup.get(action.id, 0.0)), action.seq)

        for i, action in zip(slots, sorted(chosen, key=rank)):
            actions[i] = action
        return actions
