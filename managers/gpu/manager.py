"""GPU manager via evict-on-execution (paper §5.3).

Many reward services share few GPUs. At start every service is prepared at each DoP it supports on every chunk
of that size (its weights held in host memory, nothing on the GPUs), after a host-memory admission check. A
``reward`` action gets a chunk of GPUs (buddy cells of 1/2/4/8, ``chunks.py``); if its service is resident
there it runs at once, otherwise the instances sharing those GPUs are evicted least recently used first until
the service fits, and it is restored from host memory, runs, and stays cached (``residency.py``). The chunk is
the action's alone, so at most one action runs on a GPU at a time.

Pools are nodes. ``fit`` places an action on a node that already holds its service, at a DoP the action accepts,
on a free chunk, else on the node with the most free GPUs (room for the elastic DP to scale actions up; inside a
node, the buddy allocator's smallest fit keeps large chunks whole). With ``wait_for_resident`` an action whose
service is resident only on busy GPUs waits for them up to one restore's time (``delay_wait.py``). The DP plans
with the chunk operator, which follows the allocator's own transitions. ``place_services`` confines each service to
the nodes a placement gives it (``gpu_placement.py``): the fit then looks only there.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import fields, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Histogram

from managers.gpu.chunks import Chunk, ChunkAllocator
from managers.gpu.config import GpuConfig, GpuNodeConfig, on_this_host
from managers.gpu.delay_wait import DelayWaits
from managers.gpu.disk_tier import DiskTier
from managers.gpu.fit import GpuFit
from managers.gpu.gpu_types import REFERENCE_TYPE, bound_of, restore_factor
from managers.gpu.host_tier import CopyState, HostCopy, HostTier
from managers.gpu.live_placement import LivePlacement, PlacementCollector, ServiceFigures
from managers.gpu.node import RESOURCE, GpuNode
from managers.gpu.residency import Slot, SlotState
from managers.gpu.service_backends import make_service_backend
from managers.gpu.service_demand import ServiceDemand
from managers.remote.broker.agent_services import AgentServiceBackend
from reward_services.backend import GONE, ServiceBackend, ServiceError, ServiceSpec
from reward_services.requests import RewardRequest, RewardSpecBody, parse_reward_input, parse_reward_spec
from tangram.core.action import Action, Kind
from tangram.core.errors import (
    ActionFailed,
    BadRequest,
    ConfigError,
    Conflict,
    NotFound,
    Unavailable,
    Unprocessable,
)
from tangram.core.learned import LearnedSeconds
from tangram.core.seam import (
    Allocation,
    CyclePlugins,
    MetricsRegistry,
    Outcome,
    PoolStatus,
    ResourceManager,
)

if TYPE_CHECKING:
    from managers.remote.broker.ray_membership import RayMembership

log = logging.getLogger("tangram.gpu")

#: how long a node coming back waits for the actions that were on it when it was lost to end
SETTLE_S = 30.0
#: ASSUMED: host-to-GPU copy rate of a restore before one was observed (MiB/s, pinned PCIe 4.0 x16 ~ 20 GB/s
#: measured for large copies, halved for allocation and a cold cache); observed restores replace it
RESTORE_PRIOR_MB_PER_S = 10_000.0
#: weight of each observed restore in a service's restore estimate
RESTORE_EWMA_ALPHA = 0.3

#: queued reward actions whose services prefetch considers, in the order they will run
PREFETCH_LOOKAHEAD = 256

BackendFactory = Callable[[str, GpuNodeConfig, GpuConfig], ServiceBackend]
RESTORE_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


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
        self._make_backend = make_backend or make_service_backend
        self.config = config = on_this_host(config)
        self.services: dict[str, ServiceSpec] = {spec.name: spec for spec in config.services}
        self.nodes: dict[str, GpuNode] = {}
        self.restores: Counter | None = None
        self.evictions: Counter | None = None
        self.restore_seconds: Histogram | None = None
        self.restore_stage_seconds: Histogram | None = None
        self._membership: RayMembership | None = None
        #: each service's expected restore, from the restores seen: its host copy at the assumed rate until one is
        self.restore_time = LearnedSeconds(lambda name: self.services[name].host_memory_mb / RESTORE_PRIOR_MB_PER_S,
                                           RESTORE_EWMA_ALPHA)
        #: services added at runtime and not yet served: "preparing", or "failed: ..." with the reason
        self.preparing: dict[str, str] = {}
        self._preparations: set[asyncio.Task[None]] = set()
        self.disk = DiskTier(self.nodes, self.services, self.may_run)
        #: service -> the nodes its reward actions may run on (``place_services``); a service absent: every node
        self.allowed: dict[str, frozenset[str]] = {}
        #: actions deferred to wait for a node that holds their service (delay scheduling)
        self.waits = DelayWaits(clock)
        self.wait_for_resident = config.wait_for_resident
        self.typed_fit = config.typed_fit
        #: each service's demand and run time per GPU type; the broker tells it of actions (``watchers``)
        self.demand = ServiceDemand(lambda action: self.reward_request(action).service, self._node_type,
                                    config.types, {spec.name: bound_of(spec.task) for spec in config.services},
                                    config.placement_window_s)
        method = config.placement_method
        self.live = None if method is None else LivePlacement(
            method, self.demand, config.placement_interval_s, config.placement_time_limit_s, clock, solve_inline)
        for node_config in config.nodes:
            node = GpuNode(node_config, self._backends(node_config))
            self._admit(node)
            self.nodes[node.name] = node

    # -- lifecycle ------------------------------------------------------------------------------------------

    def _backends(self, node: GpuNodeConfig, services: Sequence[ServiceSpec] | None = None,
                  made: Mapping[str, ServiceBackend] | None = None) -> dict[str, ServiceBackend]:
        """The node's backend for each kind of ``services`` (the config's by default), those ``made`` kept."""
        made = made or {}
        return {spec.backend: made.get(spec.backend) or self._make_backend(spec.backend, node, self.config)
                for spec in (self.config.services if services is None else services)}

    def _admit(self, node: GpuNode, services: Sequence[ServiceSpec] | None = None) -> None:
        """Refuse, naming the service and the figures, any service whose host copies or per-GPU memory would
        exceed the node's budget; give each admitted service a slot on every chunk of each DoP it supports.
        Services are admitted in config order. With a disk tier, the copies of services whose backend can spill
        share what the others leave of the budget (each must fit it whole: a restore reads it from host memory)."""
        held: list[tuple[str, int]] = []
        tiered: list[tuple[str, int]] = []
        for spec in self.config.services if services is None else services:
            where = f"gpu.services.{spec.name}"
            if spec.gpu_memory_mb > node.config.gpu_memory_mb:
                raise ConfigError(f"{where}.gpu_memory_mb", f"{spec.gpu_memory_mb} MiB per GPU is more than node "
                                                            f"{node.name} lends ({node.config.gpu_memory_mb} MiB)")
            chunks = [c for k in spec.dops for c in _chunks_of(node.config.gpus, k)]
            if not chunks:
                raise ConfigError(f"{where}.dops", f"node {node.name} has {node.config.gpus} GPU(s): no chunk "
                                                   f"of {list(spec.dops)} fits")
            backend = node.backends[spec.backend]
            copies = backend.host_copies(spec, len(chunks))
            need = copies * spec.host_memory_mb
            total = sum(mb for _, mb in held) + need
            if node.config.disk_dir is not None and backend.tiered:
                tiered.append((spec.name, need))
            elif total > node.config.host_memory_mb:
                others = ", ".join(f"{name} {mb} MiB" for name, mb in held) or "nothing else"
                raise ConfigError(f"{where}.host_memory_mb",
                                  f"admission refused: {copies} host cop{'y' if copies == 1 else 'ies'} of "
                                  f"{spec.host_memory_mb} MiB = {need} MiB would bring node {node.name} to "
                                  f"{total} MiB, over its host budget of {node.config.host_memory_mb} MiB "
                                  f"(held: {others})")
            else:
                held.append((spec.name, need))
            node.services[spec.name] = spec.gpu_memory_mb
            for chunk in chunks:
                instance = node.backends[spec.backend].instance(spec, chunk.gpus)
                node.residency.add(Slot(spec.name, chunk, instance))
        if tiered:
            budget = node.config.host_memory_mb - sum(mb for _, mb in held)
            too_large = [f"{name} ({mb} MiB)" for name, mb in tiered if mb > budget]
            if too_large:
                raise ConfigError(f"gpu.nodes.{node.name}.host_memory_mb",
                                  f"admission refused: the host copies of {', '.join(too_large)} do not fit the "
                                  f"{budget} MiB that services without a disk tier leave of node {node.name}'s "
                                  f"{node.config.host_memory_mb} MiB (a restore needs a copy whole in host memory)")
            node.tier = HostTier(budget, dict(tiered))

    async def start(self) -> None:
        for node in self.nodes.values():
            await self._prepare(node)
        if self.config.join is not None or any(node.config.agent for node in self.nodes.values()):
            from managers.remote.broker.ray_cluster import (
                GPU_NODE_RESOURCE_PREFIX,  # Ray is imported only for agent nodes
            )
            from managers.remote.broker.ray_membership import RayMembership

            self._membership = RayMembership(self.config.ray, GPU_NODE_RESOURCE_PREFIX, self.node_joined,
                                             self.node_left)
            await self._membership.start()

    async def _prepare(self, node: GpuNode, services: Collection[str] | None = None) -> None:
        """Prepare every instance of the node (of ``services`` only, when given): weights into its host memory; a
        failure names the service. With a disk tier, each tiered service's copy is written to disk once prepared,
        and the least recently prepared copies are dropped from host memory to make room for the next."""
        if node.tier is not None:
            await _check_disk_room(node, self.services)
        slots = [slot for slot in node.residency.slots.values() if services is None or slot.service in services]
        for done, slot in enumerate(slots, start=1):
            started = time.perf_counter()
            spec = self.services[slot.service]
            backend = node.backends[spec.backend]
            copy = node.tier.copies.get(spec.name) if node.tier is not None else None
            try:
                if node.tier is not None and copy is not None and copy.state is CopyState.DISK:  # its first instance
                    for victim in node.tier.plan_load(spec.name):
                        await backend.drop_host(self.services[victim.service])
                    await slot.instance.prepare()
                    await backend.spill(spec)
                    node.tier.loaded(spec.name)
                else:
                    await slot.instance.prepare()
            except ServiceError as error:
                raise ConfigError(f"gpu.services.{slot.service}", f"preparing it on node {node.name} GPUs "
                                                                  f"{list(slot.chunk.gpus)} failed: "
                                                                  f"{error.message}") from None
            log.info("node %s: prepared %s on GPUs %s (%d/%d, %.1f s)", node.name, slot.service,
                     list(slot.chunk.gpus), done, len(slots), time.perf_counter() - started)

    # -- services added at runtime (POST /v1/admin/reload) ------------------------------------------------------

    def reconfigure(self, new: GpuConfig) -> list[str]:
        """Admit the services that ``new`` adds to the running ones and start preparing them; returns their names.

        Every node's admission is run anew over all its services, old and new, and nothing changes unless every
        node admits them (``ConfigError`` naming the service or the node's budget, as at start). Any other change
        to ``[gpu]`` needs a restart (``Conflict`` naming the first changed field). The new services' actions get
        503 until each of their instances is prepared, on every node in service (a lost node prepares them when
        it comes back); a failed preparation is kept as their state, with its reason."""
        added = self._added_services(new)
        if not added:
            return []
        services = [*self.config.services, *added]
        admitted: dict[str, GpuNode] = {}
        for node in self.nodes.values():  # nothing is changed before every node admits them
            scratch = GpuNode(node.config, self._backends(node.config, services, node.backends))
            self._admit(scratch, services)
            admitted[node.name] = scratch
        names = [spec.name for spec in added]
        self.config = replace(self.config, services=tuple(services))
        for spec in added:
            self.services[spec.name] = spec
            self.preparing[spec.name] = "preparing"
        for node in self.nodes.values():
            scratch = admitted[node.name]
            node.backends.update(scratch.backends)
            node.services = scratch.services
            for slot in scratch.residency.slots.values():
                if slot.service in names:
                    node.residency.add(slot)
            if scratch.tier is not None:
                if node.tier is None:
                    node.tier = scratch.tier
                else:
                    node.tier.budget_mb = scratch.tier.budget_mb
                    node.tier.copies.update({name: copy for name, copy in scratch.tier.copies.items()
                                             if name in names})
        self.demand.bounds.update({spec.name: bound_of(spec.task) for spec in added})
        if self.live is not None:
            self.live.stale()
        task = asyncio.create_task(self._prepare_added(names), name="tangram-prepare-added-services")
        self._preparations.add(task)
        task.add_done_callback(self._preparations.discard)
        return names

    def _added_services(self, new: GpuConfig) -> list[ServiceSpec]:
        """The services ``new`` adds; ``Conflict`` naming the field for any other change (a restart's)."""
        sized = on_this_host(new)  # as the running config was
        for field in fields(GpuConfig):
            if field.name != "services" and getattr(sized, field.name) != getattr(self.config, field.name):
                changed = next((f"gpu.nodes.{a.name}" for a, b in zip(sized.nodes, self.config.nodes) if a != b),
                               "gpu.nodes") if field.name == "nodes" else f"gpu.{field.name}"
                raise Conflict(changed, "changes need a restart (a reload adds services only)")
        given = {spec.name: spec for spec in new.services}
        for name, spec in self.services.items():
            if given.get(name) != spec:
                raise Conflict(f"gpu.services.{name}", "changing or removing a running service needs a restart "
                                                       "(a reload adds services only)")
        return [spec for spec in new.services if spec.name not in self.services]

    async def _prepare_added(self, names: list[str]) -> None:
        """Prepare the added services' instances on every node in service; each service is served once done."""
        try:
            for node in self.nodes.values():
                if node.lost is None:
                    await self._prepare(node, names)
        except ConfigError as error:
            log.error("adding services %s: %s", names, error)
            for name in names:
                self.preparing[name] = f"failed: {error.key}: {error.reason}"
            return
        for name in names:
            del self.preparing[name]
        log.info("services %s prepared on every GPU node in service", names)

    # -- membership (nodes behind agents join, leave and come back with their Ray nodes) ----------------------

    async def node_left(self, name: str, reason: str) -> None:
        """Its Ray node is gone: new actions go elsewhere, actions that were on it end ``node_lost``, its GPUs
        leave the pool and its agents are let go (their device memory went with them)."""
        node = self.nodes.get(name)
        if node is None or node.lost is not None:
            return
        node.lose(reason)
        log.warning("GPU node %s lost: %s", name, reason)
        if self.live is not None:
            self.live.stale()
        for backend in node.backends.values():
            await backend.close()

    async def node_joined(self, name: str) -> None:
        """A Ray node carrying ``name``'s resource is alive: a new node joins if ``[gpu.join]`` lets nodes join;
        for a lost node, once the actions that were on it have ended, every instance is made afresh on new agents
        (prepared, nothing on the GPUs) and the node serves again."""
        node = self.nodes.get(name)
        if node is None and self.config.join is not None:
            await self._join(self.config.join.node(name))
            return
        if node is None or node.lost is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_all_free(node), SETTLE_S)
        try:
            for slot in node.residency.slots.values():
                if slot.holds_memory:
                    node.residency.unbook(slot)
                slot.state = SlotState.PREPARED
                await self._renew(node, slot)
        except ServiceError as error:
            log.warning("GPU node %s is back but not in service: %s", name, error.message)
            for backend in node.backends.values():  # let its new agents go; it stays lost
                await backend.close()
            return
        node.returned()
        if self.live is not None:
            self.live.stale()
        log.info("GPU node %s is back: %d instance(s) prepared", name, len(node.residency.slots))

    async def _join(self, node_config: GpuNodeConfig) -> None:
        """A new node behind agents: sized by its agent on its host, its services admitted and prepared, then in
        service. A node that cannot hold them is left out, with the reason logged."""
        backends = self._backends(node_config)
        try:
            agent = next((b for b in backends.values() if isinstance(b, AgentServiceBackend)), None)
            if agent is None:
                raise ConfigError("gpu.services", "no service to host")
            sized = await agent.node_on_its_host()  # as its agent holds it: with agent = false
            node = GpuNode(replace(sized, agent=True), backends)
            self._admit(node)
            await self._prepare(node)
        except (ServiceError, ConfigError) as error:
            log.warning("GPU node %s not joined: %s", node_config.name, error)
            for backend in backends.values():
                await backend.close()
            return
        self.nodes[node.name] = node
        if self.live is not None:
            self.live.stale()
        log.info("GPU node %s joined: %d GPU(s) of %d MiB, %d MiB of host memory", node.name, node.config.gpus,
                 node.config.gpu_memory_mb, node.config.host_memory_mb)

    async def close(self) -> None:
        if self.live is not None:
            self.live.close()
        for task in list(self._preparations):
            task.cancel()
        await asyncio.gather(*self._preparations, return_exceptions=True)
        if self._membership is not None:
            await self._membership.stop()
        for node in self.nodes.values():
            await asyncio.gather(*node.loads.values())  # loads never raise
            if node.lost is not None:  # its agents were let go with it
                continue
            results = await asyncio.gather(*(slot.instance.close() for slot in node.residency.slots.values()),
                                           return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    log.warning("closing a service instance on %s failed: %r", node.name, result)
            for backend in node.backends.values():
                await backend.close()

    def plugins(self) -> CyclePlugins:
        return CyclePlugins(setup_costs=self.setup_costs, foresight=self, watchers=(self.demand,))

    def register_metrics(self, registry: MetricsRegistry) -> None:
        labels = ["node", "service", "dop"]
        self.restores = Counter("tangram_gpu_restores", "Service restores from host memory to GPUs", labels,
                                registry=None)
        self.evictions = Counter("tangram_gpu_evictions", "Services evicted from GPUs (host copy kept)", labels,
                                 registry=None)
        self.restore_seconds = Histogram("tangram_gpu_restore_seconds", "Time to restore a service to its GPUs",
                                         labels, buckets=RESTORE_SECONDS, registry=None)
        self.disk.host_loads = Counter(
            "tangram_gpu_host_loads", "Host copies loaded from the disk tier, by what asked (a restore waiting for it, "
            "or prefetch)", ["node", "service", "cause"], registry=None)
        self.restore_stage_seconds = Histogram(
            "tangram_gpu_restore_stage_seconds", "A restore's stages: disk_to_host (the time it waited for its "
            "host copy to load from the disk tier) and host_to_gpu", ["node", "service", "stage"],
            buckets=RESTORE_SECONDS, registry=None)
        for metric in (self.restores, self.evictions, self.restore_seconds, self.disk.host_loads,
                       self.restore_stage_seconds):
            registry.register(metric)
        if self.live is not None:
            registry.register(PlacementCollector(self.live))

    # -- the scheduler's view -------------------------------------------------------------------------------

    @property
    def resources(self) -> Mapping[str, int]:
        return {RESOURCE: sum(node.config.gpus for node in self.nodes.values() if node.lost is None)}

    def largest_pool(self, resource: str) -> int:
        return max((chunk.size for node in self.nodes.values() for chunk in node.chunks.tiles), default=0)

    def place_services(self, allowed: Mapping[str, Collection[str]] | None = None) -> None:
        """Confine each service's reward actions to the nodes named for it (a placement's variants,
        ``managers/gpu/placement.py``); ``None``, the default, lets every service run on every node. An empty or
        missing entry, or one naming no node in service (unknown or lost), also means every node: a placement can
        slow a service down but never leave it unservable. Only where new actions start changes: instances
        resident elsewhere stay until evicted, and a resident instance on a node outside counts for nothing."""
        self.allowed = {service: frozenset(nodes) for service, nodes in (allowed or {}).items() if nodes}

    def may_run(self, service: str, node: GpuNode) -> bool:
        """Whether ``service``'s actions may start on ``node`` (``place_services``)."""
        allowed = self.allowed.get(service)
        if allowed is None or node.name in allowed:
            return True
        return not any(self.nodes[name].lost is None for name in allowed if name in self.nodes)

    def fit(self) -> GpuFit:
        self.disk.new_pass()
        self.waits.new_pass()
        if self.live is not None:
            self.live.poll((ServiceFigures(spec.name, spec.host_memory_mb, spec.gpu_memory_mb, bound_of(spec.task))
                            for name, spec in self.services.items() if name not in self.preparing),
                           [node.config for node in self.nodes.values() if node.lost is None], self.config.types,
                           self.place_on_types)
        return GpuFit(self)

    def place_on_types(self, types: Mapping[str, Iterable[str]]) -> None:
        """Apply a placement (``place_services``): each service named to the nodes of the types (node groups) it
        has a variant on."""
        kinds = {service: set(names) for service, names in types.items()}
        self.place_services({service: [name for name, node in self.nodes.items() if node.config.type in mine]
                             for service, mine in kinds.items()})

    def _node_type(self, name: str) -> str | None:
        node = self.nodes.get(name)
        return node.config.type if node is not None else None

    def expected_s(self, service: str, node: GpuNode, k: int, resident: bool) -> float:
        """Seconds an action of ``service`` on ``k`` of ``node``'s GPUs is expected to take: its restore unless
        resident (scaled by the type's host-to-device rate), plus its run time there (``ServiceDemand``)."""
        types = self.config.types
        kind = node.config.type
        restore = 0.0 if resident else self.restore_time.estimate(service) * restore_factor(
            types[kind], types[REFERENCE_TYPE])
        return restore + self.demand.gpu_s(service, kind) / k

    def validate(self, action: Action) -> None:
        if action.kind is not Kind.REWARD:
            return
        name = self._parse(action).service
        state = self.preparing.get(name)
        if state is not None:
            raise Unavailable("spec.service", f"service {name!r} was added at runtime and is not served yet "
                                              f"({state}); retry", retry_after_s=5)
        serving = [node for node in self.nodes.values() if name in node.services]
        if all(node.lost is not None for node in serving):
            why = "; ".join(f"{node.name}: {node.lost}" for node in serving) or "none has joined yet"
            raise Unavailable("spec.service", f"no GPU node of service {name!r} is in service now ({why}); retry "
                                              f"once one is", retry_after_s=5)

    def _parse(self, action: Action) -> RewardRequest:
        """The reward spec checked against its service; kept on the action."""
        body = parse_reward_spec(action.spec)
        name = body.service
        spec = self.services.get(name)
        if spec is None:
            raise NotFound("spec.service", f"no reward service {name!r}; this broker serves {sorted(self.services)}")
        demand = action.demands.get(RESOURCE)
        if demand is None:
            raise Unprocessable("demand.gpu", f'reward actions run on GPUs: add "gpu": {spec.dops[0]} (or a set '
                                              f'such as {{"choices": {list(spec.dops)}}}) to demand')
        unsupported = [k for k in demand.choices if k not in spec.dops]
        if unsupported:
            raise Unprocessable("demand.gpu", f"service {name!r} runs at DoP {list(spec.dops)}, not {unsupported}")
        try:
            request = parse_reward_input(spec.task, body.input, self.config.limits)
        except BadRequest as error:  # the document allows any object: the service's task decides its fields
            raise Unprocessable(error.field, f"{error.reason} (input for a {spec.task} service)") from None
        action.parsed_spec = RewardRequest(name, request)
        return action.parsed_spec

    def setup_costs(self, actions: Sequence[Action]) -> dict[str, float]:
        """A reward action's setup: nothing when an instance of its service is resident, at a DoP it accepts, on
        free GPUs of a node in service that it may run on (it can start without a switch), else the service's
        expected restore."""
        ready = {(slot.service, slot.chunk.size) for node in self.nodes.values() if node.lost is None
                 for slot in node.residency.slots.values() if slot.state is SlotState.RESIDENT
                 and any(free.contains(slot.chunk) for free in node.chunks.free) and self.may_run(slot.service, node)}
        costs = {}
        of: dict[tuple[str, tuple[int, ...]], float] = {}  # many queued actions ask the same
        for action in actions:
            if action.kind is not Kind.REWARD or RESOURCE not in action.demands:
                continue
            key = (self.reward_request(action).service, action.demands[RESOURCE].choices)
            if key not in of:
                of[key] = 0.0 if any((key[0], k) in ready for k in key[1]) else self.restore_time.estimate(key[0])
            if of[key]:
                costs[action.id] = of[key]
        return costs

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
        rewards = (action for action in upcoming if action.kind is Kind.REWARD)
        return self.disk.prefetch_plan(self.reward_request(action).service
                                       for action in itertools.islice(rewards, PREFETCH_LOOKAHEAD))

    def next_change_in(self) -> float | None:
        return self.waits.next_change_in()

    def reward_request(self, action: Action) -> RewardRequest:
        """The action's spec as checked at submit (parsed here first for an action recovered from the store)."""
        if isinstance(action.parsed_spec, RewardRequest):
            return action.parsed_spec
        return self._parse(action)

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
        rows = []
        for node in self.nodes.values():
            resident = [slot.to_json() for slot in node.residency.slots.values() if slot.holds_memory]
            rows.append(PoolStatus(RESOURCE, node.name, node.config.gpus, node.config.gpus - node.chunks.free_gpus,
                                   extra={"device_type": node.config.device_type, "lost": node.lost,
                                          "free_chunks": sorted([c.start, c.size] for c in node.chunks.free),
                                          "gpu_memory_mb": node.config.gpu_memory_mb,
                                          "gpu_memory_booked_mb": list(node.residency.used_mb),
                                          "resident": resident,
                                          "host_tier": node.tier.to_json() if node.tier is not None else None}))
        return rows

    def describe_services(self) -> list[dict[str, Any]]:
        """``GET /v1/services``: every service, where it can run and where it is resident, its run GPU-seconds per
        action on each type it ran on, and its part of the placement in force."""
        learned = self.demand.learned()
        out = []
        for spec in self.services.values():
            slots = [slot for node in self.nodes.values() for slot in node.residency.slots.values()
                     if slot.service == spec.name]
            out.append({"name": spec.name, "state": self.preparing.get(spec.name, "serving"),
                        "backend": spec.backend, "model": spec.model, "task": spec.task,
                        "dops": list(spec.dops), "gpu_memory_mb": spec.gpu_memory_mb,
                        "host_memory_mb": spec.host_memory_mb,
                        "nodes": sorted(n.name for n in self.nodes.values() if spec.name in n.services),
                        "instances": len(slots),
                        "host_copies": {n.name: n.tier.copies[spec.name].state.value for n in self.nodes.values()
                                        if n.tier is not None and spec.name in n.tier.copies},
                        "resident": [{"node": n.name, **s.to_json()} for n in self.nodes.values()
                                     for s in n.residency.slots.values()
                                     if s.service == spec.name and s.state is SlotState.RESIDENT],
                        "run_gpu_s": {kind: round(gpu_s, 6) for kind, gpu_s in learned.get(spec.name, {}).items()},
                        **({"placement": self.live.describe(spec.name)} if self.live is not None else {})})
        return out

    def describe_placement(self) -> dict[str, Any] | None:
        """The placement in force (``GET /v1/resources``, the status page, ``tangram status``); None when the
        manager solves none (``[gpu] placement``)."""
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
        restore_s, load_s = await self._make_resident(node, slot, evicted, where)
        action.restore_s = restore_s
        node.residency.touch(slot)
        try:
            result = await slot.instance.infer(request)
        except ServiceError as error:
            if error.code in GONE:
                slot.state = SlotState.BROKEN
            raise await self._failure(node, error, where) from None
        return Outcome({**result, **where, "restored": restore_s > 0, "restore_s": round(restore_s, 6),
                        "load_s": round(load_s, 6), "evicted": evicted})

    async def _make_resident(self, node: GpuNode, slot: Slot, evicted: list[dict[str, Any]],
                             where: dict[str, Any]) -> tuple[float, float]:
        """Restore ``slot`` unless resident, evicting LRU instances on its GPUs; returns the seconds it took and,
        of those, the seconds it waited for its host copy to load from the disk tier."""
        if slot.state is SlotState.RESIDENT:
            return 0.0, 0.0
        started = time.perf_counter()
        revive = slot.state is SlotState.BROKEN
        if revive:  # its device state is unknown: start it afresh
            node.residency.unbook(slot)
        try:
            victims = node.residency.plan_restore(slot)
        except RuntimeError as error:  # memory booked by broken instances on other chunks
            slot.state = SlotState.BROKEN if revive else SlotState.PREPARED
            if revive:
                node.residency.book(slot)
            raise ActionFailed("gpu_memory_unavailable", str(error), **where) from None
        for victim, was_broken in victims:
            victim.eviction = asyncio.create_task(self._evict(node, victim, was_broken),
                                                  name=f"tangram-evict-{victim.service}")
            evicted.append({"service": victim.service, "gpus": list(victim.chunk.gpus)})
        began_restore = pinned = False
        try:
            await asyncio.gather(*node.residency.pending_evictions(slot.chunk))
            stuck = [v for v, _ in victims if v.state is SlotState.BROKEN]
            if stuck:
                raise ActionFailed("evict_failed", f"evicting {stuck[0].service} from GPUs "
                                                   f"{list(stuck[0].chunk.gpus)} failed; see the broker's log",
                                   **where)
            load_s = await self.disk.host_copy(node, slot.service, where)
            pinned = True
            began_restore = True
            if revive:
                await self._renew(node, slot)
            await slot.instance.restore()
        except ServiceError as error:
            slot.state = SlotState.BROKEN
            raise await self._failure(node, error, where) from None
        except BaseException:
            if began_restore:
                slot.state = SlotState.BROKEN  # a restore cut short leaves the devices in an unknown state
            else:
                node.residency.unbook(slot)
                slot.state = SlotState.PREPARED
            raise
        finally:
            if pinned:
                self.disk.unpin(node, slot.service)
        node.residency.restored(slot)
        elapsed = time.perf_counter() - started
        self.restore_time.observe(slot.service, elapsed)  # its evictions' wait included: what a switch costs
        labels = (node.name, slot.service, str(slot.chunk.size))
        if self.restores is not None and self.restore_seconds is not None and self.restore_stage_seconds is not None:
            self.restores.labels(*labels).inc()
            self.restore_seconds.labels(*labels).observe(elapsed)
            if load_s:
                self.restore_stage_seconds.labels(node.name, slot.service, "disk_to_host").observe(load_s)
            self.restore_stage_seconds.labels(node.name, slot.service, "host_to_gpu").observe(elapsed - load_s)
        return elapsed, load_s

    async def _failure(self, node: GpuNode, error: ServiceError, where: dict[str, Any]) -> ActionFailed:
        """The action's failure: ``node_lost`` with the node's reason when its agent stopped answering because
        the node is lost, or is declared so soon (``NodeStanding.lost_within``); otherwise the instance's own
        error."""
        if error.code in GONE and node.config.agent and (lost := await node.lost_within()) is not None:
            return ActionFailed("node_lost", f"GPU node {node.name} is lost: {lost}", **where)
        return ActionFailed(error.code, error.message, **where)

    async def _evict(self, node: GpuNode, slot: Slot, was_broken: bool) -> None:
        """Free a victim's GPU memory; a broken one is closed and made afresh. Never raises: the restoring
        action sees a victim left broken and fails instead of restoring onto memory that is not free."""
        try:
            if was_broken:
                await self._renew(node, slot)
            else:
                await slot.instance.evict()
            node.residency.evicted(slot)
            if self.evictions is not None:
                self.evictions.labels(node.name, slot.service, str(slot.chunk.size)).inc()
        except Exception as error:  # noqa: BLE001 - any failure leaves the memory in doubt
            log.error("node %s: evicting %s from GPUs %s failed: %r", node.name, slot.service,
                      list(slot.chunk.gpus), error)
            slot.state = SlotState.BROKEN
            node.residency.book(slot)

    async def _renew(self, node: GpuNode, slot: Slot) -> None:
        """Close an instance whose device state is unknown and prepare a new one on the same chunk."""
        with contextlib.suppress(Exception):
            await slot.instance.close()
        spec = self.services[slot.service]
        backend = node.backends[spec.backend]
        slot.instance = backend.instance(spec, slot.chunk.gpus)
        await slot.instance.prepare()
        copy = node.tier.copies.get(spec.name) if node.tier is not None else None
        if copy is not None and copy.state is CopyState.DISK:  # prepared from the model anew: back to disk
            await backend.drop_host(spec)


async def _check_disk_room(node: GpuNode, services: Mapping[str, ServiceSpec]) -> None:
    """The disk tier's directory can hold every tiered service's file (ConfigError naming it otherwise), as the
    backends that write them see it (on the node's own host, for a node behind an agent)."""
    tier = node.tier
    assert tier is not None
    where = f"gpu.nodes.{node.name}.disk_dir"
    by_backend: dict[str, list[str]] = {}
    for name in tier.copies:
        by_backend.setdefault(services[name].backend, []).append(name)
    for kind, names in by_backend.items():
        try:
            free_mb = await node.backends[kind].disk_room_mb(names)
        except ServiceError as error:
            raise ConfigError(where, error.message) from None
        need_mb = sum(tier.copies[name].size_mb for name in names)
        if need_mb > free_mb:
            raise ConfigError(where, f"{node.config.disk_dir} has {free_mb} MiB free; the host copies of "
                                     f"{sorted(names)} need {need_mb} MiB")


async def _all_free(node: GpuNode) -> None:
    """Until no action holds any of the node's GPUs."""
    while node.chunks.free_gpus < node.config.gpus:
        await asyncio.sleep(0.1)


def _chunks_of(gpus: int, k: int) -> list[Chunk]:
    """Every aligned chunk of ``k`` GPUs inside a node's tiles."""
    allocator = ChunkAllocator(gpus)
    return [Chunk(start, k) for tile in allocator.tiles if tile.size >= k
            for start in range(tile.start, tile.start + tile.size, k)]
