"""Traces of actions (OpenTelemetry; the optional extra ``otel``, issue 39).

A client sends W3C ``traceparent`` with its request (``tangram_client`` does when OpenTelemetry is installed beside it
and a span is current); each action it submitted becomes a span of that trace, with a child per phase: ``queued``
(from submit until the scheduling pass started it), ``running`` (its execution: the command, the reward call, the
upstream call; a GPU restore inside it as ``restore``), and for a lease, ``lease held`` from its grant until it is
given back. Why spans are made when an action ends, from its timestamps, rather than opened and closed as it goes:
nothing is held per queued action, a queued action costs no tracing work, and the hot path pays one call per action
only where tracing is on. What is lost: an action that outlives the broker (recovered by the next one) is traced by
that one without the client's parent, since ``traceparent`` is not stored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tangram.core.action import Action, State
from tangram.core.config_tables import TABLE

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

#: W3C trace context, version 00 and the future versions' prefix: version, trace id, parent id, flags (lower-case hex)
TRACEPARENT = re.compile(r"^(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}(-.*)?\Z")
#: the instrumentation scope of the broker's spans
SCOPE = "tangram"


def traceparent_of(headers: Mapping[str, str]) -> str | None:
    """The request's ``traceparent`` if it is valid; an invalid one is ignored, as the W3C recommendation says."""
    value = headers.get("traceparent")
    if value is None or len(value) > 512:
        return None
    value = value.strip()
    return value if TRACEPARENT.match(value) else None


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


@dataclass(frozen=True)
class TracingConfig:
    """``[tracing]``: where the broker sends its spans (OTLP over HTTP); none: no tracing."""

    __pydantic_config__ = TABLE

    #: e.g. "http://127.0.0.1:4318/v1/traces" (an OpenTelemetry Collector)
    otlp_endpoint: str | None = None
    #: the ``service.name`` resource attribute
    service_name: str = "tangram"


class ActionTracer:
    """Makes each ended action's spans (``Broker`` calls ``ended`` and ``lease_returned``)."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        self._in = trace.set_span_in_context
        self._error = lambda code: Status(StatusCode.ERROR, code)
        self.provider = provider
        self._tracer: Tracer = provider.get_tracer(SCOPE)
        self._propagator = TraceContextTextMapPropagator()

    def _parent(self, action: Action) -> Context | None:
        return None if action.traceparent is None else self._propagator.extract({"traceparent": action.traceparent})

    def ended(self, action: Action) -> None:
        """The action's span and its phases', from its timestamps."""
        finished = action.finished_at if action.finished_at is not None else action.submitted_at
        span = self._tracer.start_span(f"{action.kind.value} action", context=self._parent(action),
                                       start_time=_ns(action.submitted_at), attributes=_attributes(action))
        if action.state is not State.SUCCEEDED:
            code = (action.error or {}).get("code", action.state.value)
            span.set_status(self._error(str(code)))
        inside = self._in(span)
        started = action.started_at if action.started_at is not None else finished
        self._phase("queued", inside, action.submitted_at, started)
        if action.started_at is not None:
            running = self._tracer.start_span("running", context=inside, start_time=_ns(started),
                                              attributes=_placement(action))
            if action.restore_s:
                self._phase("restore", self._in(running), started, started + action.restore_s)
            running.end(end_time=_ns(finished))
        span.end(end_time=_ns(finished))

    def lease_returned(self, action: Action, returned_at: float, how: str) -> None:
        """A granted lease's hold, from its grant until it came back (``how``: released, expired...)."""
        granted = action.finished_at if action.finished_at is not None else returned_at
        span = self._tracer.start_span("lease held", context=self._parent(action), start_time=_ns(granted),
                                       attributes={**_attributes(action), "tangram.lease.returned": how})
        span.end(end_time=_ns(returned_at))

    def _phase(self, name: str, parent: Context, start: float, end: float) -> None:
        self._tracer.start_span(name, context=parent, start_time=_ns(start)).end(end_time=_ns(end))

    def close(self) -> None:
        """Send what is pending."""
        self.provider.shutdown()


def _attributes(action: Action) -> dict[str, Any]:
    attributes: dict[str, Any] = {"tangram.action.id": action.id, "tangram.action.kind": action.kind.value,
                                  "tangram.task": action.task, "tangram.action.state": action.state.value}
    if action.trajectory is not None:
        attributes["tangram.trajectory"] = action.trajectory
    if action.error is not None and "code" in action.error:
        attributes["tangram.error.code"] = str(action.error["code"])
    return attributes


def _placement(action: Action) -> dict[str, Any]:
    """Where it ran: its units per resource, and the node and environment an exec reports."""
    attributes: dict[str, Any] = {f"tangram.units.{resource}": count for resource, count in action.units.items()}
    result = action.result if isinstance(action.result, dict) else {}
    for key in ("node", "environment"):
        if isinstance(result.get(key), str):
            attributes[f"tangram.{key}"] = result[key]
    return attributes


def tracer_from_config(config: TracingConfig) -> ActionTracer | None:
    """The OTLP exporter ``config`` asks for, batched off the event loop (the SDK's thread); None when it asks for
    none. Raises ``ImportError`` naming the extra when OpenTelemetry is not installed."""
    if config.otlp_endpoint is None:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as error:
        raise ImportError(f"[tracing] otlp_endpoint needs OpenTelemetry: pip install 'arl-tangram[otel]' ({error})") \
            from None
    provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.otlp_endpoint)))
    return ActionTracer(provider)
