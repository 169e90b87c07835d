"""What the Basic manager's upstream APIs answered, and how often it asked again: the rate limits they enforce (429)
and their failures, seen from the broker."""

from __future__ import annotations

from prometheus_client import Counter

from tangram.core.seam import MetricsRegistry

#: the ``status`` of an attempt that got no answer (a connection error or a per-attempt timeout)
NO_ANSWER = "no_answer"


class UpstreamMetrics:
    """Every attempt's answer and every retry, by api (the resource name)."""

    def __init__(self) -> None:
        self.responses = Counter("tangram_upstream_responses", "Attempts at an upstream API, by the HTTP status it "
                                 f"answered ({NO_ANSWER}: a connection error or timeout)", ["api", "status"],
                                 registry=None)
        self.retries = Counter("tangram_upstream_retries", "Attempts at an upstream API after the first of an action "
                               "(after a 429, a 5xx or no answer)", ["api"], registry=None)

    def register(self, registry: MetricsRegistry) -> None:
        registry.register(self.responses)
        registry.register(self.retries)
