"""A sliding-window quota ("at most ``limit`` units in any ``period_s`` seconds"), e.g. 600 calls per minute.

Grants are kept as a deque of ``(timestamp, count)`` in time order: expiring pops from the left and a grant
appends (or merges into the newest entry), so every operation is O(1) amortised however busy the window is.
A grant made at ``t`` counts against the window during ``[t, t + period_s)``.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable


class QuotaWindow:
    __slots__ = ("_clock", "_grants", "_used", "limit", "period_s")

    def __init__(self, limit: int, period_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        if not period_s > 0:
            raise ValueError(f"period_s must be positive, got {period_s}")
        self.limit = limit
        self.period_s = period_s
        self._clock = clock
        self._grants: deque[tuple[float, int]] = deque()
        self._used = 0

    def _advance(self, now: float | None) -> float:
        """Drop grants that left the window; returns the time used for this call."""
        if now is None:
            now = self._clock()
        grants = self._grants
        while grants and grants[0][0] + self.period_s <= now:
            self._used -= grants.popleft()[1]
        return now

    def used(self, now: float | None = None) -> int:
        """Units granted within the window ending at ``now``."""
        self._advance(now)
        return self._used

    def available(self, now: float | None = None) -> int:
        """Units that could be granted at ``now``."""
        self._advance(now)
        return self.limit - self._used

    def take(self, n: int, now: float | None = None) -> None:
        """Grant ``n`` units at ``now``; refuses (ValueError, nothing taken) rather than exceed the quota."""
        now = self._advance(now)
        if n < 1:
            raise ValueError(f"must take at least 1 unit, got {n}")
        if n > self.limit - self._used:
            raise ValueError(f"quota exceeded: {n} wanted, {self.limit - self._used} of {self.limit} left")
        grants = self._grants
        if grants and grants[-1][0] >= now:
            # Same instant (or a caller's clock behind ours): merge so the deque stays short and in time order.
            ts, count = grants.pop()
            grants.append((ts, count + n))
        else:
            grants.append((now, n))
        self._used += n

    def seconds_until(self, n: int, now: float | None = None) -> float:
        """Seconds from ``now`` until ``n`` more units would be allowed: 0 if already, inf if never (n > limit)."""
        now = self._advance(now)
        if n > self.limit:
            return math.inf
        short = n - (self.limit - self._used)
        if short <= 0:
            return 0.0
        freed = 0
        for ts, count in self._grants:
            freed += count
            if freed >= short:
                return ts + self.period_s - now
        raise AssertionError("unreachable: the window holds all used units")
