"""A switch carried out (evict-on-execution, §5.3): the instances that ``plan_switch`` chose are evicted, the
service's host copy is had from the disk tier if it is there, and the service is restored onto its chunk; then
the restore is learned and counted. A failure leaves each instance in a state the next switch can trust."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from managers.gpu.disk_tier import DiskTier
from managers.gpu.metrics import SwitchMetrics
from managers.gpu.node import GpuNode
from managers.gpu.preparation import renew
from managers.gpu.slot import Slot, SlotState
from managers.gpu.switch_plan import SwitchBlocked, plan_switch
from reward_services.backend import GONE, ServiceError, ServiceSpec
from tangram.core.errors import ActionFailed
from tangram.core.learned import LearnedSeconds

log = logging.getLogger("tangram.gpu")


class ResidencySwitch:
    """Makes services resident on the chunks their actions hold."""

    def __init__(self, services: Mapping[str, ServiceSpec], disk: DiskTier, restore_time: LearnedSeconds) -> None:
        self._services = services
        self._disk = disk
        self._restore_time = restore_time
        #: set once the broker registers the manager's metrics
        self.metrics: SwitchMetrics | None = None

    async def make_resident(self, node: GpuNode, slot: Slot, evicted: list[dict[str, Any]],
                            where: dict[str, Any]) -> tuple[float, float]:
        """Restore ``slot`` unless resident, evicting LRU instances on its GPUs (each added to ``evicted``); returns
        the seconds it took and, of those, the seconds it waited for its host copy to load from the disk tier."""
        if slot.state is SlotState.RESIDENT:
            return 0.0, 0.0
        started = time.perf_counter()
        try:
            plan = plan_switch(node.residency, slot)
        except SwitchBlocked as error:  # memory booked by broken instances on other chunks
            if slot.state is not SlotState.BROKEN:
                slot.state = SlotState.PREPARED
            raise ActionFailed("gpu_memory_unavailable", str(error), **where) from None
        node.residency.commit(plan)
        victims = plan.victims
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
            load_s = await self._disk.host_copy(node, slot.service, where)
            pinned = True
            began_restore = True
            if plan.renew:
                await renew(node, slot, self._services[slot.service])
            await slot.instance.restore()
        except ServiceError as error:
            slot.state = SlotState.BROKEN
            raise await self.failure(node, error, where) from None
        except BaseException:
            if began_restore:
                slot.state = SlotState.BROKEN  # a restore cut short leaves the devices in an unknown state
            else:
                node.residency.unbook(slot)
                slot.state = SlotState.PREPARED
            raise
        finally:
            if pinned:
                self._disk.unpin(node, slot.service)
        node.residency.restored(slot)
        elapsed = time.perf_counter() - started
        self._restore_time.observe(slot.service, elapsed)  # its evictions' wait included: what a switch costs
        if self.metrics is not None:
            labels = (node.name, slot.service, str(slot.chunk.size))
            self.metrics.restores.labels(*labels).inc()
            self.metrics.restore_seconds.labels(*labels).observe(elapsed)
            if load_s:
                self.metrics.restore_stage_seconds.labels(node.name, slot.service, "disk_to_host").observe(load_s)
            self.metrics.restore_stage_seconds.labels(node.name, slot.service, "host_to_gpu").observe(elapsed - load_s)
        return elapsed, load_s

    async def failure(self, node: GpuNode, error: ServiceError, where: dict[str, Any]) -> ActionFailed:
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
                await renew(node, slot, self._services[slot.service])
            else:
                await slot.instance.evict()
            node.residency.evicted(slot)
            if self.metrics is not None:
                self.metrics.evictions.labels(node.name, slot.service, str(slot.chunk.size)).inc()
        except Exception as error:  # noqa: BLE001 - any failure leaves the memory in doubt
            log.error("node %s: evicting %s from GPUs %s failed: %r", node.name, slot.service,
                      list(slot.chunk.gpus), error)
            slot.state = SlotState.BROKEN
            node.residency.book(slot)
