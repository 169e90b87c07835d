"""The static GPU deployment baseline (§6.1): every reward model on its own GPUs for the whole run.

Each service has ``static_replicas`` servers of ``static_dop`` GPUs with tensor parallelism (SGLang in the
paper: nine teachers on four GPUs each; the DeepSearch judge on five replicas of eight). A server never restores:
its model never leaves the GPUs. It batches continuously (``StaticServing``): it holds up to ``batch`` calls, a
call joins the least loaded of its service's servers at once when one has room (first come first served while
all are full), and the calls in a batch share the server, each at ``1 / (1 + slowdown * (n - 1))`` of its solo
speed; a call's remaining work is re-timed whenever its batch grows or shrinks.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from tangram.sim.cluster import Cluster
from tangram.sim.engine import CallRun
from tangram.sim.trace import Trajectory


@dataclass(eq=False)
class _Server:
    name: str
    slowdown: float
    #: calls in its batch: admission number -> [run, solo seconds of work left, version of its finish event]
    batch: dict[int, list] = field(default_factory=dict)
    updated: float = 0.0

    def rate(self, n: int) -> float:
        return 1.0 / (1.0 + self.slowdown * (n - 1)) if n else 1.0

    def advance(self, now: float) -> None:
        """Charge the work done since the last change at the batch's current speed."""
        done = (now - self.updated) * self.rate(len(self.batch))
        for entry in self.batch.values():
            entry[1] -= done
        self.updated = now


class StaticGpuStation:
    def __init__(self, cluster: Cluster) -> None:
        self.dop = {s.name: s.static_dop for s in cluster.services}
        self.capacity = cluster.static.batch
        self.servers = {s.name: [_Server(f"{s.name}/{r}", cluster.static.slowdown(s)) for r in range(s.static_replicas)]
                        for s in cluster.services}
        self.waiting: dict[str, deque[CallRun]] = {s.name: deque() for s in cluster.services}
        self.finishing: list[tuple[float, int, int, _Server, int]] = []  # (at, order, admission, server, version)
        self.events = 0
        #: each admitted call's key: never reused, unlike ``id(run)`` once a finished run is freed (a stale finish
        #: event could then end another call, and results would hang on memory addresses)
        self.admitted = itertools.count()
        self.gpus = sum(s.static_replicas * s.static_dop for s in cluster.services)

    def submit(self, run: CallRun, now: float) -> None:
        service = str(run.call.target)
        if service not in self.waiting:
            raise ValueError(f"the static deployment has no service {service!r}")
        self.waiting[service].append(run)

    def collect(self, now: float) -> list[CallRun]:
        done = []
        while self.finishing and self.finishing[0][0] <= now:
            at, _, key, server, version = heapq.heappop(self.finishing)
            entry = server.batch.get(key)
            if entry is None or entry[2] != version:
                continue  # re-timed since
            server.advance(at)
            run = server.batch.pop(key)[0]
            run.finish_s = at
            run.exec_s = at - run.start_s
            done.append(run)
            self._retime(server, at)
        return done

    def dispatch(self, now: float) -> None:
        for service, waiting in self.waiting.items():
            servers = self.servers[service]
            while waiting:
                server = min(servers, key=lambda s: len(s.batch))
                if len(server.batch) >= self.capacity:
                    break
                run = waiting.popleft()
                run.pool = server.name
                run.units = self.dop[service]
                run.start_s = now
                server.advance(now)
                server.batch[next(self.admitted)] = [run, run.call.duration(run.units), 0]
                self._retime(server, now)

    def _retime(self, server: _Server, now: float) -> None:
        """New finish events for the batch's calls at its new speed (the old ones go stale)."""
        rate = server.rate(len(server.batch))
        for key, entry in server.batch.items():
            entry[2] += 1
            self.events += 1
            heapq.heappush(self.finishing, (now + max(0.0, entry[1]) / rate, self.events, key, server, entry[2]))

    def next_event(self) -> float | None:
        return self.finishing[0][0] if self.finishing else None

    def trajectory_done(self, trajectory: Trajectory, now: float) -> None:
        """Servers are deployed for the whole run: nothing to free."""

    def stats(self) -> dict[str, object]:
        return {"static_gpus": self.gpus}
