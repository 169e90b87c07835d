"""ACT approximation for the actions left in the queue (Appendix A, Algorithm 2).

The completion heap holds, per resource, when each unit becomes free (relative to now), grouped as
``(time, count)`` so a thousand idle cores are one entry. A waiting action at its minimum ``m`` units takes the
``m`` earliest units, starts when the last of them frees (or when it arrives, for an expected action not submitted
yet: ``tangram.sched.arrivals``), and gives them back at ``start + duration``. ``depth`` lets the first waiting action
try its first few allowed unit counts, as in the paper.

An estimate takes at most ``reach`` units and gives back as many as it took, so every unit it takes from its heap is
one of the heap's ``reach`` earliest: a heap cut to those (``SortedUnits.window``) gives the same estimate, bit for
bit. Greedy eviction estimates at every step, over a heap holding every member it plans, most of them out of reach.
Cut to those ``reach`` units, the heap is small enough to hold one free-time per unit (``UnitHeap``, ``reachable``)
where the waiting actions take a unit or two each: a one-unit action is then one step on a heap of floats instead of
one or two on (time, count) tuples, with the same completion times added in the same order.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, repeat
from operator import itemgetter

import numpy as np

INF = float("inf")
#: units an estimate may reach per waiting action for it to run on one heap entry per unit (``UnitHeap``)
UNITS_PER_WAITING = 2


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

    @classmethod
    def of_windows(cls, windows: Iterable[tuple[list[tuple[float, int]], int]]) -> CompletionHeap:
        """A heap of ``SortedUnits.window`` results (entries known to hold units, and how many)."""
        heap = cls.__new__(cls)
        heap._entries, heap.units = [], 0
        for entries, units in windows:
            heap._entries += entries
            heap.units += units
        heapq.heapify(heap._entries)
        return heap

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

    def run(self, rest: list[tuple[int, float, float]], total: float) -> float:
        """``total`` plus the completion times of ``rest`` (minimum units, duration there, arrival) run in order on
        these units; a one-unit action, the common case, swaps the earliest unit for its own end in one heap
        operation."""
        entries = self._entries
        for m, duration, arrival in rest:
            if m == 1 and self.units:
                time, n = entries[0]
                finish = max(time, arrival) + duration
                total += finish - arrival
                if n == 1:
                    heapq.heapreplace(entries, (finish, 1))
                else:
                    heapq.heapreplace(entries, (time, n - 1))
                    heapq.heappush(entries, (finish, 1))
                continue
            spent = _started(self, m, duration, arrival)
            if spent is None:
                break
            total += spent
        return total


class UnitHeap:
    """Unit free-times one per unit: a heap of floats, whose steps cost less than ``CompletionHeap``'s on (time,
    count) tuples where waiting actions take a unit or two each (``reachable`` builds it then)."""

    __slots__ = ("_times",)

    def __init__(self, times: list[float]) -> None:
        self._times = times

    @property
    def units(self) -> int:
        return len(self._times)

    def copy(self) -> UnitHeap:
        return UnitHeap(list(self._times))

    def put(self, time: float, count: int) -> None:
        for _ in range(count):
            heapq.heappush(self._times, time)

    def take(self, count: int) -> float:
        """Remove the ``count`` earliest units; return when the last of them is free (inf if too few exist)."""
        times, latest = self._times, 0.0
        if count > len(times):
            return INF
        for _ in range(count):
            latest = heapq.heappop(times)
        return latest

    def run(self, rest: list[tuple[int, float, float]], total: float) -> float:
        """``CompletionHeap.run`` on these units: the same completion times, added in the same order."""
        times = self._times
        for m, duration, arrival in rest:
            if m == 1 and times:
                time = times[0]
                finish = max(time, arrival) + duration
                total += finish - arrival
                heapq.heapreplace(times, finish)
                continue
            spent = _started(self, m, duration, arrival)
            if spent is None:
                break
            total += spent
        return total


class SortedUnits:
    """Unit free-times in ascending order with their running unit counts, to cut out a window of units."""

    __slots__ = ("_counts", "_ends", "_times")

    def __init__(self, entries: list[tuple[float, int]]) -> None:
        ordered = sorted(entries) if min(map(itemgetter(1), entries), default=1) > 0 else sorted(
            entry for entry in entries if entry[1] > 0)
        self._times = [time for time, _ in ordered]
        self._counts = [count for _, count in ordered]
        self._ends = list(accumulate(self._counts))

    @classmethod
    def of(cls, times: np.ndarray, units: Sequence[int]) -> SortedUnits:
        """The units of a plan, ``units[i]`` free at ``times[i]``: sorted by numpy, in the order ``sorted`` gives
        (by time, then units), as a plan holds a pool's every member."""
        counts = np.asarray(units, dtype=np.int64)
        if len(counts) and counts.min() <= 0:
            times, counts = times[counts > 0], counts[counts > 0]
        order = np.lexsort((counts, times))
        ordered = counts[order]
        sorted_units = cls.__new__(cls)
        sorted_units._times = times[order].tolist()
        sorted_units._counts = ordered.tolist()
        sorted_units._ends = np.cumsum(ordered).tolist()
        return sorted_units

    @property
    def units(self) -> int:
        return self._ends[-1] if self._ends else 0

    def window(self, skip: int, units: int) -> tuple[list[tuple[float, int]], int]:
        """Entries holding at least ``units`` units after the ``skip`` earliest (all after them if fewer), and how
        many they hold: what an estimate that ``reach``es ``units`` can take from a heap holding these after their
        ``skip`` earliest went."""
        ends = self._ends
        first = bisect_right(ends, skip)
        if units <= 0 or first == len(ends):
            return [], 0
        last = bisect_left(ends, skip + units, lo=first)
        if last == len(ends):
            last -= 1
        chosen = list(zip(self._times[first:last + 1], self._counts[first:last + 1]))
        if (ends[first - 1] if first else 0) < skip:  # the first entry is partly skipped
            chosen[0] = (chosen[0][0], ends[first] - skip)
        return chosen, ends[last] - skip

    def time_of(self, unit: int) -> float:
        """When the ``unit``-th earliest unit (from 1) is free; inf if it holds fewer."""
        at = bisect_left(self._ends, unit)
        return self._times[at] if at < len(self._times) else INF

    def unit_times(self, skip: int, units: int, latest: float = INF) -> list[float]:
        """The free times of the ``units`` earliest units after the ``skip`` earliest (all after them if fewer),
        one per unit, those free after ``latest`` left out: ``window``'s units, each on its own."""
        ends = self._ends
        first = bisect_right(ends, skip)
        if units <= 0 or first == len(ends):
            return []
        end = min(bisect_left(ends, skip + units, lo=first) + 1, bisect_right(self._times, latest, lo=first))
        before = ends[first - 1] if first else 0
        times = list(chain.from_iterable(map(repeat, self._times[first:end], self._counts[first:end])))
        return times[skip - before:skip - before + units]


def reach(waiting: Sequence[Waiting], depth: int) -> int:
    """The most units ``estimate(heap, waiting, depth)`` takes from ``heap``."""
    if not waiting:
        return 0
    return max(waiting[0].counts[: max(1, depth)]) + sum(action.counts[0] for action in waiting[1:])


def reachable(runs: Sequence[tuple[SortedUnits, int]], waiting: Sequence[Waiting], depth: int
              ) -> CompletionHeap | UnitHeap:
    """The heap an estimate of ``waiting`` runs on, from runs of sorted unit free-times each after its ``skip``
    earliest (``(run, skip)``), cut to the units it can reach: one entry per unit where the waiting actions take
    few units each (a heap of floats steps faster than one of (time, count) tuples), else the runs' windows."""
    need = reach(waiting, depth)
    if need > UNITS_PER_WAITING * len(waiting):
        return CompletionHeap.of_windows([run.window(skip, need) for run, skip in runs])
    # the need earliest of all are free by the time any one run's need earliest are: none later is cut out
    latest = min(run.time_of(skip + need) for run, skip in runs)
    times = sorted(chain.from_iterable(run.unit_times(skip, need, latest) for run, skip in runs))
    del times[need:]
    return UnitHeap(times)  # ascending, so a heap


def estimate(heap: CompletionHeap | UnitHeap, waiting: Sequence[Waiting], depth: int) -> float:
    """Approximate total completion time (from submission, or expected arrival) of ``waiting`` in FCFS order at
    minimum units.

    The first waiting action tries its first ``depth`` allowed counts; the best outcome is returned.
    """
    if not waiting:
        return 0.0
    first = waiting[0]
    rest = [(action.counts[0], action.durations[0], action.arrival_s) for action in waiting[1:]]
    best = INF
    for count, duration in list(zip(first.counts, first.durations))[: max(1, depth)]:
        trial = heap.copy()
        total = _started(trial, count, duration, first.arrival_s)
        if total is not None:
            best = min(best, trial.run(rest, total))
    return best


def _started(heap: CompletionHeap | UnitHeap, units: int, duration: float, arrival: float) -> float | None:
    """Run an action on the ``units`` earliest units of ``heap`` (not before it ``arrival``es) and give them back at
    its end: its completion time from its arrival, or None, taking nothing, if the heap holds fewer units."""
    begin = heap.take(units)
    if begin == INF:
        return None
    finish = max(begin, arrival) + duration
    heap.put(finish, units)
    return finish - arrival
