"""The caller's OpenTelemetry trace context, sent with each request as W3C ``traceparent`` so that the broker's
spans of its actions join the caller's trace (``tangram/tracing.py``); nothing when OpenTelemetry is not installed
beside the client (it is not one of its dependencies) or no span is current."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

INJECT: Callable[[dict[str, str]], Any] | None
try:
    from opentelemetry.propagate import inject as INJECT
except ImportError:  # the client's own dependencies do not include it
    INJECT = None


def trace_headers() -> dict[str, str] | None:
    """The current span's propagation headers, or None."""
    if INJECT is None:
        return None
    carrier: dict[str, str] = {}
    INJECT(carrier)
    return carrier or None
