"""The per-action Prometheus series (submitted, finished, and the four time histograms), kept as plain counts and
turned into metric families only when scraped.

Why not prometheus_client's ``Counter`` and ``Histogram``: each ``inc`` or ``observe`` takes a lock and walks the
buckets, several times per action, which showed among the broker's larger costs per batched action. Everything here
runs on the broker's event loop, scrapes included (``/metrics`` renders in its handler), so plain integers need no
lock, and the cumulative buckets are summed once per scrape instead of once per action.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


@dataclass
class _Buckets:
    """One label set's observations: how many fell in each bucket (not cumulative; the last is +Inf) and their sum."""

    counts: list[int]
    total: float = 0.0


@dataclass
class HistogramSeries:
    """A histogram family by label values."""

    name: str
    documentation: str
    labels: Sequence[str]
    bounds: Sequence[float]
    series: dict[tuple[str, ...], _Buckets] = field(default_factory=dict)

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        buckets = self.series.get(labels)
        if buckets is None:
            buckets = self.series[labels] = _Buckets([0] * (len(self.bounds) + 1))
        buckets.counts[bisect_left(self.bounds, value)] += 1  # the first bound >= value: Prometheus's le
        buckets.total += value

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        for labels, buckets in self.series.items():
            cumulative, running = [], 0
            for bound, count in zip((*map(floatToGoString, self.bounds), "+Inf"), buckets.counts, strict=True):
                running += count
                cumulative.append((bound, running))
            family.add_metric(list(labels), cumulative, buckets.total)
        return family


@dataclass
class CounterSeries:
    """A counter family by label values."""

    name: str
    documentation: str
    labels: Sequence[str]
    series: dict[tuple[str, ...], int] = field(default_factory=dict)

    def inc(self, labels: tuple[str, ...]) -> None:
        self.series[labels] = self.series.get(labels, 0) + 1

    def family(self) -> CounterMetricFamily:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for labels, count in self.series.items():
            family.add_metric(list(labels), count)
        return family


class SeriesCollector(Collector):
    """Renders ``families`` at each scrape."""

    def __init__(self, families: Iterable[HistogramSeries | CounterSeries]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[HistogramMetricFamily | CounterMetricFamily]:
        return [series.family() for series in self.families]
