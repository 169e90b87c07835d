"""The no-traffic-control baseline (§6.1): every trajectory calls the upstream API itself.

The upstream enforces what it really allows, unseen by the callers: over its quota it answers 429 at once;
over its concurrency it drops the request and the caller waits for its timeout (600 s). A caller retries at most
three times after an error or a timeout, after a short back-off; a call whose attempts all fail is a failed call
(the trajectory goes on without the observation, so the paper counts it against the RL step's pass rate).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from managers.basic.quota import QuotaWindow
from tangram.sim.cluster import Cluster
from tangram.sim.engine import CallRun
from tangram.sim.trace import Trajectory

ATTEMPT, ANSWER, FAILURE = 0, 1, 2


@dataclass(eq=False, slots=True)
class _Upstream:
    window: QuotaWindow
    concurrency: int
    in_flight: int = 0


class DirectApiStation:
    def __init__(self, cluster: Cluster) -> None:
        self.costs = cluster.costs
        self.now = 0.0
        self.upstreams = {a.name: _Upstream(QuotaWindow(a.quota, a.period_s, lambda: self.now), a.concurrency)
                          for a in cluster.apis}
        self.events: list[tuple[float, int, int, CallRun]] = []  # (time, tie-break, what, call)
        self.counter = 0
        self.errors = 0
        self.timeouts = 0

    def _at(self, when: float, what: int, run: CallRun) -> None:
        self.counter += 1
        heapq.heappush(self.events, (when, self.counter, what, run))

    def submit(self, run: CallRun, now: float) -> None:
        if str(run.call.target) not in self.upstreams:
            raise ValueError(f"no upstream {run.call.target!r}")
        run.attempts = 0
        self._at(now, ATTEMPT, run)

    def _attempt(self, run: CallRun, now: float) -> None:
        upstream = self.upstreams[str(run.call.target)]
        run.attempts += 1
        run.start_s = now
        if upstream.in_flight >= upstream.concurrency:
            self.timeouts += 1
            self._at(now + self.costs.api_timeout_s, FAILURE, run)
        elif upstream.window.available(now) < 1:
            self.errors += 1
            self._at(now + self.costs.api_error_s, FAILURE, run)
        else:
            upstream.window.take(1, now)
            upstream.in_flight += 1
            self._at(now + run.call.work_s, ANSWER, run)

    def collect(self, now: float) -> list[CallRun]:
        self.now = now
        done = []
        while self.events and self.events[0][0] <= now:
            _, _, what, run = heapq.heappop(self.events)
            if what == ATTEMPT:
                self._attempt(run, now)
                continue
            run.finish_s = now
            run.exec_s = now - run.start_s
            run.pool = str(run.call.target)
            run.units = 1
            if what == ANSWER:
                self.upstreams[str(run.call.target)].in_flight -= 1
                done.append(run)
            elif run.attempts > self.costs.api_retries:
                run.failed = True
                done.append(run)
            else:
                self._at(now + self.costs.api_backoff_s, ATTEMPT, run)
        return done

    def dispatch(self, now: float) -> None:
        """Callers do not wait for anyone: attempts start in ``collect``, at their instant."""

    def next_event(self) -> float | None:
        return self.events[0][0] if self.events else None

    def trajectory_done(self, trajectory: Trajectory, now: float) -> None:
        """Nothing is held between calls."""

    def stats(self) -> dict[str, object]:
        return {"api_errors": self.errors, "api_timeouts": self.timeouts}
