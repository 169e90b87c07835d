"""The GPU placement's input (``managers/gpu/placement.py``): each service's load and sizes and the node groups, the
same as arrays for the solvers, and the figures every method computes on them (``t``, the shares)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from managers.gpu.gpu_types import GPU_TYPES, REFERENCE_TYPE, Bound, GpuType, fits, speed

Matrix = NDArray[np.float64]
#: (service, group) -> times faster than on the reference type
Speeds = Mapping[tuple[str, str], float]


@dataclass(frozen=True)
class ServiceLoad:
    """What the placement needs of one service."""

    name: str
    load: float  # GPU-seconds per second it needs on the reference type
    host_memory_mb: float  # one host copy of its weights
    gpu_memory_mb: float  # per GPU of one instance
    bound: Bound = "compute"


@dataclass(frozen=True)
class NodeGroup:
    """The nodes of one GPU type."""

    name: str
    kind: GpuType
    gpus: int  # over all its nodes
    host_memory_mb: float  # per node (the smallest node's): every node holds the host copies of the variants


class TypedNode(Protocol):
    """What ``node_groups`` reads of a node's config (``GpuNodeConfig``)."""

    @property
    def type(self) -> str: ...
    @property
    def gpus(self) -> int: ...
    @property
    def gpu_memory_mb(self) -> int: ...
    @property
    def host_memory_mb(self) -> int: ...


def node_groups(nodes: Iterable[TypedNode], types: Mapping[str, GpuType]) -> tuple[NodeGroup, ...]:
    """Nodes (sized, as ``on_this_host`` leaves them) grouped by type: GPUs summed, the smallest node's host memory,
    and the type's memory per GPU narrowed to the smallest node's budget, which is what the manager enforces."""
    by_type: dict[str, list[TypedNode]] = {}
    for node in nodes:
        by_type.setdefault(node.type, []).append(node)
    return tuple(NodeGroup(name, replace(types[name], memory_mb=min([types[name].memory_mb] +
                                                                    [n.gpu_memory_mb for n in members
                                                                     if n.gpu_memory_mb])),
                           gpus=sum(n.gpus for n in members), host_memory_mb=min(n.host_memory_mb for n in members))
                 for name, members in by_type.items())


@dataclass(frozen=True)
class ProblemInstance:
    """The services and groups with sound figures, as arrays; ``speed`` is 0 on the pairs a service does not fit."""

    services: tuple[str, ...]
    groups: tuple[str, ...]
    load: Matrix
    host: Matrix
    speed: Matrix
    gpus: Matrix
    host_room: Matrix
    unplaced: tuple[str, ...]

    @property
    def allowed(self) -> NDArray[np.bool_]:
        return self.speed > 0


def problem_instance(services: tuple[ServiceLoad, ...], groups: tuple[NodeGroup, ...], reference: GpuType | None,
              speeds: Speeds | None = None) -> tuple[ProblemInstance, list[str]]:
    """The sound part of the input and what is wrong with the rest (each problem in words)."""
    base = reference or GPU_TYPES[REFERENCE_TYPE]
    problems: list[str] = []
    if not _positive(base.tflops, base.hbm_gb_per_s, base.h2d_gb_per_s, base.memory_mb):
        problems.append(f"the reference type has bad figures ({base})")
        groups = ()
    good_groups = []
    for group in groups:
        kind = group.kind
        if not (_positive(kind.tflops, kind.hbm_gb_per_s, kind.h2d_gb_per_s, kind.memory_mb)
                and _non_negative(group.gpus, group.host_memory_mb)):
            problems.append(f"group {group.name} has bad figures ({group})")
        else:
            good_groups.append(group)
    good, unplaced = [], []
    for service in services:
        if not _non_negative(service.load, service.host_memory_mb, service.gpu_memory_mb):
            problems.append(f"service {service.name} has bad figures ({service})")
            unplaced.append(service.name)
        elif not any(g.gpus > 0 and fits(g.kind, service.gpu_memory_mb)
                     and service.host_memory_mb <= g.host_memory_mb for g in good_groups):
            problems.append(f"service {service.name} fits no group ({service.gpu_memory_mb} MB per GPU, "
                            f"{service.host_memory_mb} MB of host memory)")
            unplaced.append(service.name)
        else:
            good.append(service)
    measured = speeds or {}

    def speed_of(s: ServiceLoad, g: NodeGroup) -> float:
        figure = measured.get((s.name, g.name))
        return figure if figure is not None and _positive(figure) else speed(g.kind, base, s.bound)

    matrix = np.array([[speed_of(s, g) if g.gpus > 0 and fits(g.kind, s.gpu_memory_mb)
                        and s.host_memory_mb <= g.host_memory_mb else 0.0 for g in good_groups] for s in good],
                      dtype=float).reshape(len(good), len(good_groups))
    return ProblemInstance(services=tuple(s.name for s in good), groups=tuple(g.name for g in good_groups),
                     load=np.array([s.load for s in good], dtype=float),
                     host=np.array([s.host_memory_mb for s in good], dtype=float), speed=matrix,
                     gpus=np.array([g.gpus for g in good_groups], dtype=float),
                     host_room=np.array([g.host_memory_mb for g in good_groups], dtype=float),
                     unplaced=tuple(unplaced)), problems


def _positive(*figures: float) -> bool:
    return all(math.isfinite(f) and f > 0 for f in figures)


def _non_negative(*figures: float) -> bool:
    return all(math.isfinite(f) and f >= 0 for f in figures)


def throughput(instance: ProblemInstance, x: NDArray[np.bool_], a: Matrix) -> float:
    """``t``: the least factor by which a placed service with load is served (its served rate over its load); a
    service left without a variant is reported unplaced instead of making ``t`` 0."""
    loaded = (instance.load > 0) & x.any(axis=1)
    if not loaded.any():
        return math.inf
    served = (a * instance.speed).sum(axis=1)
    return float((served[loaded] / instance.load[loaded]).min())


def t_max(instance: ProblemInstance) -> float:
    """An upper bound on ``t``: each service alone on every GPU it fits."""
    loaded = instance.load > 0
    alone = (instance.speed * instance.gpus).sum(axis=1)
    return float((alone[loaded] / instance.load[loaded]).min()) if loaded.any() else 0.0


def proportional(instance: ProblemInstance, x: NDArray[np.bool_], weight: Matrix) -> Matrix:
    """Each group's GPUs shared among its variants in proportion to ``weight``."""
    demand = np.where(x, weight, 0.0)
    totals = demand.sum(axis=0)
    return np.divide(demand * instance.gpus, totals, out=np.zeros_like(demand), where=totals > 0)


def pruned(instance: ProblemInstance, x: NDArray[np.bool_], a: Matrix) -> NDArray[np.bool_]:
    """``x`` less the variants without a share whose service has load and a share elsewhere: they only cost."""
    served = (x & (a > 1e-9)).any(axis=1) & (instance.load > 0)
    return x & ~((a <= 1e-9) & served[:, None])
