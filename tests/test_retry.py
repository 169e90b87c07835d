"""The one back-off and the one Retry-After reader (clients/tangram_client/retry.py)."""

from __future__ import annotations

from email.utils import formatdate

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tangram_client.retry import backoff_s, retry_after_s


@given(st.integers(0, 40), st.floats(0.001, 10.0), st.floats(0.01, 100.0))
def test_backoff_grows_by_doubling_within_its_cap(attempt: int, base: float, cap: float) -> None:
    ceiling = min(cap, base * 2.0 ** attempt)
    assert backoff_s(attempt, base, cap, jitter=False) == ceiling
    assert ceiling / 2 <= backoff_s(attempt, base, cap) <= ceiling  # equal jitter: never below half


def test_backoff_without_jitter_is_the_doubling_sequence() -> None:
    assert [backoff_s(a, 0.1, 1.0, jitter=False) for a in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])


@pytest.mark.parametrize(("header", "seconds"), [
    ("5", 5.0), (" 7 ", 7.0), ("0", 0.0), ("1.5", 1.5), (None, None), ("", None), ("soon", None), ("-3", None),
    ("nan", None), ("inf", None)])
def test_retry_after_reads_delay_seconds(header: str | None, seconds: float | None) -> None:
    assert retry_after_s(header) == seconds


def test_retry_after_reads_an_http_date_against_now() -> None:
    now = 1_800_000_000.0
    assert retry_after_s(formatdate(now + 30, usegmt=True), now=now) == pytest.approx(30.0)
    assert retry_after_s(formatdate(now - 30, usegmt=True), now=now) == 0.0  # a date passed: retry at once
    assert retry_after_s("Thu, 15 Jan 2027 08:00:00 -0000", now=now) is not None  # no zone given: GMT
