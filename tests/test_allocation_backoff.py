"""The allocation back-off (``tangram/sched/backoff.py``), the cycle's second queue filter: an action whose
allocation failed sits out the passes for a doubling delay, and is given up after its attempts."""

from __future__ import annotations

from tangram.sched.backoff import AllocationBackoff


def test_each_failure_doubles_the_delay_up_to_the_cap() -> None:
    backoff = AllocationBackoff(attempts=10, first_delay_s=0.1, max_delay_s=0.5)
    delays = [backoff.failed("a", now=0.0) for _ in range(5)]
    assert delays == [0.1, 0.2, 0.4, 0.5, 0.5]
    assert backoff.count("a") == 5


def test_an_action_waits_out_its_delay_and_others_are_not_held() -> None:
    backoff = AllocationBackoff(first_delay_s=1.0)
    assert not backoff
    backoff.failed("a", now=10.0)
    assert backoff
    assert backoff.waiting("a", now=10.5) and not backoff.waiting("a", now=11.0)
    assert not backoff.waiting("b", now=10.5)


def test_the_last_attempt_gives_up_and_forgets_the_action() -> None:
    backoff = AllocationBackoff(attempts=3)
    assert backoff.failed("a", now=0.0) is not None
    assert backoff.failed("a", now=1.0) is not None
    assert backoff.failed("a", now=2.0) is None  # the caller fails the action now
    assert backoff.count("a") == 0 and not backoff.waiting("a", now=2.0)


def test_a_start_forgets_the_failures() -> None:
    backoff = AllocationBackoff()
    backoff.failed("a", now=0.0)
    backoff.forget("a")
    assert backoff.count("a") == 0 and not backoff
