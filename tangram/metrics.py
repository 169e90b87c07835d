"""Prometheus metrics. Gauges that mirror broker state are read at scrape time, not kept in step by hand."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tangram.action_series import CounterSeries, HistogramSeries, SeriesCollector
from tangram.core.action import Action
from tangram.core.fencing import current
from tangram.version import VERSION

SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
PASS_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


class _StateCollector(Collector):
    def __init__(self, queue_depth: Callable[[], dict[str, int]],
                 units: Callable[[], Iterable[tuple[str, str, int, int]]]) -> None:
        self.queue_depth = queue_depth
        self.units = units

    def collect(self) -> Iterable[GaugeMetricFamily]:
        in_use = GaugeMetricFamily("tangram_units_in_use", "Units held by running actions and leases",
                                   labels=["resource", "pool"])
        capacity = GaugeMetricFamily("tangram_units_capacity", "Units a pool has", labels=["resource", "pool"])
        resources: set[str] = set()
        for resource, pool, cap, used in self.units():
            in_use.add_metric([resource, pool], used)
            capacity.add_metric([resource, pool], cap)
            resources.add(resource)
        queued = GaugeMetricFamily("tangram_queue_length", "Queued actions demanding each resource",
                                   labels=["resource"])
        depth = self.queue_depth()
        for resource in sorted(resources | set(depth)):  # 0 for an idle resource: a series, not a gap
            queued.add_metric([resource], depth.get(resource, 0))
        yield queued
        yield in_use
        yield capacity


class SloFigures(NamedTuple):
    """One planned task's SLO figures (``tangram/slo/admission.py``)."""

    task: str
    slo: float
    predicted_slowdown: float  # inf: the pool cannot bound its phase
    reserved_gpus: int  # the GPUs its actions are put ahead on (0: none)
    windows: int
    within: int
    last_slowdown: float | None


class SloCollector(Collector):
    """The planned tasks' SLO figures, read at each scrape (SLO admission registers it)."""

    def __init__(self, figures: Callable[[], Iterable[SloFigures]]) -> None:
        self.figures = figures

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        windows = CounterMetricFamily("tangram_task_slo_windows", "Reward phases of a planned task that ended, by "
                                      "whether its step stayed within its SLO", labels=["task", "within"])
        slo = GaugeMetricFamily("tangram_task_slo", "The step slowdown a planned task tolerates against a dedicated "
                                "deployment", labels=["task"])
        predicted = GaugeMetricFamily("tangram_task_slo_predicted_slowdown", "A planned task's step slowdown planned "
                                      "on worst-case durations with every planned task in the pool", labels=["task"])
        reserved = GaugeMetricFamily("tangram_task_slo_reserved_gpus", "GPUs reserved for a planned task: its actions "
                                     "go first while it holds fewer", labels=["task"])
        attainment = GaugeMetricFamily("tangram_task_slo_attainment", "Fraction of a planned task's windows within "
                                       "its SLO", labels=["task"])
        observed = GaugeMetricFamily("tangram_task_slo_observed_slowdown", "A planned task's step slowdown in its "
                                     "last window", labels=["task"])
        for row in self.figures():
            windows.add_metric([row.task, "true"], row.within)
            windows.add_metric([row.task, "false"], row.windows - row.within)
            slo.add_metric([row.task], row.slo)
            predicted.add_metric([row.task], row.predicted_slowdown)
            reserved.add_metric([row.task], row.reserved_gpus)
            if row.windows:
                attainment.add_metric([row.task], row.within / row.windows)
            if row.last_slowdown is not None:
                observed.add_metric([row.task], row.last_slowdown)
        yield from (windows, slo, predicted, reserved, attainment, observed)


def leader_gauge(registry: CollectorRegistry, leading: Callable[[], bool]) -> None:
    """``tangram_leader`` in ``registry``, read from ``leading()`` at each scrape: a leading broker's, or a standby's
    (``tangram/server/standby.py``), so one query finds the leader among the brokers of a store."""
    Gauge("tangram_leader", "1 while this broker leads (a broker without leader election always does), 0 while it "
          "stands by or once it was deposed", registry=registry).set_function(lambda: float(leading()))


class Metrics:
    """One registry per broker, so several brokers (tests) never share counters."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ("kind", "task")
        self.act = HistogramSeries("tangram_action_completion_seconds", "ACT: submission to terminal state",
                                   labels, SECONDS)
        self.queue = HistogramSeries("tangram_action_queue_seconds", "Time waiting in the unified queue", labels,
                                     SECONDS)
        self.execution = HistogramSeries("tangram_action_execution_seconds", "Time inside the manager's execute",
                                         labels, SECONDS)
        self.overhead = HistogramSeries("tangram_action_overhead_seconds", "ACT minus queue and execution time",
                                        labels, SECONDS)
        self.finished = CounterSeries("tangram_actions_finished", "Actions reaching a terminal state, by the error's "
                                      "code (empty when none: out_of_memory, timed_out, environment_lost, ... tell "
                                      "them apart)", ("kind", "task", "state", "error"))
        self.submitted = CounterSeries("tangram_actions_submitted", "Actions accepted into the queue", labels)
        self._timed = ((self.act, "act_s"), (self.queue, "queue_s"), (self.execution, "execution_s"),
                       (self.overhead, "overhead_s"))
        self.registry.register(SeriesCollector((self.act, self.queue, self.execution, self.overhead, self.finished,
                                                self.submitted)))
        self.schedule_pass = Histogram("tangram_schedule_pass_seconds", "Wall time of one scheduling pass",
                                       buckets=PASS_SECONDS, registry=self.registry)
        self.resizes = Counter("tangram_resizes", "Running malleable actions whose units a pass changed",
                               registry=self.registry)
        Gauge("tangram_build_info", "The broker's version (always 1)", ["version"],
              registry=self.registry).labels(VERSION).set(1)
        leader_gauge(self.registry, lambda: current().deposed_by is None)
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        for collector in (PLATFORM_COLLECTOR, GC_COLLECTOR):  # python_info, python_gc_*: read at scrape time
            self.registry.register(collector)

    def count_submit(self, action: Action) -> None:
        self.submitted.inc((action.kind, action.task))  # a StrEnum member is its string as a label

    def watch(self, queue_depth: Callable[[], dict[str, int]],
              units: Callable[[], Iterable[tuple[str, str, int, int]]]) -> None:
        self.registry.register(_StateCollector(queue_depth, units))

    def record_finish(self, action: Action) -> None:
        labels = (action.kind, action.task)
        self.finished.inc((*labels, action.state, (action.error or {}).get("code") or ""))
        timings = action.timings()
        for histogram, name in self._timed:
            value = timings[name]
            if value is not None:
                histogram.observe(labels, value)
