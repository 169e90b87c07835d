"""The disk tier in the GPU manager's decisions (issue 18): prefetch, waiting for a node that holds a host copy,
and the loads themselves.

Each node's ``HostTier`` books its host memory; this module decides across nodes:

* **Locality.** The fit prefers a node holding the service's copy. When only nodes that would load it from disk
  have a free chunk, the action is deferred (delay scheduling): the actions behind it go first, and one whose
  service that node holds takes the chunk without a load. A chunk that nobody takes goes to a deferred action
  once it has waited one load's time since it was first deferred: so waiting costs an action at most what the
  load would, and a node's host memory keeps serving the services it holds instead of being churned by every
  placement.
* **Prefetch.** The services of the queued reward actions, in the order they will run, that no node holds are
  loaded ahead of their actions, on one node each (the fit sends their actions there), dropping only copies that
  no earlier queued action needs, and a service's last copy only after every other.
* **Loads.** A restore whose copy is on disk loads it (or waits for a prefetch under way); the copy is pinned while
  the restore reads it.

The simulator runs the same decisions (``prefetch_plan``, ``worth_waiting``) and times the loads itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter

from managers.host_tier import CopyState, HostCopy, HostTierFull
from reward_services.backend import ServiceError, ServiceSpec
from tangram.core.action import Action
from tangram.core.errors import ActionFailed
from tangram.core.learned import LearnedSeconds

if TYPE_CHECKING:
    from managers.gpu import GpuNode

log = logging.getLogger("tangram.gpu")

#: ASSUMED: disk-to-host rate of a load from the disk tier before one was observed (MiB/s; scripts/gpu_check.py read
#: 0.95 GB/s from a cloud VM's virtual disk, a local NVMe drive reads 3-7 GB/s); observed loads replace it
LOAD_PRIOR_MB_PER_S = 1_000.0
#: weight of each observed load in a service's load estimate
LOAD_EWMA_ALPHA = 0.3
#: times a restore asks for its service's host copy when a load lands and the copy is dropped again before the
#: restore reads it (only when host memory is short for the restores starting at once)
HOST_COPY_ATTEMPTS = 3
#: an action no pass deferred for this long is forgotten (placed, cancelled or failed)
FORGET_WAIT_S = 600.0


class DiskTier:
    """The disk tier over a GPU manager's nodes (those with ``disk_dir``)."""

    def __init__(self, nodes: Mapping[str, GpuNode], services: Mapping[str, ServiceSpec],
                 clock: Callable[[], float]) -> None:
        self._nodes = nodes  # the manager's own mapping: nodes that join are seen
        self._services = services
        self._clock = clock
        #: each service's expected load, from the loads seen: its host copy at the assumed rate until one is
        self.load_time = LearnedSeconds(lambda name: services[name].host_memory_mb / LOAD_PRIOR_MB_PER_S,
                                        LOAD_EWMA_ALPHA)
        #: actions waiting for a node holding their copy: since when, and when a pass last deferred them
        self._waiting: dict[str, tuple[float, float]] = {}
        #: when the first action deferred by the last pass may load its copy on a new node
        self._wait_until: float | None = None
        #: ``_holders`` for this pass
        self._held: dict[str, set[str]] | None = None
        self.host_loads: Counter | None = None

    @property
    def active(self) -> bool:
        return any(node.tier is not None for node in self._nodes.values())

    def _holders(self) -> dict[str, set[str]]:
        """For each tiered service, the nodes in service whose host memory holds its copy (or is loading it), or
        whose GPUs do. Read once per pass (nothing changes during one), and by each prefetch plan."""
        if self._held is None:
            self._held = {}
            for node in self._nodes.values():
                if node.lost is None and node.tier is not None:
                    resident = node.resident_services()
                    for service in node.tier.copies:
                        if node.tier.holds(service) or service in resident:
                            self._held.setdefault(service, set()).add(node.name)
        return self._held

    def _sole_copies(self, node: GpuNode) -> set[str]:
        """The services that no node in service but ``node`` holds."""
        return {service for service, names in self._holders().items() if names == {node.name}}

    # -- decisions --------------------------------------------------------------------------------------------

    def new_pass(self) -> None:
        """A scheduling pass begins; actions no pass deferred for ``FORGET_WAIT_S`` are forgotten (gone)."""
        now = self._clock()
        if any(now - seen > FORGET_WAIT_S for _, seen in self._waiting.values()):
            self._waiting = {key: value for key, value in self._waiting.items() if now - value[1] <= FORGET_WAIT_S}
        self._wait_until = None
        self._held = None

    def worth_waiting(self, action: Action, service: str, relaxed: bool) -> bool:
        """Whether ``action``, placeable now only on nodes that would load its service from disk, waits for a node
        that holds the copy. While some node does: always in a pass's first round (the actions behind it may use
        the free chunk without a load); in its second (``relaxed``: the chunk would stay idle otherwise) until it
        has waited one load's time since the first pass that deferred it, so waiting costs it at most what the
        load would."""
        if not self._holders().get(service):
            self._waiting.pop(action.id, None)
            return False
        now = self._clock()
        since = self._waiting.get(action.id, (now, now))[0]
        until = since + self.load_time.estimate(service)
        if relaxed and now >= until:
            self._waiting.pop(action.id, None)
            return False
        self._waiting[action.id] = (since, now)
        if until > now:  # past it, the action waits for a chunk like any other (and its release wakes a pass)
            self._wait_until = min(until, self._wait_until or until)
        return True

    def next_change_in(self) -> float | None:
        """Until the first action deferred by the last pass may take an idle chunk on a new node (a pass then
        places it, even if nothing else happens by then)."""
        return None if self._wait_until is None else max(0.0, self._wait_until - self._clock())

    def prefetch_plan(self, upcoming: Iterable[str]) -> list[tuple[GpuNode, str, list[HostCopy]]]:
        """Loads to start now, booked: each service of ``upcoming`` (those of the queued reward actions, in the
        order they will run) that no node holds, on the node with the most free GPUs among those with no load in
        flight that can make room without dropping a copy that an earlier service of ``upcoming`` needs."""
        nodes = [node for node in self._nodes.values() if node.tier is not None and node.lost is None]
        self._held = None  # loads landed since the pass
        plans = []
        ahead: list[str] = []
        for service in dict.fromkeys(upcoming):
            serving = [node for node in nodes if node.tier is not None and service in node.tier.copies]
            if serving and not self._holders().get(service):
                for node in sorted(serving, key=lambda node: -node.chunks.free_gpus):
                    assert node.tier is not None
                    if node.tier.loading:
                        continue
                    with contextlib.suppress(HostTierFull):
                        plans.append((node, service, node.tier.plan_load(service, keep=ahead,
                                                                         spare=self._sole_copies(node))))
                        self._held = None  # the plan dropped copies
                        break
            ahead.append(service)
        return plans

    # -- steps ------------------------------------------------------------------------------------------------

    async def host_copy(self, node: GpuNode, service: str, where: dict[str, Any]) -> float:
        """Have ``service``'s host copy in ``node``'s host memory, pinned for a restore (``unpin`` after; a no-op
        for an untiered service); returns the seconds spent waiting for it to load (its own load, or one under
        way)."""
        tier = node.tier
        if tier is None or service not in tier.copies:
            return 0.0
        started = time.perf_counter()
        waited = False
        for _ in range(HOST_COPY_ATTEMPTS):
            copy = tier.copies[service]
            if copy.state is CopyState.HOST:
                tier.pin(service)
                return time.perf_counter() - started if waited else 0.0
            if copy.state is CopyState.DISK:
                try:
                    victims = self.plan_restore_load(node, service)
                except HostTierFull as full:
                    raise ActionFailed("host_memory_unavailable", str(full), **where) from None
                self.start_load(node, service, victims, "restore")
            error = await asyncio.shield(node.loads[service])
            waited = True
            if error is not None:
                raise ActionFailed("restore_failed", error, **where)
        raise ActionFailed("host_memory_unavailable", f"{service}'s host copy was dropped {HOST_COPY_ATTEMPTS} times "
                                                      f"before its restore could read it: node {node.name}'s host "
                                                      f"memory is short for the restores starting at once", **where)

    def plan_restore_load(self, node: GpuNode, service: str) -> list[HostCopy]:
        """Book the load a restore of ``service`` on ``node`` needs: least recently used copies go first, a
        service's last copy only after every other (``HostTier.plan_load``); raises ``HostTierFull``."""
        assert node.tier is not None
        self._held = None  # read anew: restores run between passes
        return node.tier.plan_load(service, spare=self._sole_copies(node))

    @staticmethod
    def unpin(node: GpuNode, service: str) -> None:
        if node.tier is not None:
            node.tier.unpin(service)

    def start_load(self, node: GpuNode, service: str, victims: list[HostCopy], cause: str) -> None:
        """Run a load that ``HostTier.plan_load`` booked; ``cause`` (restore, prefetch) labels the metric."""
        node.loads[service] = asyncio.create_task(self._load(node, service, victims, cause),
                                                  name=f"tangram-load-{service}")

    async def _load(self, node: GpuNode, service: str, victims: list[HostCopy], cause: str) -> str | None:
        """Drop ``victims``' host copies, then load ``service``'s from disk; returns None, or the error's message
        (the copy is back on disk). Never raises: a prefetch's load is awaited by nobody."""
        assert node.tier is not None
        spec = self._services[service]
        backend = node.backends[spec.backend]
        try:
            for victim in victims:
                await backend.drop_host(self._services[victim.service])
            started = time.perf_counter()
            await backend.load_host(spec)
            self.load_time.observe(service, time.perf_counter() - started)
        except Exception as error:  # noqa: BLE001 - whatever it is, the copy is not in host memory
            node.tier.load_failed(service)
            message = error.message if isinstance(error, ServiceError) else f"{type(error).__name__}: {error}"
            log.warning("node %s: loading %s's host copy from disk failed: %s", node.name, service, message)
            return message
        node.tier.loaded(service)
        if self.host_loads is not None:
            self.host_loads.labels(node.name, service, cause).inc()
        return None
