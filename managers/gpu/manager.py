"""GPU manager via evict-on-execution (paper §5.3).

Many reward services share few GPUs. At start every service is prepared at each DoP it supports on every chunk
of that size (its weights held in host memory, nothing on the GPUs), after a host-memory admission check. A
``reward`` action gets a chunk of GPUs (buddy cells of 1/2/4/8, ``chunks.py``); if its service is resident
there it runs at once, otherwise the instances sharing those GPUs are evicted least recently used first until
the service fits, and it is restored from host memory, runs, and stays cached (``switch_plan.py`` decides,
``switch.py`` carries it out). The chunk is the action's alone, so at most one action runs on a GPU at a time.

Pools are nodes. ``fit`` places an action on a node that already holds its service, at a DoP the action accepts,
on a free chunk, else on the node with the most free GPUs (room for the elastic DP to scale actions up; inside a
node, the buddy allocator's smallest fit keeps large chunks whole). With ``[gpu.fit] wait_for_resident`` an action
whose service is resident only on busy GPUs waits for them up to one restore's time (``delay_wait.py``). The DP
plans with the chunk operator, which follows the allocator's own transitions. ``place_services`` confines each
service to the nodes a placement gives it (``placement.py``, ``confinement.py``): the fit then looks only there.

The class is a facade over one keeper per concern: services (``catalog.py``), nodes (``nodes.py``), Ray
membership (``membership.py``), the fit, confinement, setup costs for HRRS, prefetch (``disk_tier.py``), switches
and views.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from managers.gpu.catalog import ServiceCatalog
from managers.gpu.chunks import Chunk
from managers.gpu.config import GpuConfig, on_this_host
from managers.gpu.confinement import ServiceConfinement
from managers.gpu.delay_wait import DelayWaits
from managers.gpu.disk_tier import DiskTier, queued_services
from managers.gpu.fit import GpuFit
from managers.gpu.gpu_types import bound_of
from managers.gpu.host_tier import HostCopy
from managers.gpu.live_placement import LivePlacement, ServiceFigures
from managers.gpu.membership import GpuMembership
from managers.gpu.metrics import register_gpu_metrics
from managers.gpu.node import RESOURCE, GpuNode
from managers.gpu.nodes import BackendFactory, GpuNodes
from managers.gpu.service_backends import make_service_backend
from managers.gpu.service_demand import ServiceDemand
from managers.gpu.setup_costs import SetupCosts, restore_estimate
from managers.gpu.slot import SlotState
from managers.gpu.switch import ResidencySwitch
from managers.gpu.views import describe_services, node_pools
from reward_services.backend import GONE, ServiceError
from reward_services.requests import RewardRequest, RewardSpecBody
from tangram.core.action import Action, Kind
from tangram.core.seam import Allocation, CyclePlugins, MetricsRegistry, Outcome, PoolStatus, ResourceManager

#: a GPU allocation's handle: its node and chunk
GpuHandle = tuple[str, Chunk]


class GpuManager(ResourceManager[GpuHandle]):
    name = "gpu"
    kinds = frozenset({Kind.REWARD})
    spec_types = MappingProxyType({Kind.REWARD: RewardSpecBody})

    def __init__(self, config: GpuConfig, make_backend: BackendFactory | None = None,
                 clock: Callable[[], float] = time.time, solve_inline: bool = False) -> None:
        """``make_backend(kind, node, config)`` builds a node's backend for a service kind (torch, sglang); the
        simulator passes its own so that the manager's admission, chunks and residency run without GPUs, its
        virtual ``clock`` (what actions' ``submitted_at`` are on), and ``solve_inline`` to solve the placement in
        the scheduling pass instead of on a thread."""
        config = on_this_host(config)
        self.services = ServiceCatalog(config)
        self.nodes = GpuNodes(self.services, make_backend or make_service_backend)
        self.confinement = ServiceConfinement(self.nodes)
        self.restore_time = restore_estimate(self.services)
        self.disk = DiskTier(self.nodes, self.services, self.confinement.may_run)
        #: actions deferred to wait for a node that holds their service (delay scheduling)
        self.waits = DelayWaits(clock)
        #: ``[gpu.fit]``, read by each pass's fit
        self.fit_args = config.fit
        #: each service's demand and run time per GPU type; the broker tells it of actions (``watchers``)
        self.demand = ServiceDemand(lambda action: self.reward_request(action).service, self.nodes.type_of,
                                    config.types, {spec.name: bound_of(spec.task) for spec in config.services},
                                    config.placement.window_s)
        method = config.placement_method
        self.live = None if method is None else LivePlacement(
            method, self.demand, config.placement.interval_s, config.placement.time_limit_s, clock, solve_inline)
        self.setup = SetupCosts(self.nodes, self.confinement.may_run, self.reward_request, self.restore_time,
                                self.demand, config.types)
        self.switch = ResidencySwitch(self.services, self.disk, self.restore_time)
        self.membership = GpuMembership(self.nodes, self.services, self._placement_stale)
        for node_config in config.nodes:
            self.nodes.add(self.nodes.admitted(node_config))

    @property
    def config(self) -> GpuConfig:
        """The running ``[gpu]`` config, sized for this host; a reload adds services to it."""
        return self.services.config

    async def start(self) -> None:
        for node in self.nodes.values():
            await self.nodes.prepare(node)
        await self.membership.start()

    async def close(self) -> None:
        if self.live is not None:
            self.live.close()
        await self.services.close()
        await self.membership.stop()
        await self.nodes.close()

    def reconfigure(self, new: GpuConfig) -> list[str]:
        """Admit the services that ``new`` adds to the running ones and start preparing them; returns their names.

        Every node's admission is run anew over all its services, old and new, and nothing changes unless every
        node admits them (``ConfigError`` naming the service or the node's budget, as at start). Any other change
        to ``[gpu]`` needs a restart (``Conflict`` naming the first changed field). The new services' actions get
        503 until each of their instances is prepared, on every node in service (a lost node prepares them when
        it comes back); a failed preparation is kept as their state, with its reason."""
        added = self.services.added_by(new)
        if not added:
            return []
        self.nodes.admit_added(added)
        names = self.services.add(added, self.nodes.prepare_in_service)
        self.demand.bounds.update({spec.name: bound_of(spec.task) for spec in added})
        self._placement_stale()
        return names

    def _placement_stale(self) -> None:
        """Services or nodes changed: the live placement is solved again at the next pass."""
        if self.live is not None:
            self.live.stale()

    def plugins(self) -> CyclePlugins:
        return CyclePlugins(setup_costs=self.setup_costs, foresight=self, watchers=(self.demand,),
                            next_change_in=self.next_change_in, metrics=self.register_metrics)

    def register_metrics(self, registry: MetricsRegistry) -> None:
        self.switch.metrics, self.disk.host_loads = register_gpu_metrics(registry, self.live)

    def next_change_in(self) -> float | None:
        return self.waits.next_change_in()

    def setup_costs(self, actions: Sequence[Action]) -> dict[str, float]:
        """Each reward action's restore unless its service is ready on free GPUs (``SetupCosts.of``)."""
        return self.setup.of(actions)

    @property
    def foresees(self) -> bool:
        """Prefetch (``foresee``) runs while a node has a disk tier."""
        return self.disk.active

    def foresee(self, upcoming: Iterable[Action]) -> None:
        for node, service, victims in self.prefetch_plan(upcoming):
            self.disk.start_load(node, service, victims, "prefetch")

    def prefetch_plan(self, upcoming: Iterable[Action]) -> list[tuple[GpuNode, str, list[HostCopy]]]:
        """The loads prefetch starts now, booked (``DiskTier.prefetch_plan``) for the queued actions ``upcoming``,
        in the order they will run."""
        return self.disk.prefetch_plan(queued_services(upcoming, lambda action: self.reward_request(action).service))

    @property
    def resources(self) -> Mapping[str, int]:
        return {RESOURCE: sum(node.config.gpus for node in self.nodes.values() if node.lost is None)}

    def largest_pool(self, resource: str) -> int:
        return max((chunk.size for node in self.nodes.values() for chunk in node.chunks.tiles), default=0)

    @property
    def allowed(self) -> Mapping[str, frozenset[str]]:
        """Service -> the nodes a placement confines it to (absent: every node)."""
        return self.confinement.allowed

    def place_services(self, allowed: Mapping[str, Collection[str]] | None = None) -> None:
        self.confinement.place_services(allowed)

    def place_on_types(self, types: Mapping[str, Iterable[str]]) -> None:
        self.confinement.place_on_types(types)

    def fit(self) -> GpuFit:
        self.disk.new_pass()
        self.waits.new_pass()
        if self.live is not None:
            self.live.poll((ServiceFigures(spec.name, spec.host_memory_mb, spec.gpu_memory_mb, bound_of(spec.task))
                            for spec in self.services.serving()),
                           [node.config for node in self.nodes.values() if node.lost is None], self.config.types,
                           self.place_on_types)
        return GpuFit(self)

    def validate(self, action: Action) -> None:
        if action.kind is not Kind.REWARD:
            return
        name = self.services.parse(action).service
        self.services.check_prepared(name)
        self.nodes.check_serving(name)

    def reward_request(self, action: Action) -> RewardRequest:
        """The action's spec as checked at submit (parsed here first for an action recovered from the store)."""
        return self.services.request_of(action)

    def allocate(self, action: Action, units: Mapping[str, int], pools: Mapping[str, str]) -> Allocation[GpuHandle]:
        node = self.nodes[pools[RESOURCE]]
        service = self.reward_request(action).service
        chunk = node.chunks.allocate(units[RESOURCE], node.chunk_key(service))
        if chunk is None:
            raise RuntimeError(f"node {node.name} has no free chunk of {units[RESOURCE]} GPU(s)")
        placement = {"node": node.name, "gpus": list(chunk.gpus), "service": service}
        return Allocation(action.id, dict(units), dict(pools), placement={RESOURCE: placement},
                          handle=(node.name, chunk))

    def release(self, allocation: Allocation[GpuHandle]) -> None:
        if allocation.released or allocation.handle is None:
            return
        allocation.released = True
        node, chunk = allocation.handle
        self.nodes[node].chunks.release(chunk)

    def status(self) -> list[PoolStatus]:
        return node_pools(self.nodes.values())

    def describe_services(self) -> list[dict[str, Any]]:
        """``GET /v1/services`` (``views.describe_services``)."""
        return describe_services(self.services, self.nodes, self.demand, self.live)

    def describe_placement(self) -> dict[str, Any] | None:
        """The placement in force (``GET /v1/resources``); None when the manager solves none
        (``[gpu.placement] method``)."""
        return self.live.summary() if self.live is not None else None

    # -- execution ------------------------------------------------------------------------------------------

    async def execute(self, action: Action, allocation: Allocation[GpuHandle]) -> Outcome:
        node_name, chunk = allocation.held()
        node = self.nodes[node_name]
        reward = self.reward_request(action)
        spec, request = self.services[reward.service], reward.request
        slot = node.residency.slot(spec.name, chunk)
        assert slot is not None, "every service has a slot on every chunk of each DoP it supports"
        where = {"node": node.name, "gpus": list(chunk.gpus), "service": spec.name}
        evicted: list[dict[str, Any]] = []
        restore_s, load_s = await self.switch.make_resident(node, slot, evicted, where)
        node.residency.touch(slot)
        try:
            result = await slot.instance.infer(request)
        except ServiceError as error:
            if error.code in GONE:
                slot.state = SlotState.BROKEN
            failure = await self.switch.failure(node, error, where)
            failure.restore_s = restore_s
            raise failure from None
        return Outcome({**result, **where, "restored": restore_s > 0, "restore_s": round(restore_s, 6),
                        "load_s": round(load_s, 6), "evicted": evicted}, restore_s=restore_s)
