"""Instances made ready to serve from host memory: a node's services prepared (weights into its host memory, a
tiered service's copy written to the disk tier), and an instance whose device state is unknown made afresh."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Collection, Mapping

from managers.gpu.host_tier import CopyState
from managers.gpu.node import GpuNode
from managers.gpu.slot import Slot
from reward_services.backend import ServiceError, ServiceSpec
from tangram.core.errors import ConfigError

log = logging.getLogger("tangram.gpu")


async def prepare_instances(node: GpuNode, services: Mapping[str, ServiceSpec],
                            only: Collection[str] | None = None) -> None:
    """Prepare every instance of the node (of the services in ``only``, when given): weights into its host memory;
    a failure names the service. With a disk tier, each tiered service's copy is written to disk once prepared, and
    the least recently prepared copies are dropped from host memory to make room for the next."""
    if node.tier is not None:
        await check_disk_room(node, services)
    slots = [slot for slot in node.residency.slots.values() if only is None or slot.service in only]
    for done, slot in enumerate(slots, start=1):
        started = time.perf_counter()
        spec = services[slot.service]
        backend = node.backends[spec.backend]
        copy = node.tier.copies.get(spec.name) if node.tier is not None else None
        try:
            if node.tier is not None and copy is not None and copy.state is CopyState.DISK:  # its first instance
                for victim in node.tier.plan_load(spec.name):
                    await backend.drop_host(services[victim.service])
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


async def check_disk_room(node: GpuNode, services: Mapping[str, ServiceSpec]) -> None:
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


async def renew(node: GpuNode, slot: Slot, spec: ServiceSpec) -> None:
    """Close an instance whose device state is unknown and prepare a new one on the same chunk."""
    with contextlib.suppress(Exception):
        await slot.instance.close()
    backend = node.backends[spec.backend]
    slot.instance = backend.instance(spec, slot.chunk.gpus)
    await slot.instance.prepare()
    copy = node.tier.copies.get(spec.name) if node.tier is not None else None
    if copy is not None and copy.state is CopyState.DISK:  # prepared from the model anew: back to disk
        await backend.drop_host(spec)
