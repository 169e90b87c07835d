"""Retrying: one exponential back-off and one ``Retry-After`` reader for every place that waits and tries again
(the client, the upstream proxy, the store's writer, the broker's allocations)."""

from __future__ import annotations

import math
import random
import time
from datetime import timezone
from email.utils import parsedate_to_datetime


def backoff_s(attempt: int, base_s: float, cap_s: float, jitter: bool = True) -> float:
    """The wait before retry ``attempt`` (0 for the first retry): ``base_s · 2^attempt`` up to ``cap_s``, and with
    ``jitter`` drawn from its upper half ("equal jitter"), so that callers that failed together spread out while
    every wait still grows."""
    ceiling = min(cap_s, base_s * 2.0 ** attempt)
    return random.uniform(ceiling / 2, ceiling) if jitter else ceiling


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks for (RFC 9110 10.2.3: delay-seconds or an HTTP-date, counted from
    ``now``, the Unix time); None when it is absent or unreadable. Callers cap it by what they can wait."""
    if value is None or not value.strip():
        return None
    try:
        seconds = float(value)  # delay-seconds (a fraction is not the RFC's, but its meaning is plain)
    except ValueError:
        pass
    else:
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    try:
        when = parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # "-0000": no zone given; an HTTP-date is GMT
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))
