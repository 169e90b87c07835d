"""Allocations that fail: back off, then give up with a clear error.

A placement the scheduler made can still fail to allocate (a manager refuses what its fit accepted: a bug, or a
resource that changed between the pass and the start). Retrying at once fails the same way at every pass and, with
nothing else happening, never retries at all; so each failure keeps the action out of the passes for a doubling
delay, and after ``ATTEMPTS`` failures the action ends ``failed`` with code ``allocation_failed`` and the last
error, instead of waiting forever behind a log line.
"""

from __future__ import annotations

from dataclasses import dataclass

from tangram_client.retry import backoff_s

#: failed allocations of one action before it is failed
ATTEMPTS = 5
#: the first retry's delay, doubled after each failure up to ``MAX_DELAY_S`` (0.1 + 0.2 + 0.4 + 0.8 s in all)
FIRST_DELAY_S = 0.1
MAX_DELAY_S = 5.0


@dataclass(slots=True)
class _Failures:
    count: int
    retry_at: float


class AllocationBackoff:
    """Per queued action: how often its allocation failed and when it may be placed again."""

    def __init__(self, attempts: int = ATTEMPTS, first_delay_s: float = FIRST_DELAY_S,
                 max_delay_s: float = MAX_DELAY_S) -> None:
        self.attempts = attempts
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self._failures: dict[str, _Failures] = {}

    def __bool__(self) -> bool:
        return bool(self._failures)

    def waiting(self, action_id: str, now: float) -> bool:
        """Whether the action is still in its delay: the scheduler must not place it yet."""
        failures = self._failures.get(action_id)
        return failures is not None and now < failures.retry_at

    def failed(self, action_id: str, now: float) -> float | None:
        """Count one failure: the delay before the next try, or None when the attempts are spent (the action is
        forgotten here and must be failed)."""
        failures = self._failures.get(action_id)
        count = 1 if failures is None else failures.count + 1
        if count >= self.attempts:
            self._failures.pop(action_id, None)
            return None
        delay = backoff_s(count - 1, self.first_delay_s, self.max_delay_s, jitter=False)
        self._failures[action_id] = _Failures(count, now + delay)
        return delay

    def count(self, action_id: str) -> int:
        failures = self._failures.get(action_id)
        return 0 if failures is None else failures.count

    def forget(self, action_id: str) -> None:
        """The action started, or left the queue otherwise."""
        self._failures.pop(action_id, None)
