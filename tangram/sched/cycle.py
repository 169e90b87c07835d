"""The scheduling cycle: one composition of a pass, run by the broker (wall clock) and the simulator (virtual clock).

A pass runs fixed extension points in this order:

1. queue filters: the per-task caps (``tenants.TaskLedger``: running actions, and the environments and memory of
   the manager whose plugins offer them), then the allocation back-off (``backoff``);
2. the queue order: as queued (FCFS), or setup-aware (HRRS, ``setup_order``) where the profile (``profile``) says;
3. the reserve order: the queued actions owed an SLO reservation first (``reserved_shares``, from SLO admission);
4. the scheduler (``scheduler``), whose plan the caller applies (shrinks, starts, grows);
5. foresight: told of the queued actions that did not start, in the pass's order (GPU prefetch).

The cycle also keeps what the passes learn from: submits and ends reach the duration and arrival models and the
watchers here. What differs between its two callers stays with them: the broker keeps HTTP, asyncio, deadlines and
the store, and executes; the simulator keeps its clock and models execution. So a feature added to the pass is added
once, and the simulator measures the pass the broker runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from tangram.core.action import Action, Kind
from tangram.core.seam import (
    ActionWatcher,
    Allocation,
    CyclePlugins,
    EnvironmentHost,
    Foresight,
    MetricsRegistry,
    ReserveOrder,
    ResourceManager,
)
from tangram.sched import dispatch
from tangram.sched.arrivals import ArrivalModel, Expected
from tangram.sched.backoff import AllocationBackoff
from tangram.sched.durations import DurationModel
from tangram.sched.profile import SchedulerProfile
from tangram.sched.queue import FCFSQueue, QueuePolicy
from tangram.sched.scheduler import Placement, Plan, Resize, Scheduler
from tangram.sched.setup_order import SetupAwareOrder
from tangram.sched.tenants import TaskLedger


class Cycle:
    """The queue and the pass over it, its plugins and their arguments from ``profile`` (``profile.py``). The
    managers' plugins (``CyclePlugins``) and ``plugins`` built beside them (SLO admission's) join the extension
    points; ``foresight`` replaces the managers' (the simulator models the GPU manager's prefetch)."""

    def __init__(self, managers: Sequence[ResourceManager], profile: SchedulerProfile, *,
                 plugins: Sequence[CyclePlugins] = (), foresight: Sequence[Foresight] | None = None) -> None:
        self.managers = list(managers)
        self.owner: dict[str, ResourceManager] = {}
        self.executor: dict[Kind, ResourceManager] = {}
        for manager in self.managers:
            for resource in manager.resources:
                if resource in self.owner:
                    raise ValueError(f"resource {resource!r} is owned by both {self.owner[resource].name} "
                                     f"and {manager.name}")
                self.owner[resource] = manager
            for kind in manager.kinds:
                self.executor[kind] = manager
        estimates, elastic = profile.estimates, profile.elastic
        self.durations = DurationModel(alpha=estimates.ewma_alpha, default_s=estimates.default_duration_s)
        self.scheduler = Scheduler(self.managers, self.durations, depth=elastic.depth, horizon=elastic.horizon,
                                   share_by_remaining=elastic.share_by == "remaining")
        self.arrivals = ArrivalModel(alpha=estimates.ewma_alpha) if estimates.arrivals else None
        self.queue: QueuePolicy = FCFSQueue()
        #: per-task caps: none until the broker sets a tenancy
        self.ledger = TaskLedger()
        self.backoff = AllocationBackoff()
        hrrs = profile.ordered_by("hrrs", self.owner)
        self.setup_order = SetupAwareOrder(hrrs, self.durations.duration, self._setup_costs, profile.hrrs.max_wait_s,
                                           profile.hrrs.overdue_floor_s) if hrrs else None
        own = [(manager, manager.plugins()) for manager in self.managers]
        every = [p for _, p in own] + list(plugins)
        self._setup_costs_of = {id(m): p.setup_costs for m, p in own if p.setup_costs is not None}
        self.foresight: list[Foresight] = [p.foresight for p in every if p.foresight is not None] \
            if foresight is None else list(foresight)
        reserve_orders = [p.reserve_order for p in every if p.reserve_order is not None]
        if len(reserve_orders) > 1:
            raise ValueError(f"one reserve order at most; plugins give {len(reserve_orders)}")
        #: the queued actions owed reserved units first (SLO admission's GPU shares)
        self.reserve_order: ReserveOrder | None = reserve_orders[0] if reserve_orders else None
        #: told of every action queued and ended
        self.watchers: list[ActionWatcher] = [watcher for p in every for watcher in p.watchers]
        self._change_hints = [p.next_change_in for p in every if p.next_change_in is not None]
        self._metrics = [p.metrics for p in every if p.metrics is not None]
        hosts = [p.environments for p in every if p.environments is not None]
        if len(hosts) > 1:
            raise ValueError(f"one environment host at most; plugins give {len(hosts)}")
        #: the environments the per-task caps count (the CPU manager's), for the environment-caps filter
        self.environment_host: EnvironmentHost | None = hosts[0] if hosts else None
        #: how long the last pass took to plan (filters, orders and the scheduler), in seconds
        self.last_pass_s = 0.0

    # -- the queue --------------------------------------------------------------------------------------

    def submit(self, action: Action, now: float) -> None:
        """Queue a new action and tell the arrival model and the watchers."""
        self.enqueue(action)
        if self.arrivals is not None:
            self.arrivals.submitted(action, now)
        for watcher in self.watchers:
            watcher.submitted(action)

    def enqueue(self, action: Action) -> None:
        """Queue an action without counting it as submitted now (one resumed after a restart)."""
        self.queue.push(action)
        self.ledger.queue(action)

    def dequeue(self, action_id: str) -> Action | None:
        action = self.queue.remove(action_id)
        if action is not None:
            self.ledger.unqueue(action)
            self.backoff.forget(action_id)
        return action

    # -- the pass ---------------------------------------------------------------------------------------

    def pass_once(self, now: float, running: Sequence[Action], apply: Callable[[Plan], None]) -> Plan:
        """Plan a pass over the queue, have ``apply`` carry it out, then tell foresight what is still queued."""
        started = time.perf_counter()
        queue: Iterable[Action] = self.queue
        if self.ledger.limited:
            queue = self.ledger.admissible(queue, self.environment_host)
        if self.backoff:
            queue = [action for action in queue if not self.backoff.waiting(action.id, now)]
        if self.setup_order is not None:
            queue = self.setup_order.order(queue, now)
        if self.reserve_order is not None:
            queue = self.reserve_order.order(queue, running)
        foreseeing = [foresight for foresight in self.foresight if foresight.foresees]
        if foreseeing and not isinstance(queue, list):
            queue = list(queue)  # read again after the pass
        plan = self.scheduler.schedule(queue, running, now, self._expected(now))
        self.last_pass_s = time.perf_counter() - started
        apply(plan)
        if foreseeing:
            started_now = {placement.action.id for placement in plan.placements}
            upcoming = [action for action in queue if action.id not in started_now]
            for foresight in foreseeing:
                foresight.foresee(upcoming)
        return plan

    def _expected(self, now: float) -> Callable[[str, int], list[Expected]] | None:
        """What idle trajectories are expected to submit next, if the arrival model is on."""
        arrivals = self.arrivals
        if arrivals is None:
            return None
        host = self.environment_host
        holds = host.holds_environment if host is not None else None
        return lambda resource, limit: arrivals.expected(resource, now, limit, holds)

    def _setup_costs(self, actions: Sequence[Action]) -> dict[str, float]:
        """Each action's setup, from the managers of the setup-ordered resources (the largest where several)."""
        assert self.setup_order is not None
        costs: dict[str, float] = {}
        owners = {id(self.owner[resource]) for resource in self.setup_order.resources}
        for setup_costs in (self._setup_costs_of[owner] for owner in owners if owner in self._setup_costs_of):
            for action_id, seconds in setup_costs(actions).items():
                costs[action_id] = max(costs.get(action_id, 0.0), seconds)
        return costs

    def next_change_in(self) -> float | None:
        """Seconds until some manager's capacity frees up by itself (the earliest); None if none will."""
        return min((hint for change_in in self._change_hints if (hint := change_in()) is not None), default=None)

    def register_metrics(self, registry: MetricsRegistry) -> None:
        """Add the managers' own metrics to ``registry``."""
        for register in self._metrics:
            register(registry)

    # -- applying a plan, and learning from ends ---------------------------------------------------------

    def start(self, placement: Placement, now: float) -> list[tuple[ResourceManager, Allocation]]:
        """Allocate a placement and take its action off the queue; raises what the allocation raised, with nothing
        held and the action still queued."""
        allocations = dispatch.start(self.owner, self.durations, placement, now)
        self.dequeue(placement.action.id)
        return allocations

    def resize(self, allocations: list[tuple[ResourceManager, Allocation]], decision: Resize,
               now: float) -> Allocation:
        return dispatch.resize(self.owner, allocations, decision, now)

    def ended(self, action: Action, now: float, succeeded: bool) -> None:
        """Learn from an action's end (its duration if it succeeded, its trajectory's idle start) and tell the
        watchers."""
        dispatch.ended(self.durations, self.arrivals, action, now, succeeded)
        for watcher in self.watchers:
            watcher.ended(action)
