"""A bounded time series of the broker's state for the status page: one sample every ``interval_s``.

Each sample holds utilization and queue depth per resource, the running and lease counts, and the ACT
percentiles of the actions that finished *during that interval*, so a chart of them is a time series and not the
same recent window drawn again and again. ``sample(now)`` takes one sample; the periodic task only calls it, so
tests drive the sampler without sleeping.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from tangram.broker import Broker
from tangram.server.broker_views import resource_rows

log = logging.getLogger("tangram.server.history")

PERCENTILES = (("act_p50_s", 0.5), ("act_p90_s", 0.9), ("act_p99_s", 0.99))


@dataclass(frozen=True, slots=True)
class Sample:
    t: float                        # seconds since the epoch; the interval covered is (previous t, t]
    utilization: dict[str, float]   # resource -> units in use / capacity, both summed over its pools (0..1)
    queued: dict[str, int]          # resource -> queued actions demanding it
    queued_total: int               # queued actions (one demanding two resources counts once)
    running: int
    leases: int
    finished: int                   # actions that reached a terminal state during the interval
    act_s: dict[str, float | None]  # ACT percentiles of those actions (of the latest 1000 if more); None if none

    def to_json(self) -> dict[str, Any]:
        return {"t": self.t, "utilization": self.utilization, "queued": self.queued,
                "queued_total": self.queued_total, "running": self.running, "leases": self.leases,
                "finished": self.finished, **self.act_s}


def utilization_by_resource(rows: list[dict[str, Any]]) -> dict[str, float]:
    """In use over capacity per resource, each summed over the resource's pools (rows of ``Broker.resources``)."""
    in_use: dict[str, int] = collections.defaultdict(int)
    capacity: dict[str, int] = collections.defaultdict(int)
    for row in rows:
        in_use[row["resource"]] += row["in_use"]
        capacity[row["resource"]] += row["capacity"]
    return {resource: in_use[resource] / capacity[resource] if capacity[resource] else 0.0
            for resource in sorted(capacity)}


def act_percentiles(acts: list[float]) -> dict[str, float | None]:
    """Nearest-rank percentiles, the rule ``Broker.stats`` uses, so the page and ``tangram status`` agree."""
    ordered = sorted(acts)
    return {name: ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None
            for name, q in PERCENTILES}


class History:
    """The last ``keep_s`` seconds of samples of one broker, oldest first."""

    def __init__(self, broker: Broker, *, interval_s: float = 2.0, keep_s: float = 900.0) -> None:
        if not (math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"interval_s must be a positive number of seconds, got {interval_s!r}")
        if not (math.isfinite(keep_s) and keep_s >= interval_s):
            raise ValueError(f"keep_s must be at least interval_s ({interval_s} s), got {keep_s!r}")
        self.broker = broker
        self.interval_s = interval_s
        self.keep_s = keep_s
        self.samples: collections.deque[Sample] = collections.deque(maxlen=math.ceil(keep_s / interval_s))
        self._opened = time.time()  # the first sample covers the time since then
        self._finished_before = self._finished_total()

    def sample(self, now: float | None = None) -> Sample:
        """Record the broker's state at ``now`` (default: the current time) and return the new sample."""
        now = time.time() if now is None else now
        since = self.samples[-1].t if self.samples else self._opened
        broker = self.broker
        depth = broker.queue.depth_by_resource()
        utilization = utilization_by_resource(resource_rows(broker))
        finished_total = self._finished_total()
        taken = Sample(t=now, utilization=utilization, queued={r: depth.get(r, 0) for r in utilization},
                       queued_total=len(broker.queue), running=len(broker.running), leases=len(broker.leases),
                       finished=finished_total - self._finished_before,
                       act_s=act_percentiles(self._acts_between(since, now)))
        self._finished_before = finished_total
        self.samples.append(taken)
        return taken

    def _finished_total(self) -> int:
        """Actions finished since the broker started, from its ``tangram_actions_finished`` counter (exact)."""
        return sum(self.broker.metrics.finished.series.values())

    def _acts_between(self, since: float, until: float) -> list[float]:
        """ACTs of the actions that finished in (since, until]. ``broker.recent`` is in finishing order, so the
        walk from its newest end stops at the first older one; it holds only the latest 1000 actions."""
        acts: list[float] = []
        for action in reversed(self.broker.recent):
            finished_at = action.finished_at
            if finished_at is None or finished_at > until:
                continue
            if finished_at <= since:
                break
            acts.append(finished_at - action.submitted_at)  # ACT, as in Action.timings
        return acts

    def since(self, t: float) -> list[Sample]:
        """Samples taken after ``t``, oldest first."""
        newer: list[Sample] = []
        for taken in reversed(self.samples):
            if taken.t <= t:
                break
            newer.append(taken)
        newer.reverse()
        return newer

    async def run(self) -> None:
        """Sample every ``interval_s`` on the loop's clock (no drift from the time a sample takes) until cancelled."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            due = max(due + self.interval_s, loop.time())  # after a stall, go on from now rather than catch up
            await asyncio.sleep(due - loop.time())
            try:
                self.sample()
            except Exception:  # a bad sample must not end the series; the next interval tries again
                log.exception("status sample failed")
