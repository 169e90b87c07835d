"""A node's admission of reward services: each service's GPU memory and host copies checked against what the node
lends, then a slot for it on every chunk of each DoP it supports (nothing on the GPUs yet)."""

from __future__ import annotations

from collections.abc import Sequence

from managers.gpu.chunks import Chunk, ChunkAllocator
from managers.gpu.host_tier import HostTier
from managers.gpu.node import GpuNode
from managers.gpu.slot import Slot
from reward_services.backend import ServiceSpec
from tangram.core.errors import ConfigError


def admit(node: GpuNode, services: Sequence[ServiceSpec]) -> None:
    """Refuse, naming the service and the figures, any service whose host copies or per-GPU memory would exceed the
    node's budget; give each admitted service a slot on every chunk of each DoP it supports. Services are admitted
    in order. With a disk tier, the copies of services whose backend can spill share what the others leave of the
    budget (each must fit it whole: a restore reads it from host memory)."""
    held: list[tuple[str, int]] = []
    tiered: list[tuple[str, int]] = []
    for spec in services:
        where = f"gpu.services.{spec.name}"
        if spec.gpu_memory_mb > node.config.gpu_memory_mb:
            raise ConfigError(f"{where}.gpu_memory_mb", f"{spec.gpu_memory_mb} MiB per GPU is more than node "
                                                        f"{node.name} lends ({node.config.gpu_memory_mb} MiB)")
        chunks = [c for k in spec.dops for c in chunks_of(node.config.gpus, k)]
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


def chunks_of(gpus: int, k: int) -> list[Chunk]:
    """Every aligned chunk of ``k`` GPUs inside a node's tiles."""
    allocator = ChunkAllocator(gpus)
    return [Chunk(start, k) for tile in allocator.tiles if tile.size >= k
            for start in range(tile.start, tile.start + tile.size, k)]
