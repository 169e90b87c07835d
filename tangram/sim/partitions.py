"""Brokers partitioned by task (issue 40): past what one broker's CPU serves, P brokers each schedule the tasks a
hash of their name gives them, each with its own FCFS queue and its own pass (Alg. 1) of the service's cycle.

Three designs, as policies:

- **static** (one broker per pool): each partition owns a fixed 1/P slice of every CPU node (its own managers),
  so partitions never meet, and cores one partition leaves idle are lost to the others.
- **shared** (one cluster, a shared view of free capacity): every partition's pass sees the cluster's managers, so
  the cores the others hold are taken and the free ones are anyone's. Conflicts resolve by passes in turn: at each
  instant the partitions pass one after another, each over what the ones before it left, as brokers that commit
  their placements to one shared store in turn would; the first to pass rotates from instant to instant so that no
  partition is always last. A partition resizes only its own malleable actions, so cores another partition's test
  runs grew into stay theirs until they end.
- **lending** (shared, and a shared view of running actions): as shared, but each pass also sees every partition's
  running actions, so it may shrink another's malleable test runs to start its own queue, as one broker would; the
  partition running the action carries the resize out (a resize request from one broker to another).

Alg. 1 keeps FCFS per resource within one queue; every design keeps it within a partition and gives up the order
between partitions (within an instant, the order is the turn's).
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace

from tangram.core.action import Action
from tangram.core.seam import ResourceManager
from tangram.sched.profile import SchedulerProfile
from tangram.sched.scheduler import Plan, Resize
from tangram.sim.broker_station import BrokerStation, build_managers
from tangram.sim.cluster import Cluster
from tangram.sim.engine import CallRun, Policy, Station
from tangram.sim.records import percentile
from tangram.sim.trace import KINDS, Trajectory


def partition_of(task: str, partitions: int) -> int:
    """The partition serving ``task``: a stable hash of its name (Python's ``hash`` of a str changes per process)."""
    return int.from_bytes(hashlib.blake2b(task.encode(), digest_size=8).digest(), "big") % partitions


class PartitionedBrokers:
    """One station of P broker partitions: routes each call to its task's partition; with ``shared`` capacity, an
    end in any partition wakes every partition (freed cores are everyone's news) and the partitions pass in
    turn."""

    def __init__(self, stations: Sequence[BrokerStation], shared: bool) -> None:
        if not stations:
            raise ValueError("give at least one partition")
        self.stations = list(stations)
        self.shared = shared
        self.turn = 0  # instants dispatched: who passes first
        self.seq = 0  # actions submitted to any partition

    def owner(self, trajectory: Trajectory) -> BrokerStation:
        return self.stations[partition_of(trajectory.task, len(self.stations))]

    def submit(self, run: CallRun, now: float) -> None:
        station = self.owner(run.trajectory)
        station.seq = self.seq  # one numbering over the partitions: action ids key the shared managers' books
        station.submit(run, now)
        self.seq = station.seq

    def collect(self, now: float) -> list[CallRun]:
        done = [run for station in self.stations for run in station.collect(now)]
        if done and self.shared:
            for station in self.stations:
                station.dirty = True
        return done

    def dispatch(self, now: float) -> None:
        first = self.turn % len(self.stations)
        self.turn += 1
        for station in self.stations[first:] + self.stations[:first]:
            station.dispatch(now)

    def next_event(self) -> float | None:
        return min((t for station in self.stations if (t := station.next_event()) is not None), default=None)

    def trajectory_done(self, trajectory: Trajectory, now: float) -> None:
        self.owner(trajectory).trajectory_done(trajectory, now)

    def stats(self) -> dict[str, object]:
        passes = [ms for station in self.stations for ms in station.pass_ms] or [0.0]
        return {"partitions": len(self.stations), "shared": self.shared,
                "passes": sum(len(station.pass_ms) for station in self.stations),
                "pass_ms_median": statistics.median(passes), "pass_ms_p99": percentile(passes, 0.99)}


def _cpu_only(cluster: Cluster) -> None:
    """Partitions are modelled on CPU nodes: a GPU manager's residency and disk tier are kept per station."""
    if cluster.gpu_node_sizes or cluster.apis:
        raise ValueError("broker partitions are simulated on CPU clusters only")


def static_partitions(profile: SchedulerProfile, partitions: int) -> Policy:
    """One broker per pool: each partition over ``cores_per_node // partitions`` cores (and as large a share of the
    memory) of every node."""
    def build(cluster: Cluster) -> Mapping[str, Station]:
        _cpu_only(cluster)
        share = replace(cluster, cores_per_node=cluster.cores_per_node // partitions,
                        node_memory_mb=cluster.node_memory_mb // partitions)
        station = PartitionedBrokers([BrokerStation(share, profile) for _ in range(partitions)], shared=False)
        return dict.fromkeys(KINDS, station)
    return build


class LendingPartition(BrokerStation):
    """A partition over shared capacity whose pass sees every partition's running actions, so that it may shrink
    another's malleable test runs to start its own queue and share idle cores with them, as one broker would; the
    partition running the action carries each resize out (a resize request from one broker to another)."""

    def __init__(self, cluster: Cluster, profile: SchedulerProfile, managers: Sequence[ResourceManager],
                 peers: Sequence[BrokerStation]) -> None:
        super().__init__(cluster, profile, managers=managers)
        self.peers = peers  # every partition, this one included

    def seen_running(self) -> list[Action]:
        return [action for peer in self.peers for action, _ in peer.running.values()]

    def _apply(self, plan: Plan, now: float) -> None:
        """Others' shrinks first (what they free is the plan's), its own plan, then others' grows; then every other
        partition shares its pools afresh at its next pass."""
        theirs = [r for r in plan.resizes if r.action.id not in self.running]
        shrinks = {id(r) for r in plan.shrinks()}
        for decision in (r for r in theirs if id(r) in shrinks):
            self._runner(decision)._resize(decision, now)
        super()._apply(Plan(plan.placements, [r for r in plan.resizes if r.action.id in self.running]), now)
        for decision in (r for r in theirs if id(r) not in shrinks):
            self._runner(decision)._resize(decision, now)
        if plan.resizes:  # the shares the others' passes last gave no longer stand
            for peer in self.peers:
                if peer is not self:
                    peer.cycle.scheduler.reshare()

    def _runner(self, decision: Resize) -> BrokerStation:
        return next(peer for peer in self.peers if decision.action.id in peer.running)


def shared_partitions(profile: SchedulerProfile, partitions: int, lend: bool = False) -> Policy:
    """P brokers over one cluster's managers, passing in turn; with ``lend``, each resizing the others' malleable
    actions too (``LendingPartition``)."""
    def build(cluster: Cluster) -> Mapping[str, Station]:
        _cpu_only(cluster)
        stations: list[BrokerStation] = []
        managers = build_managers(cluster, lambda: stations[0].now)  # every station's clock reads the same instant
        stations += [LendingPartition(cluster, profile, managers, stations) if lend
                     else BrokerStation(cluster, profile, managers=managers) for _ in range(partitions)]
        return dict.fromkeys(KINDS, PartitionedBrokers(stations, shared=True))
    return build
