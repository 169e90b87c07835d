"""Traces of actions (issue 39): one trajectory's exec, reward and lease, submitted by the client inside a span of
the caller's, come back from a live broker as spans of that trace, checked span by span through the OpenTelemetry
SDK's in-memory exporter. The reward runs on a stand-in service (no GPU here); the exec on local processes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from managers.gpu.config import GpuNodeConfig
from managers.gpu.manager import GpuManager
from reward_services.backend import ServiceBackend
from tangram.config import Config, parse_config
from tangram.core.errors import ConfigError
from tangram.server.request_guard import http_settings
from tangram.service import build_managers, running_broker
from tangram.tracing import ActionTracer, traceparent_of
from tangram_client import ActionError, AsyncTangramClient
from tests.docker_nodes import local_cpu
from tests.harness import live_broker
from tests.standin_services import IdleBackend

GPU = {"nodes": {"g": {"gpus": 1, "gpu_memory_mb": 100, "host_memory_mb": 1000, "device_type": "cpu"}},
       "services": {"judge": {"backend": "torch", "model": "m", "task": "similarity", "gpu_memory_mb": 100,
                              "host_memory_mb": 100}}}


def stand_in_gpu(config: Config) -> list[Any]:
    def idle(_: str, __: GpuNodeConfig, ___: Any) -> ServiceBackend:
        return IdleBackend()
    return [GpuManager(config.gpu, make_backend=idle) if isinstance(m, GpuManager) else m
            for m in build_managers(config)]


@pytest.fixture
async def traced(tmp_path: Any, run_dir: str) -> AsyncIterator[tuple[str, InMemorySpanExporter, TracerProvider]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config = parse_config({"store": {"url": f"sqlite+aiosqlite:///{tmp_path}/t.db"}, "cpu": local_cpu(run_dir),
                           "gpu": GPU})
    async with running_broker(config, stand_in_gpu(config), tracer=ActionTracer(provider)) as (_, app):
        server = TestServer(app, host="127.0.0.1")
        await server.start_server(**http_settings(config.server))
        try:
            yield str(server.make_url("")).rstrip("/"), exporter, provider
        finally:
            await server.close()
    provider.shutdown()


def children(spans: list[ReadableSpan], parent: ReadableSpan) -> dict[str, ReadableSpan]:
    assert parent.context is not None
    found = {span.name: span for span in spans if span.parent is not None
             and span.parent.span_id == parent.context.span_id}
    return found


def one(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    [span] = [span for span in spans if span.name == name]
    return span


@pytest.mark.slow  # a broker with a GPU manager starts in seconds
async def test_a_trajectorys_exec_reward_and_lease_are_spans_of_the_callers_trace(traced: Any) -> None:
    url, exporter, provider = traced
    caller = provider.get_tracer("a trainer")
    async with AsyncTangramClient(url, task="t") as client:
        with caller.start_as_current_span("rollout") as rollout:
            executed = await client.exec("echo hi > out; cat out", trajectory="traj-1")
            await client.run("reward", {"gpu": 1}, {"service": "judge", "input": {"pairs": [["a", "b"]]}})
            lease = await client.lease({"lease.local": 1}, ttl_s=60)
            await client.release_lease(lease.id)
            with pytest.raises(ActionError):
                await client.exec("sleep 5", trajectory="traj-1", run_timeout_s=0.2)
        untraced = await client.exec("true", trajectory="traj-2")  # no span current: a trace of its own
    spans = list(exporter.get_finished_spans())
    trace_id = rollout.get_span_context().trace_id
    mine = [span for span in spans if span.context is not None and span.context.trace_id == trace_id]

    [exec_ok, exec_timed_out] = sorted((s for s in mine if s.name == "exec action"), key=lambda s: s.start_time or 0)
    for action in (exec_ok, exec_timed_out, one(mine, "reward action"), one(mine, "lease action"),
                   one(mine, "lease held")):
        assert action.parent is not None and action.parent.span_id == rollout.get_span_context().span_id
    assert exec_ok.attributes is not None and exec_ok.attributes["tangram.action.id"] == executed.id
    assert exec_ok.attributes["tangram.trajectory"] == "traj-1" and exec_ok.status.status_code is StatusCode.UNSET
    phases = children(spans, exec_ok)
    assert set(phases) == {"queued", "running"}
    assert phases["running"].attributes is not None
    assert phases["running"].attributes["tangram.environment"] == executed.result["environment"]
    assert phases["running"].attributes["tangram.units.cpu"] == 1
    assert exec_ok.start_time == phases["queued"].start_time  # from submit,
    assert phases["queued"].end_time == phases["running"].start_time  # through its start,
    assert phases["running"].end_time == exec_ok.end_time  # to its end
    assert exec_timed_out.status.status_code is StatusCode.ERROR
    assert exec_timed_out.status.description == "timed_out"
    assert set(children(spans, one(mine, "reward action"))) >= {"queued", "running"}
    lease_attributes = one(mine, "lease held").attributes
    assert lease_attributes is not None and lease_attributes["tangram.lease.returned"] == "released"
    assert lease_attributes["tangram.action.id"] == lease.id

    [own] = [s for s in spans if s.name == "exec action" and s.attributes is not None
             and s.attributes["tangram.action.id"] == untraced.id]
    assert own.parent is None and own.context is not None and own.context.trace_id != trace_id


def test_only_a_valid_traceparent_is_taken() -> None:
    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert traceparent_of({"traceparent": good}) == good
    assert traceparent_of({"traceparent": f" {good} "}) == good
    for bad in ("", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", good.upper(),
                "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", good + "x" * 600):
        assert traceparent_of({"traceparent": bad}) is None, bad
    assert traceparent_of({}) is None


def test_the_tracing_section_names_an_otlp_endpoint_or_nothing() -> None:
    assert parse_config({}).tracing.otlp_endpoint is None
    assert parse_config({"tracing": {"otlp_endpoint": "http://127.0.0.1:4318/v1/traces"}}).tracing.otlp_endpoint
    with pytest.raises(ConfigError) as refused:
        parse_config({"tracing": {"endpoint": "http://127.0.0.1:4318"}})
    assert "endpoint" in str(refused.value)


async def test_the_configured_otlp_endpoint_receives_the_spans(tmp_path: Any, run_dir: str) -> None:
    """``[tracing] otlp_endpoint`` through the real exporter, to a collector of ours on loopback; the broker's close
    sends what is pending."""
    received: list[bytes] = []

    async def collect(request: web.Request) -> web.Response:
        received.append(await request.read())
        return web.Response(status=200)

    collector = web.Application()
    collector.router.add_post("/v1/traces", collect)
    server = TestServer(collector, host="127.0.0.1")
    await server.start_server()
    try:
        endpoint = str(server.make_url("/v1/traces"))
        async with live_broker({"cpu": local_cpu(run_dir), "tracing": {"otlp_endpoint": endpoint}},
                               str(tmp_path / "t.db")) as live, AsyncTangramClient(live.url, task="t") as client:
            record = await client.exec("true", trajectory="sent")
    finally:
        await server.close()
    names = {span.name: span for body in received for spans in _spans(body) for span in spans}
    assert {"exec action", "queued", "running"} <= set(names)
    attributes = {a.key: a.value.string_value for a in names["exec action"].attributes}
    assert attributes["tangram.action.id"] == record.id


def _spans(body: bytes) -> Iterator[list[Any]]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    for resource in request.resource_spans:
        for scope in resource.scope_spans:
            yield list(scope.spans)
