"""The CPU manager's sandbox lifecycle metrics, by node: how sandboxes were made (a warm one claimed or a new one),
how long that took, which a restart adopted and which were lost and why. The sandboxes alive are read from the
environments at scrape time, not kept in step by hand."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from managers.cpu.environment import LossCause
from tangram.core.seam import MetricsRegistry

#: how an environment's sandbox came to be: a warm one claimed, or a new one made
WARM, NEW = "warm", "new"
CREATE_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _AliveCollector(Collector):
    def __init__(self, alive: Callable[[], Mapping[str, int]]) -> None:
        self.alive = alive

    def collect(self) -> Iterable[GaugeMetricFamily]:
        gauge = GaugeMetricFamily("tangram_sandboxes_alive", "Environments whose sandbox is ready now (not lost)",
                                  labels=["node"])
        for node, count in sorted(self.alive().items()):
            gauge.add_metric([node], count)
        yield gauge


class SandboxMetrics:
    """What the environments count as their sandboxes come and go (``managers/cpu/environments.py``)."""

    def __init__(self, alive: Callable[[], Mapping[str, int]]) -> None:
        """``alive()``: the ready sandboxes per node in service (0 for a node without any)."""
        self.created = Counter("tangram_sandboxes_created", "Sandboxes made for environments, by how: warm (a warm "
                               "sandbox claimed) or new", ["node", "how"], registry=None)
        self.create_seconds = Histogram("tangram_sandbox_create_seconds", "Time to make an environment's sandbox "
                                        "(a warm claim or a new one)", ["node"], buckets=CREATE_SECONDS,
                                        registry=None)
        self.adopted = Counter("tangram_sandboxes_adopted", "A previous run's sandboxes taken over at start",
                               ["node"], registry=None)
        self.lost = Counter("tangram_sandboxes_lost", "Environments marked lost, by cause: "
                            + ", ".join(cause.value for cause in LossCause), ["node", "reason"], registry=None)
        self._alive = _AliveCollector(alive)

    def made(self, node: str, warm: bool, seconds: float) -> None:
        """A sandbox was made for an environment on ``node`` in ``seconds``: a warm one claimed, or a new one."""
        self.created.labels(node, WARM if warm else NEW).inc()
        self.create_seconds.labels(node).observe(seconds)

    def node_in_service(self, node: str) -> None:
        """Export ``node``'s series at 0 from now on: a rate over a series that appears only with its first event
        misses that event, and a dashboard shows a gap instead of none."""
        for how in (WARM, NEW):
            self.created.labels(node, how)
        self.create_seconds.labels(node)
        self.adopted.labels(node)
        for cause in LossCause:
            self.lost.labels(node, cause.value)

    def register(self, registry: MetricsRegistry) -> None:
        for collector in (self.created, self.create_seconds, self.adopted, self.lost, self._alive):
            registry.register(collector)
