"""The disk tier in the GPU manager's decisions (issue 18): prefetch, waiting for a node that holds a host copy,
and the loads themselves.

Each node's ``HostTier`` books its host memory; this module decides across nodes:

* **Locality.** The fit prefers a node holding the service's copy. When only nodes that would load it from disk
  have a free chunk, the action is deferred (``managers/gpu/delay_wait.py``) for up to one load's time, so a node's
  host memory keeps serving the services it holds instead of being churned by every placement.
* **Prefetch.** The services of the queued reward actions, in the order they will run, that no node holds are
  loaded ahead of their actions, on one node each (the fit sends their actions there), dropping only copies that
  no earlier queued action needs, and a service's last copy only after every other.
* **Loads.** A restore whose copy is on disk loads it (or waits for a prefetch under way); the copy is pinned while
  the restore reads it.

The simulator runs the same decisions (``prefetch_plan``, ``held``) and times the loads itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter

from managers.gpu.host_tier import CopyState, HostCopy, HostTierFull
from reward_services.backend import ServiceError, ServiceSpec
from tangram.core.action import Action, Kind
from tangram.core.errors import ActionFailed
from tangram.core.learned import LearnedSeconds

if TYPE_CHECKING:
    from managers.gpu.node import GpuNode

log = logging.getLogger("tangram.gpu")

#: ASSUMED: disk-to-host rate of a load from the disk tier before one was observed (MiB/s; scripts/gpu_check.py read
#: 0.95 GB/s from a cloud VM's virtual disk, a local NVMe drive reads 3-7 GB/s); observed loads replace it
LOAD_PRIOR_MB_PER_S = 1_000.0
#: weight of each observed load in a service's load estimate
LOAD_EWMA_ALPHA = 0.3
#: times a restore asks for its service's host copy when a load lands and the copy is dropped again before the
#: restore reads it (only when host memory is short for the restores starting at once)
HOST_COPY_ATTEMPTS = 3
#: queued reward actions whose services prefetch considers, in the order they will run
PREFETCH_LOOKAHEAD = 256


def queued_services(upcoming: Iterable[Action], service_of: Callable[[Action], str]) -> Iterator[str]:
    """The services prefetch plans for (``DiskTier.prefetch_plan``): those of the first ``PREFETCH_LOOKAHEAD``
    queued reward actions, in the order they will run."""
    rewards = (action for action in upcoming if action.kind is Kind.REWARD)
    return (service_of(action) for action in itertools.islice(rewards, PREFETCH_LOOKAHEAD))


class DiskTier:
    """The disk tier over a GPU manager's nodes (those with ``disk_dir``)."""

    def __init__(self, nodes: Mapping[str, GpuNode], services: Mapping[str, ServiceSpec],
                 may_run: Callable[[str, GpuNode], bool] = lambda service, node: True) -> None:
        self._nodes = nodes  # the manager's nodes, read live: nodes that join are seen
        self._services = services
        #: whether a service's actions may run on a node (``ServiceConfinement.may_run``): a copy elsewhere serves none
        self._may_run = may_run
        #: each service's expected load, from the loads seen: its host copy at the assumed rate until one is
        self.load_time = LearnedSeconds(lambda name: services[name].host_memory_mb / LOAD_PRIOR_MB_PER_S,
                                        LOAD_EWMA_ALPHA)
        #: ``_holders`` for this pass
        self._held: dict[str, set[str]] | None = None
        self.host_loads: Counter | None = None

    @property
    def active(self) -> bool:
        return any(node.tier is not None for node in self._nodes.values())

    def _holders(self) -> dict[str, set[str]]:
        """For each tiered service, the nodes in service that it may run on whose host memory holds its copy (or is
        loading it), or whose GPUs do. Read once per pass (nothing changes during one), and by each prefetch
        plan."""
        if self._held is None:
            self._held = {}
            for node in self._nodes.values():
                if node.lost is None and node.tier is not None:
                    resident = node.resident_services()
                    for service in node.tier.copies:
                        if (node.tier.holds(service) or service in resident) and self._may_run(service, node):
                            self._held.setdefault(service, set()).add(node.name)
        return self._held

    def _sole_copies(self, node: GpuNode) -> set[str]:
        """The services that no node in service but ``node`` holds."""
        return {service for service, names in self._holders().items() if names == {node.name}}

    # -- decisions --------------------------------------------------------------------------------------------

    def new_pass(self) -> None:
        """A scheduling pass begins: where the copies are is read anew."""
        self._held = None

    def held(self, service: str) -> bool:
        """Whether some node in service that ``service`` may run on holds its copy (in host memory, loading, or on
        its GPUs)."""
        return bool(self._holders().get(service))

    def prefetch_plan(self, upcoming: Iterable[str]) -> list[tuple[GpuNode, str, list[HostCopy]]]:
        """Loads to start now, booked: each service of ``upcoming`` (those of the queued reward actions, in the
        order they will run) that no node holds, on the node with the most free GPUs among those with no load in
        flight that can make room without dropping a copy that an earlier service of ``upcoming`` needs."""
        nodes = [node for node in self._nodes.values() if node.tier is not None and node.lost is None]
        self._held = None  # loads landed since the pass
        plans = []
        ahead: list[str] = []
        for service in dict.fromkeys(upcoming):
            serving = [node for node in nodes if node.tier is not None and service in node.tier.copies
                       and self._may_run(service, node)]
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
