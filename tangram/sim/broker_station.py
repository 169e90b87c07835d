"""The broker on a virtual clock: its own queue, scheduler, duration model and managers; execution modelled.

Calls become actions shaped as a client would send them (``action_for``). Each instant with news runs one
scheduling pass; placements are allocated by the real managers (cores per node with memory for the trajectory's
life, buddy GPU chunks, API quota windows on the virtual clock). Execution time is the call's true duration on the
granted units; overhead is the dispatch cost and the sandbox creation on a trajectory's first exec (CPU), or the
restore from host memory when the service is not resident on the chunk (GPU, using the manager's residency and
its LRU eviction). On a typed cluster a reward call runs at its service's speed on the node's GPU type, and a
restore's host-to-GPU copy at the type's rate (``managers/gpu/gpu_types.py``); an untyped cluster is all reference type.
"""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from managers.basic.manager import BasicManager, BasicResourceConfig
from managers.cpu.config import CpuConfig, CpuNodeConfig
from managers.cpu.manager import CpuManager
from managers.cpu.node import CpuNode
from managers.gpu.config import GpuConfig, GpuFitArgs, GpuNodeConfig, GpuPlacementArgs, PlacementChoice
from managers.gpu.gpu_types import REFERENCE_TYPE, restore_factor, speed
from managers.gpu.host_tier import CopyState, HostTierFull
from managers.gpu.manager import GpuManager
from managers.gpu.node import GpuNode
from managers.gpu.placement import Method
from managers.gpu.switch_plan import plan_switch
from reward_services.backend import ServiceBackend, ServiceInstance, ServiceSpec
from sandboxes.backend import Leftover, Sandbox, SandboxBackend, SandboxSpec
from tangram.core.action import Action, Demand, Kind
from tangram.core.malleable import Workers
from tangram.core.seam import Allocation, CyclePlugins, ResourceManager
from tangram.sched import dispatch
from tangram.sched.cycle import Cycle
from tangram.sched.profile import DEFAULT_PROFILE, SchedulerProfile
from tangram.sched.reserved_shares import ReservedShares
from tangram.sched.scheduler import Plan, Resize
from tangram.sim.cluster import Cluster, Costs, startup_cpu_s
from tangram.sim.engine import CallRun
from tangram.sim.execution import Execution
from tangram.sim.placement import placement_stats, solve
from tangram.sim.records import percentile
from tangram.sim.trace import Trajectory
from tangram.slo.attainment import SloAttainment
from tangram.slo.plan import SloPlan

TOOL_SIGNATURE = "exec|tool"
#: a GPU node's disk tier directory in simulation: named so that the manager makes the tier, never touched
MODELLED_DISK = "(modelled)"


class NoSandboxes(SandboxBackend):
    """The CPU nodes' backend in simulation: sandboxes exist only as the manager's records."""

    async def create(self, spec: SandboxSpec) -> Sandbox:
        raise RuntimeError("the simulator never creates sandboxes")

    async def adopt(self, broker_id: str) -> list[Leftover]:
        return []

    async def reap(self, broker_id: str) -> int:
        return 0


class _ModelledInstance(ServiceInstance):
    """A service instance whose restores and inferences the station times itself."""

    async def prepare(self) -> None: ...

    async def restore(self) -> None: ...

    async def evict(self) -> None: ...

    async def infer(self, request: Any) -> dict[str, Any]:
        raise RuntimeError("the simulator never runs inference")

    async def close(self) -> None: ...


class _ModelledBackend(ServiceBackend):
    shares_host_copy = True  # like the torch worker: one pinned host copy per service per node
    tiered = True  # and it can spill them to a disk tier (the station times loads; the manager never starts)

    def instance(self, spec: ServiceSpec, devices: tuple[int, ...]) -> ServiceInstance:
        return _ModelledInstance(spec, devices)


def build_managers(cluster: Cluster, clock: Any, malleable: bool = True,
                   worker_overhead: float = CpuConfig.worker_overhead, wait_for_resident: bool = False,
                   live_placement: PlacementChoice = "none", typed_fit: bool = False) -> list[ResourceManager]:
    """The real managers over the cluster's resources, with modelled sandboxes and services. The GPU manager's
    ``[gpu.placement] method`` and ``[gpu.fit] typed`` are off unless asked for: a scenario names what it
    compares."""
    managers: list[ResourceManager] = []
    if cluster.cpu_nodes:
        nodes = tuple(CpuNodeConfig(name=f"cpu{i}", cores=tuple(range(cluster.cores_per_node)),
                                    memory_mb=cluster.node_memory_mb) for i in range(cluster.cpu_nodes))
        cpu = CpuManager(CpuConfig(nodes=nodes, max_environments=1 << 30, malleable=malleable,
                                   worker_start_s=cluster.costs.xdist_worker_cpu_s, worker_overhead=worker_overhead,
                                   pytest_runner=cluster.costs.test_runner))
        for config in nodes:
            cpu.add_node(CpuNode(config, NoSandboxes()))
        managers.append(cpu)
    if cluster.gpu_node_sizes:
        # a judge generates (decode-bound), a teacher scores: the task the manager reads the bound from
        specs = tuple(ServiceSpec(name=s.name, backend="torch", model=s.name,
                                  task="generate" if s.generates else "similarity", dops=s.dops,
                                  gpu_memory_mb=s.gpu_memory_mb, host_memory_mb=s.host_memory_mb)
                      for s in cluster.services)
        gpu = GpuManager(GpuConfig(enabled=True, nodes=gpu_node_configs(cluster), services=specs,
                                   types=cluster.gpu_types,
                                   fit=GpuFitArgs(wait_for_resident=wait_for_resident, typed=typed_fit),
                                   placement=GpuPlacementArgs(method=live_placement)),
                         make_backend=lambda *_: _ModelledBackend(), clock=clock, solve_inline=True)
        for node in gpu.nodes.values():  # as ``GpuManager.start`` leaves it: copies prepared in turn, LRU dropped
            tier = node.tier
            for service in tier.copies if tier is not None else ():
                assert tier is not None
                tier.plan_load(service)
                tier.loaded(service)
        managers.append(gpu)
    if cluster.apis:
        managers.append(BasicManager([BasicResourceConfig(a.name, concurrency=a.concurrency, quota=a.quota,
                                                          period_s=a.period_s) for a in cluster.apis], clock=clock))
    return managers


def gpu_node_configs(cluster: Cluster) -> tuple[GpuNodeConfig, ...]:
    """The cluster's GPU nodes as the GPU manager's config gives them, typed."""
    return tuple(GpuNodeConfig(name=f"gpu{i}", gpus=n, gpu_memory_mb=cluster.gpu_memory_mb,
                               host_memory_mb=cluster.gpu_host_memory_mb,
                               disk_dir=MODELLED_DISK if cluster.gpu_disk_tier else None, type=cluster.gpu_node_type(i))
                 for i, n in enumerate(cluster.gpu_node_sizes))


ELASTIC_TEST = Demand.range(1, 32)  # §6.4: the DoP of a test run ranges from 1 to 32


def action_for(run: CallRun, seq: int, now: float, test_demand: Demand = ELASTIC_TEST,
               dops: tuple[int, ...] = (1, 2, 4, 8), generates: bool = False) -> Action:
    """The action a client sends for ``run.call``: tool calls on one core, test runs on ``test_demand`` cores
    (elastic when it is a range), rewards on a GPU chunk of the service's DoPs (a prompt to a service that
    ``generates``, a pair to one that scores), API calls on one quota unit."""
    call = run.call
    trajectory = run.trajectory
    spec: dict[str, Any] = {"command": "true", "memory_mb": trajectory.memory_mb}  # never run: a valid spec
    elasticity = None
    if call.kind == "tool":
        kind, demands, signature = Kind.EXEC, {"cpu": Demand.fixed(1)}, TOOL_SIGNATURE
    elif call.kind == "test":
        kind, signature = Kind.EXEC, "exec|test"
        spec = {**spec, "command": "pytest", "pytest_parallel": True}  # what the CPU manager gives workers to
        demands = {"cpu": test_demand}
        elasticity = call.elasticity("cpu") if test_demand.elastic else None
    elif call.kind == "reward":
        kind, signature = Kind.REWARD, f"reward|{call.target}"
        spec = {"service": call.target, "input": {"prompts": [""]} if generates else {"pairs": [["", ""]]}}
        demands = {"gpu": Demand(dops)}
        elasticity = call.elasticity("gpu")
    else:
        kind, signature = Kind.API, f"api|{call.target}"
        spec = {}
        demands = {str(call.target): Demand.fixed(1)}
    action = Action(task=trajectory.task, kind=kind, demands=demands, spec=spec, trajectory=trajectory.id,
                    elasticity=elasticity, signature=signature, id=f"a{seq}", seq=seq, submitted_at=now)
    return action


class BrokerStation:
    def __init__(self, cluster: Cluster, profile: SchedulerProfile = DEFAULT_PROFILE, *,
                 test_demand: Demand = ELASTIC_TEST, malleable: bool = True,
                 worker_overhead: float = CpuConfig.worker_overhead,
                 static_dops: bool = False, prefetch: bool = True, wait_for_resident: bool = False,
                 slo_plans: Mapping[str, SloPlan] | None = None, reserved: Mapping[str, int] | None = None,
                 placement: Method | None = None,
                 loads: Mapping[str, float] | None = None, live_placement: PlacementChoice = "none",
                 typed_fit: bool = False, managers: Sequence[ResourceManager] | None = None) -> None:
        """``profile``: the scheduler profile (``[scheduler]``), from which the station builds its cycle as the
        broker does. ``placement`` confines each reward service to the nodes of the GPU types where the placement of
        that method (``tangram/sim/placement.py``) gives it a variant, computed once at the start from ``loads``
        (service -> GPU-seconds per second on the reference type; the scenario's oracle, ``trace_loads``); None:
        every service on every node, today's broker. ``live_placement`` and ``typed_fit`` are the GPU manager's own
        ``[gpu.placement] method`` (solved from the demand it measures as the run goes) and ``[gpu.fit] typed``;
        ``wait_for_resident`` is ``[gpu.fit] wait_for_resident``. ``reserved``: the GPUs SLO admission reserves
        per task (``tangram/slo/plan.py``), put ahead as the broker does. ``managers``: capacity this station shares
        with other stations (brokers partitioned over one cluster, ``partitions.py``); None: its own over ``cluster``."""
        self.cluster = cluster
        self.costs: Costs = cluster.costs
        self.test_demand = test_demand
        self.now = 0.0
        self.managers = list(managers) if managers is not None else build_managers(
            cluster, lambda: self.now, malleable, worker_overhead, wait_for_resident, live_placement, typed_fit)
        self.cpu = next((m for m in self.managers if isinstance(m, CpuManager)), None)
        self.gpu = next((m for m in self.managers if isinstance(m, GpuManager)), None)
        # with ``static_dops`` a service runs only at its static deployment's DoP: loaded on demand, never resized
        self.dops = {s.name: (s.static_dop,) if static_dops else s.dops for s in cluster.services}
        #: the broker's own attainment estimate (``tangram/slo/attainment.py``) of the tasks with ``slo_plans``
        self.slo: SloAttainment | None = None
        if slo_plans:
            self.slo = SloAttainment(lambda action: str(action.spec["service"]), "gpu")
            self.slo.plan(slo_plans)
        shares = ReservedShares("gpu")
        shares.reserve(reserved or {})
        #: the broker's own pass, with prefetch modelled here (``foresee``); SLO admission's plugins as given
        self.cycle = Cycle(self.managers, profile, foresight=(self,), plugins=[CyclePlugins(
            reserve_order=shares, watchers=() if self.slo is None else (self.slo,))])
        self.queue = self.cycle.queue
        self.calls: dict[str, CallRun] = {}
        self.running: dict[str, tuple[Action, list[tuple[ResourceManager, Allocation]]]] = {}
        self.finishing: list[tuple[float, int, str, int]] = []  # (finish, seq, action id, execution version)
        self.executions: dict[str, Execution] = {}  # CPU calls, timed by the work they do
        self.sandboxes: set[str] = set()  # trajectories whose sandbox exists
        self.seq = 0
        self.dirty = False
        self.wake_at: float | None = None
        self.pass_ms: list[float] = []
        self.restores = 0
        self.evictions = 0
        #: the disk tier (``cluster.gpu_disk_tier``): prefetch as the broker asks the manager for it; loads in
        #: flight by (node, service) with when they land; when each node's disk is next free (one read at a time)
        self.prefetch = prefetch and self.gpu is not None and self.gpu.foresees
        self.loads: dict[tuple[str, str], float] = {}
        self.disk_free_at: dict[str, float] = {}
        self.disk_loads = 0
        self.generates = {s.name for s in cluster.services if s.generates}
        #: (node, service) -> times faster than on the reference type; node -> a restore's time over the reference's
        self.speed: dict[tuple[str, str], float] = {}
        self.restore_factor: dict[str, float] = {}
        self.placement: dict[str, Any] | None = None
        if self.gpu is not None:
            reference = cluster.gpu_types[REFERENCE_TYPE]
            for node in self.gpu.nodes.values():
                kind = cluster.gpu_types[node.config.type]
                self.restore_factor[node.name] = restore_factor(kind, reference)
                for service in cluster.services:
                    self.speed[(node.name, service.name)] = speed(kind, reference, service.bound)
            if placement is not None:
                placed = solve(placement, cluster, self.gpu.config.nodes, loads or {})
                self.gpu.place_on_types({service: placed.variants(service) for service in placed.shares})
                self.placement = placement_stats(placed)

    def submit(self, run: CallRun, now: float) -> None:
        self.seq += 1
        dops = self.dops.get(run.call.target or "", (1,))
        action = action_for(run, self.seq, now, self.test_demand, dops, run.call.target in self.generates)
        self.calls[action.id] = run
        self.cycle.submit(action, now)
        self.dirty = True

    def collect(self, now: float) -> list[CallRun]:
        self.now = now
        self._settle_loads(now)
        done = []
        while self.finishing and self.finishing[0][0] <= now:
            _, _, action_id, version = heapq.heappop(self.finishing)
            if action_id not in self.running:
                continue  # a stale event of a call re-timed to finish earlier
            execution = self.executions.get(action_id)
            if execution is not None:
                if execution.version != version:
                    continue  # re-timed by a resize
                execution.advance(now)
                run = self.calls[action_id]
                run.finish_s = now
                run.exec_s = now - run.start_s - run.overhead_s
                run.unit_s = execution.unit_s
                run.history = tuple(execution.history)
                del self.executions[action_id]
            action, allocations = self.running.pop(action_id)
            dispatch.release(allocations)
            action.execution_s = self.calls[action_id].exec_s + self.calls[action_id].overhead_s
            if action.kind is Kind.REWARD:  # as the broker records an Outcome's restore_s on its action
                action.restore_s = self.calls[action_id].overhead_s
            if action.malleable is not None:
                self.calls[action_id].resizes = action.malleable.resizes
            action.finished_at = now
            self.cycle.ended(action, now, succeeded=True)
            done.append(self.calls.pop(action_id))
            self.dirty = True
        return done

    def dispatch(self, now: float) -> None:
        self.now = now
        if not self.dirty and not (self.wake_at is not None and now >= self.wake_at):
            return
        if not len(self.queue) and not self.executions:
            self.dirty = False
            return
        self.dirty = False
        self.cycle.pass_once(now, self.seen_running(), lambda plan: self._apply(plan, now))
        self.pass_ms.append(self.cycle.last_pass_s * 1e3)
        hint = self.cycle.next_change_in()
        self.wake_at = now + hint if hint is not None and len(self.queue) else None

    def seen_running(self) -> list[Action]:
        """The running actions its pass sees, and may resize: its own (``partitions.py`` lets a partition see more)."""
        return [action for action, _ in self.running.values()]

    def _apply(self, plan: Plan, now: float) -> None:
        for decision in plan.shrinks():
            self._resize(decision, now)
        for placement in plan.placements:
            action = placement.action
            allocations = self.cycle.start(placement, now)
            run = self.calls[action.id]
            run.start_s = now
            self.running[action.id] = (action, allocations)
            finish = self._execute(run, action, allocations, placement.workers, now)
            heapq.heappush(self.finishing, (finish, action.seq, action.id, 0))
        for decision in plan.grows():
            self._resize(decision, now)

    @property
    def foresees(self) -> bool:
        """Prefetch from the disk tier, as the broker's GPU manager would (``Cycle`` foresight), loads modelled."""
        return self.prefetch

    def foresee(self, upcoming: Iterable[Action]) -> None:
        assert self.gpu is not None
        for node, service, _ in self.gpu.prefetch_plan(upcoming):
            self._load(node.name, service, self.now)

    def _resize(self, decision: Resize, now: float) -> None:
        action = decision.action
        _, allocations = self.running[action.id]
        self.cycle.resize(allocations, decision, now)
        execution = self.executions[action.id]
        finish = execution.resize(decision.units, now)
        heapq.heappush(self.finishing, (finish, action.seq, action.id, execution.version))

    def _execute(self, run: CallRun, action: Action, allocations: list[tuple[ResourceManager, Allocation]],
                 workers: Workers | None, now: float) -> float:
        """Model the call's execution from ``now``; returns when it finishes (CPU calls: until re-timed)."""
        call = run.call
        if call.kind in ("tool", "test"):
            run.units = action.units["cpu"]
            run.overhead_s = self.costs.dispatch_s
            if run.trajectory.id not in self.sandboxes:
                self.sandboxes.add(run.trajectory.id)
                run.overhead_s += self.costs.env_create_s
            run.pool = next(a for m, a in allocations if m is self.cpu).pools["cpu"]
            # a test run starts ``count`` workers (plain pytest for one, unless the runner's follow its cores:
            # then ``count`` is its cap and it works on as many as it holds)
            count = workers.count if workers is not None else run.units
            follows = workers is not None and workers.follows
            startup = startup_cpu_s(self.costs, count, call.work_s, follows) if call.kind == "test" else 0.0
            execution = Execution(call, count, run.units, now, now, run.overhead_s, startup, call.work_s)
            self.executions[action.id] = execution
            return execution.finish_at()
        if call.kind == "reward":
            run.units = action.units["gpu"]
            allocation = next(a for m, a in allocations if m is self.gpu)
            node_name, chunk = allocation.held()
            run.exec_s = call.duration(run.units) / self.speed[(node_name, str(call.target))]
            run.pool = f"{node_name}:{chunk.start}+{chunk.size}"
            restore = self._make_resident(self.gpu.nodes[node_name], str(call.target), chunk)  # type: ignore[union-attr]
            run.overhead_s = restore  # what GpuManager.execute's Outcome carries as restore_s
        else:
            run.units = 1
            run.exec_s = call.work_s
            run.pool = str(call.target)
        run.finish_s = now + run.exec_s + run.overhead_s
        run.unit_s = run.units * run.exec_s
        return run.finish_s

    def _make_resident(self, node: GpuNode, service: str, chunk: Any) -> float:
        """The GPU manager's switch (``plan_switch``'s decision, booked by ``commit``, then ``evicted`` and
        ``restored``: the calls ``GpuManager`` makes around its real evictions and restores), timed by the cost
        model. Evictions and the restore are done at once in the books; a broken instance never occurs here."""
        slot = node.residency.slot(service, chunk)
        assert slot is not None, "every service has a slot on every chunk of each DoP it supports"
        node.residency.touch(slot)
        plan = plan_switch(node.residency, slot)
        if not plan.restore:
            return 0.0
        node.residency.commit(plan)
        for victim, _ in plan.victims:
            node.residency.evicted(victim)
        node.residency.restored(slot)
        self.restores += 1
        self.evictions += len(plan.victims)
        shard_gb = slot.instance.spec.host_memory_mb / 1024 / chunk.size
        seconds = self._host_copy(node, service) + (self.costs.evict_s if plan.victims else 0.0) \
            + shard_gb / self.costs.h2d_gb_per_s * self.restore_factor[node.name]
        self.gpu.restore_time.observe(service, seconds)  # type: ignore[union-attr]
        return seconds

    def _host_copy(self, node: GpuNode, service: str) -> float:
        """Seconds a restore waits for its host copy: none in host memory, until a load in flight lands, or a
        load of its own (``DiskTier.plan_restore_load``, as ``DiskTier.host_copy``) behind the disk's other
        reads."""
        tier = node.tier
        if tier is None:
            return 0.0
        copy = tier.copies[service]
        if copy.state is CopyState.HOST:
            tier.pin(service)  # a restore here takes no time on the tier's clock: pinned and read at once
            tier.unpin(service)
            return 0.0
        if copy.state is CopyState.DISK:
            while True:
                try:
                    self.gpu.disk.plan_restore_load(node, service)  # type: ignore[union-attr]
                    break
                except HostTierFull:  # loads in flight fill host memory: the earliest lands first
                    earliest = min((key for key in self.loads if key[0] == node.name), key=self.loads.__getitem__,
                                   default=None)
                    if earliest is None:
                        raise
                    self._land(earliest)
            self._load(node.name, service, self.now)
        return self.loads[(node.name, service)] - self.now

    def _load(self, node_name: str, service: str, now: float) -> None:
        """Time a load that was booked (by prefetch or a restore) on the node's disk, behind its other reads."""
        tier = self.gpu.nodes[node_name].tier  # type: ignore[union-attr]
        assert tier is not None
        start = max(now, self.disk_free_at.get(node_name, 0.0))
        seconds = tier.copies[service].size_mb / 1024 / self.costs.disk_gb_per_s
        self.loads[(node_name, service)] = self.disk_free_at[node_name] = start + seconds
        self.gpu.disk.load_time.observe(service, seconds)  # type: ignore[union-attr]
        self.disk_loads += 1

    def _settle_loads(self, now: float) -> None:
        for key in [key for key, at in self.loads.items() if at <= now]:
            self._land(key)
            self.dirty = True  # the next pass may prefetch the next service

    def _land(self, key: tuple[str, str]) -> None:
        del self.loads[key]
        tier = self.gpu.nodes[key[0]].tier  # type: ignore[union-attr]
        assert tier is not None
        tier.loaded(key[1])

    def next_event(self) -> float | None:
        loads = min(self.loads.values(), default=None)
        times = [t for t in (self.finishing[0][0] if self.finishing else None, self.wake_at, loads) if t is not None]
        return min(times, default=None)

    def trajectory_done(self, trajectory: Trajectory, now: float) -> None:
        if self.cycle.arrivals is not None:
            self.cycle.arrivals.forget(trajectory.task, trajectory.id)
        if self.cpu is None:
            return
        env = self.cpu.environments.of_trajectory(trajectory.task, trajectory.id)
        if env is not None:
            self.cpu.environments.detach(env)
        self.sandboxes.discard(trajectory.id)

    def stats(self) -> dict[str, object]:
        passes = self.pass_ms or [0.0]
        return {"passes": len(self.pass_ms), "pass_ms_median": statistics.median(passes),
                "pass_ms_p99": percentile(passes, 0.99), "restores": self.restores,
                "evictions": self.evictions, "disk_loads": self.disk_loads,
                **({"slo_windows": {task: [a.windows, a.within] for task, a in self.slo.tasks.items()}}
                   if self.slo is not None else {}),
                **({"placement": self.placement} if self.placement is not None else {}),
                **({"live_placement": self._live_stats()} if self.gpu is not None and self.gpu.live is not None
                   else {})}

    def _live_stats(self) -> dict[str, Any]:
        """The GPU manager's own placement at the end of the run, and how many solves each method answered."""
        assert self.gpu is not None and self.gpu.live is not None
        live = self.gpu.live
        last = placement_stats(live.placement) if live.placement is not None else None
        return {"solves": dict(live.solves), "last": last,
                "loads": {service: round(load, 4) for service, load in live.loads.items()}}
