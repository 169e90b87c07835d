"""The discrete-event driver: trajectories think, make a call, wait for it, think again, on a virtual clock.

Calls go to *stations*: the broker (``broker_station.py``) or one of the baselines (``pods.py``,
``static_gpu.py``, ``direct_api.py``). A policy says which station serves which kind of call. At every instant
the driver first collects what finished, lets the trajectories whose generation is over submit their next
call, then lets every station dispatch, so one instant costs one scheduling pass, as in the broker.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from tangram.sim.cluster import Cluster
from tangram.sim.records import CallRecord, RunResult
from tangram.sim.trace import Call, Trace, Trajectory


@dataclass(slots=True, eq=False)
class CallRun:
    """One call in flight: what the trajectory asked and what the station reports back."""

    trajectory: Trajectory
    slot: int  # the trajectory's position in the trace
    index: int  # the call's position in the trajectory
    call: Call
    submit_s: float
    start_s: float = 0.0
    finish_s: float = 0.0
    exec_s: float = 0.0
    overhead_s: float = 0.0
    units: int = 0
    pool: str = ""
    attempts: int = 1
    failed: bool = False
    unit_s: float = 0.0
    resizes: int = 0
    history: tuple[tuple[float, int], ...] = ()

    def record(self) -> CallRecord:
        return CallRecord(self.trajectory.id, self.index, self.call.kind, self.call.target, self.submit_s,
                          self.start_s, self.finish_s, self.exec_s, self.overhead_s, self.units, self.pool,
                          self.attempts, self.failed, self.unit_s, self.resizes,
                          self.history)


class Station(Protocol):
    def submit(self, run: CallRun, now: float) -> None:
        """Accept a call at ``now``."""

    def collect(self, now: float) -> list[CallRun]:
        """Calls that finished at or before ``now`` (their ``finish_s`` set), resources given back."""

    def dispatch(self, now: float) -> None:
        """Start what can start at ``now``."""

    def next_event(self) -> float | None:
        """The next instant something happens inside the station by itself; None if nothing will."""

    def trajectory_done(self, trajectory: Trajectory, now: float) -> None:
        """The trajectory made its last call: free what it held for its life."""

    def stats(self) -> dict[str, object]:
        """Figures of its own (scheduling passes, restores, ...)."""


#: builds the stations of one run, and says which serves each call kind
Policy = Callable[[Cluster], Mapping[str, Station]]
#: trajectories that start because one ended (the next step of a task once its step's last trajectory is done)
Follow = Callable[[Trajectory, float], Sequence[Trajectory]]


class Stalled(RuntimeError):
    """Calls are waiting but no station will ever start them (a call larger than any pool, say)."""


def simulate(trace: Trace, cluster: Cluster, policy: Policy, name: str, follow: Follow | None = None) -> RunResult:
    """Run every trajectory of ``trace`` to its end, and those ``follow`` starts as others end; returns every
    call's record."""
    routes = policy(cluster)
    stations = list({id(s): s for s in routes.values()}.values())
    trajectories: list[Trajectory] = []
    wakeups: list[tuple[float, int, int]] = []  # (time, trajectory index, call index)

    def start(trajectory: Trajectory) -> None:
        trajectories.append(trajectory)
        if trajectory.calls:
            heapq.heappush(wakeups, (trajectory.start_s + trajectory.calls[0].think_s, len(trajectories) - 1, 0))

    for trajectory in trace.trajectories:
        start(trajectory)
    records: list[CallRecord] = []
    in_flight = 0
    instants = 0
    started = time.perf_counter()
    while wakeups or in_flight:
        times = [t for s in stations if (t := s.next_event()) is not None]
        if wakeups:
            times.append(wakeups[0][0])
        if not times:
            raise Stalled(f"{in_flight} call(s) wait and nothing will ever start them")
        now = min(times)
        instants += 1
        for station in stations:
            for run in station.collect(now):
                in_flight -= 1
                records.append(run.record())
                trajectory = run.trajectory
                following = run.index + 1
                if following < len(trajectory.calls):
                    heapq.heappush(wakeups, (now + trajectory.calls[following].think_s, run.slot, following))
                else:
                    for done in stations:
                        done.trajectory_done(trajectory, now)
                    for following_trajectory in follow(trajectory, now) if follow else ():
                        start(following_trajectory)
        while wakeups and wakeups[0][0] <= now:
            _, i, index = heapq.heappop(wakeups)
            trajectory = trajectories[i]
            call = trajectory.calls[index]
            route = routes.get(call.kind)
            if route is None:
                raise ValueError(f"policy {name!r} has no station for {call.kind} calls")
            route.submit(CallRun(trajectory, i, index, call, now), now)
            in_flight += 1
        for station in stations:
            station.dispatch(now)
    stats: dict[str, object] = {"instants": instants, "wall_s": time.perf_counter() - started}
    for station in stations:
        stats.update(station.stats())
    return RunResult(name, records, stats)
