"""Sliding-window quota arithmetic, on an injected clock and against a brute-force model."""

from __future__ import annotations

import math
import random

import pytest

from managers.basic.quota import QuotaWindow


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_units_come_back_exactly_one_period_after_their_grant() -> None:
    window = QuotaWindow(3, 10.0)
    window.take(2, now=0.0)
    window.take(1, now=4.0)
    assert window.available(now=4.0) == 0
    assert window.available(now=9.999) == 0
    assert window.available(now=10.0) == 2  # the grant at t=0 leaves the window at t=10, not before
    assert window.used(now=13.9) == 1
    assert window.available(now=14.0) == 3


def test_take_beyond_the_quota_refuses_and_takes_nothing() -> None:
    window = QuotaWindow(2, 1.0)
    window.take(1, now=0.0)
    with pytest.raises(ValueError, match="quota exceeded"):
        window.take(2, now=0.5)
    assert window.available(now=0.5) == 1
    with pytest.raises(ValueError):
        window.take(0, now=0.5)


def test_seconds_until_walks_to_the_grant_that_frees_enough() -> None:
    window = QuotaWindow(5, 60.0)
    window.take(2, now=0.0)
    window.take(1, now=10.0)
    window.take(2, now=20.0)
    assert window.seconds_until(1, now=30.0) == pytest.approx(30.0)  # t=0 grant frees 2 at t=60
    assert window.seconds_until(2, now=30.0) == pytest.approx(30.0)
    assert window.seconds_until(3, now=30.0) == pytest.approx(40.0)  # needs the t=10 grant too
    assert window.seconds_until(5, now=30.0) == pytest.approx(50.0)
    assert window.seconds_until(6, now=30.0) == math.inf
    assert window.seconds_until(2, now=65.0) == 0.0


def test_the_injected_clock_is_used_when_no_time_is_given() -> None:
    clock = Clock()
    window = QuotaWindow(1, 5.0, clock=clock)
    window.take(1)
    assert window.available() == 0
    assert window.seconds_until(1) == pytest.approx(5.0)
    clock.now = 5.0
    assert window.available() == 1


def test_grants_at_one_instant_share_one_entry() -> None:
    window = QuotaWindow(1000, 1.0)
    for _ in range(1000):
        window.take(1, now=7.0)
    assert len(window._grants) == 1  # O(1) memory for a burst
    assert window.available(now=7.5) == 0
    assert window.available(now=8.0) == 1000


@pytest.mark.parametrize("seed", range(5))
def test_matches_a_brute_force_window(seed: int) -> None:
    rng = random.Random(seed)
    limit, period = rng.randint(1, 8), rng.choice([0.5, 1.0, 3.0])
    window = QuotaWindow(limit, period)
    log: list[float] = []  # one timestamp per unit
    now = 0.0
    for _ in range(2000):
        now += rng.choice([0.0, 0.0, 0.01, 0.1, 0.37, 1.0])
        in_window = sum(1 for t in log if t + period > now)
        assert window.available(now) == limit - in_window
        n = rng.randint(1, limit)
        expected_wait = 0.0
        if n > limit - in_window:
            live = sorted(t for t in log if t + period > now)
            expected_wait = live[n - (limit - in_window) - 1] + period - now
        assert window.seconds_until(n, now) == pytest.approx(expected_wait)
        if n <= limit - in_window:
            window.take(n, now)
            log.extend([now] * n)


def test_rejects_nonsense_limits() -> None:
    with pytest.raises(ValueError):
        QuotaWindow(0, 1.0)
    with pytest.raises(ValueError):
        QuotaWindow(1, 0.0)
