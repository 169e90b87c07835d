"""The Kubernetes-like baseline (§6.1): a pod per trajectory, for its whole life, sharing its node's cores.

Each trajectory's first call asks the control plane for a pod requesting 0.5 CPU and the trajectory's memory,
limited to 4 CPUs. The control plane binds pods one at a time at a fixed rate, to the node with the most
unrequested CPU that fits the request (pods that fit nowhere wait for a pod to end); a bound pod runs after a
start-up delay and is deleted when its trajectory ends. Inside a node, CPU is shared like CFS with equal shares:
running calls get equal parts of the cores, none more than it can use (1 core for a tool call, the pod's limit
for a test run, which runs ``pytest -n 4`` and first spends the CPU of starting its four workers), and a call
progresses at its speed-up on that many cores.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from tangram.sim.cluster import Cluster, startup_cpu_s
from tangram.sim.engine import CallRun
from tangram.sim.trace import Trajectory

EPSILON_S = 1e-9


@dataclass(eq=False, slots=True)
class _Job:
    run: CallRun
    cap: float  # cores it can use
    remaining: float  # work left, in seconds on one core
    startup: float = 0.0  # CPU seconds of test-runner start-up left, done before the work at ``cores`` CPUs
    cores: float = 0.0
    rate: float = 0.0

    def phase_end(self) -> float:
        """Seconds until its start-up or its work ends at the current share."""
        if self.startup > EPSILON_S:
            return self.startup / self.cores
        return max(0.0, self.remaining) / self.rate


@dataclass(eq=False)
class _Node:
    name: str
    cores: int
    memory_mb: int
    requested_cpu: float = 0.0
    requested_mb: int = 0
    jobs: list[_Job] = field(default_factory=list)
    updated: float = 0.0
    next_finish: float | None = None

    def advance(self, now: float) -> None:
        elapsed = now - self.updated
        if elapsed > 0:
            for job in self.jobs:
                if job.startup > EPSILON_S:
                    job.startup -= elapsed * job.cores
                else:
                    job.remaining -= elapsed * job.rate
        self.updated = now

    def share(self) -> None:
        """Water-filling: equal shares, capped by what each call can use, the rest to the others."""
        left = float(self.cores)
        jobs = sorted(self.jobs, key=lambda j: j.cap)
        for i, job in enumerate(jobs):
            job.cores = min(job.cap, left / (len(jobs) - i))
            left -= job.cores
            job.rate = job.run.call.speedup(job.cores)
        self.next_finish = min((self.updated + j.phase_end() for j in jobs), default=None)


@dataclass(eq=False, slots=True)
class _Pod:
    trajectory: Trajectory
    node: _Node | None = None
    ready_at: float | None = None
    waiting: CallRun | None = None  # a call made before the pod runs


class PodStation:
    def __init__(self, cluster: Cluster, request_cpu: float = 0.5, limit_cpu: float = 4.0) -> None:
        self.costs = cluster.costs
        self.request_cpu = request_cpu
        self.limit_cpu = limit_cpu
        self.nodes = [_Node(f"cpu{i}", cluster.cores_per_node, cluster.node_memory_mb)
                      for i in range(cluster.cpu_nodes)]
        self.pods: dict[str, _Pod] = {}
        self.pending: deque[_Pod] = deque()  # waiting for the control plane, in order
        self.next_bind = 0.0  # the control plane is free to bind from this instant
        self.starting: list[tuple[float, int, _Pod]] = []  # (ready at, tie-break, pod)
        self.finished: list[CallRun] = []
        self.blocked = False  # the first pending pod fits no node: wait for a pod to end
        self.bound = 0
        self.peak_pending = 0

    def submit(self, run: CallRun, now: float) -> None:
        pod = self.pods.get(run.trajectory.id)
        if pod is None:
            pod = self.pods[run.trajectory.id] = _Pod(run.trajectory)
            self.pending.append(pod)
            self.peak_pending = max(self.peak_pending, len(self.pending))
        if pod.ready_at is None or pod.ready_at > now:
            pod.waiting = run
        else:
            self._start(pod, run, now, overhead=0.0)

    def _start(self, pod: _Pod, run: CallRun, now: float, overhead: float) -> None:
        node = pod.node
        assert node is not None
        run.start_s = now - overhead
        run.overhead_s = overhead
        run.pool = node.name
        cap = self.limit_cpu if run.call.elastic else 1.0
        # a test run on as many workers as the pods' CPU limit, on the runner or xdist (``costs.test_runner``)
        startup = startup_cpu_s(self.costs, int(cap), run.call.work_s) if run.call.kind == "test" else 0.0
        node.advance(now)
        node.jobs.append(_Job(run, cap, run.call.work_s, startup))
        node.share()

    def collect(self, now: float) -> list[CallRun]:
        for node in self.nodes:
            if node.next_finish is None or node.next_finish > now + EPSILON_S:
                continue
            node.advance(now)
            keep = []
            for job in node.jobs:
                if job.remaining <= EPSILON_S * max(1.0, job.run.call.work_s):
                    run = job.run
                    run.finish_s = now
                    run.exec_s = now - run.start_s - run.overhead_s
                    run.units = round(job.cores) or 1
                    self.finished.append(run)
                else:
                    keep.append(job)
            node.jobs = keep
            node.share()
        while self.starting and self.starting[0][0] <= now + EPSILON_S:
            _, _, pod = heapq.heappop(self.starting)
            if pod.waiting is not None:
                run, pod.waiting = pod.waiting, None
                self._start(pod, run, now, overhead=min(self.costs.pod_start_s, now - run.submit_s))
        done, self.finished = self.finished, []
        return done

    def dispatch(self, now: float) -> None:
        """The control plane binds the pending pods it has time for by ``now``."""
        while self.pending and self.next_bind <= now + EPSILON_S:
            pod = self.pending[0]
            fitting = [n for n in self.nodes if n.requested_cpu + self.request_cpu <= n.cores
                       and n.requested_mb + pod.trajectory.memory_mb <= n.memory_mb]
            if not fitting:
                self.blocked = True
                return
            node = max(fitting, key=lambda n: n.cores - n.requested_cpu)
            self.pending.popleft()
            node.requested_cpu += self.request_cpu
            node.requested_mb += pod.trajectory.memory_mb
            pod.node = node
            bound_at = max(now, self.next_bind)
            self.next_bind = bound_at + 1.0 / self.costs.pod_bind_per_s
            pod.ready_at = bound_at + self.costs.pod_start_s
            self.bound += 1
            heapq.heappush(self.starting, (pod.ready_at, self.bound, pod))

    def next_event(self) -> float | None:
        times = [n.next_finish for n in self.nodes if n.next_finish is not None]
        if self.starting:
            times.append(self.starting[0][0])
        if self.pending and not self.blocked:
            times.append(self.next_bind)
        return min(times, default=None)

    def trajectory_done(self, trajectory: Trajectory, now: float) -> None:
        pod = self.pods.pop(trajectory.id, None)
        if pod is None or pod.node is None:
            return
        pod.node.requested_cpu -= self.request_cpu
        pod.node.requested_mb -= trajectory.memory_mb
        self.blocked = False
        self.dispatch(now)

    def stats(self) -> dict[str, object]:
        return {"pods_bound": self.bound, "peak_pending_pods": self.peak_pending}
