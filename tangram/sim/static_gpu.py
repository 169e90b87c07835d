"""The static GPU deployment baseline (§6.1): every reward model on its own GPUs for the whole run.

Each service has ``static_replicas`` servers of ``static_dop`` GPUs with tensor parallelism (SGLang in the
paper: nine teachers on four GPUs each; the DeepSearch judge on five replicas of eight). A server takes one call
at a time, first come first served across the service's replicas, like one reward action holding its chunk in
the broker, and never restores: its model never leaves the GPUs.
"""

from __future__ import annotations

import heapq
from collections import deque

from tangram.sim.cluster import Cluster
from tangram.sim.engine import CallRun
from tangram.sim.trace import Trajectory


class StaticGpuStation:
    def __init__(self, cluster: Cluster) -> None:
        self.dop = {s.name: s.static_dop for s in cluster.services}
        self.idle = {s.name: [f"{s.name}/{r}" for r in range(s.static_replicas)] for s in cluster.services}
        self.waiting: dict[str, deque[CallRun]] = {s.name: deque() for s in cluster.services}
        self.busy: list[tuple[float, int, CallRun]] = []
        self.started = 0
        self.gpus = sum(s.static_replicas * s.static_dop for s in cluster.services)

    def submit(self, run: CallRun, now: float) -> None:
        service = str(run.call.target)
        if service not in self.waiting:
            raise ValueError(f"the static deployment has no service {service!r}")
        self.waiting[service].append(run)

    def collect(self, now: float) -> list[CallRun]:
        done = []
        while self.busy and self.busy[0][0] <= now:
            _, _, run = heapq.heappop(self.busy)
            self.idle[str(run.call.target)].append(run.pool)
            done.append(run)
        return done

    def dispatch(self, now: float) -> None:
        for service, waiting in self.waiting.items():
            idle = self.idle[service]
            while waiting and idle:
                run = waiting.popleft()
                run.pool = idle.pop()
                run.units = self.dop[service]
                run.start_s = now
                run.exec_s = run.call.duration(run.units)
                run.finish_s = now + run.exec_s
                self.started += 1
                heapq.heappush(self.busy, (run.finish_s, self.started, run))

    def next_event(self) -> float | None:
        return self.busy[0][0] if self.busy else None

    def trajectory_done(self, trajectory: Trajectory, now: float) -> None:
        """Servers are deployed for the whole run: nothing to free."""

    def stats(self) -> dict[str, object]:
        return {"static_gpus": self.gpus}
