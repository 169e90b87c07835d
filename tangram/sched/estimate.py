"""ACT approximation for the actions left in the queue (Appendix A, Algorithm 2).

The completion heap holds, per resource, when each unit becomes free (relative to now), grouped as
``(time, count)`` so a thousand idle cores are one entry. A waiting action at its minimum ``m`` units takes the
``m`` earliest units, starts when the last of them frees (or when it arrives, for an expected action not submitted
yet: ``tangram.sched.arrivals``), and gives them back at ``start + duration``. ``depth`` lets the first waiting action
try its first few allowed unit counts, as in the paper.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

INF = float("inf")


@dataclass(slots=True, frozen=True)
class Waiting:
    """A queued (or expected) action as the estimate sees it: allowed unit counts, the duration at each, and for an
    action not submitted yet, seconds until it is expected (its ACT counts from then)."""

    counts: tuple[int, ...]
    durations: tuple[float, ...]
    arrival_s: float = 0.0


class CompletionHeap:
    """Multiset of unit free-times."""

    __slots__ = ("_entries", "units")

    def __init__(self, entries: Sequence[tuple[float, int]] = ()) -> None:
        self._entries = [(t, n) for t, n in entries if n > 0]
        heapq.heapify(self._entries)
        self.units = sum(n for _, n in self._entries)

    def copy(self) -> CompletionHeap:
        clone = CompletionHeap.__new__(CompletionHeap)
        clone._entries = list(self._entries)
        clone.units = self.units
        return clone

    def put(self, time: float, count: int) -> None:
        if count > 0:
            heapq.heappush(self._entries, (time, count))
            self.units += count

    def extend(self, entries: Iterable[tuple[float, int]]) -> None:
        """Add many entries at once (one heapify instead of a push each)."""
        added = [(t, n) for t, n in entries if n > 0]
        self._entries.extend(added)
        heapq.heapify(self._entries)
        self.units += sum(n for _, n in added)

    def take(self, count: int) -> float:
        """Remove the ``count`` earliest units; return when the last of them is free (inf if too few exist)."""
        if count > self.units:
            return INF
        entries, latest = self._entries, 0.0
        self.units -= count
        while count > 0:
            time, n = entries[0]
            latest = time
            if n > count:
                heapq.heapreplace(entries, (time, n - count))
                return latest
            heapq.heappop(entries)
            count -= n
        return latest


def estimate(heap: CompletionHeap, waiting: Sequence[Waiting], depth: int) -> float:
    """Approximate total completion time (from submission, or expected arrival) of ``waiting`` in FCFS order at
    minimum units.

    The first waiting action tries its first ``depth`` allowed counts; the best outcome is returned.
    """
    if not waiting:
        return 0.0
    first, rest = waiting[0], waiting[1:]
    best = INF
    for count, duration in list(zip(first.counts, first.durations))[: max(1, depth)]:
        trial = heap.copy()
        start = trial.take(count)
        if start == INF:
            continue
        start = max(start, first.arrival_s)
        total = start + duration - first.arrival_s
        trial.put(start + duration, count)
        for action in rest:
            m = action.counts[0]
            begin = trial.take(m)
            if begin == INF:
                break
            begin = max(begin, action.arrival_s)
            finish = begin + action.durations[0]
            total += finish - action.arrival_s
            trial.put(finish, m)
        best = min(best, total)
    return best
