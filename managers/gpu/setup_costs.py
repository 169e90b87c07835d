"""What a reward action would spend getting its GPUs ready: the restore of its service, learned from the restores
seen. HRRS orders the queue by it (``CyclePlugins.setup_costs``), the typed fit adds it to an action's run time on
each node (``expected_s``), and SLO admission plans with it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from managers.gpu.gpu_types import REFERENCE_TYPE, GpuType, restore_factor
from managers.gpu.node import RESOURCE, GpuNode
from managers.gpu.service_demand import ServiceDemand
from managers.gpu.slot import SlotState
from reward_services.backend import ServiceSpec
from reward_services.requests import RewardRequest
from tangram.core.action import Action, Kind
from tangram.core.learned import LearnedSeconds

#: ASSUMED: host-to-GPU copy rate of a restore before one was observed (MiB/s, pinned PCIe 4.0 x16 ~ 20 GB/s
#: measured for large copies, halved for allocation and a cold cache); observed restores replace it
RESTORE_PRIOR_MB_PER_S = 10_000.0
#: weight of each observed restore in a service's restore estimate
RESTORE_EWMA_ALPHA = 0.3


def restore_estimate(services: Mapping[str, ServiceSpec]) -> LearnedSeconds:
    """Each service's expected restore, from the restores seen: its host copy at the assumed rate until one is."""
    return LearnedSeconds(lambda name: services[name].host_memory_mb / RESTORE_PRIOR_MB_PER_S, RESTORE_EWMA_ALPHA)


class SetupCosts:
    """Setup seconds of reward actions, from where their services are resident now."""

    def __init__(self, nodes: Mapping[str, GpuNode], may_run: Callable[[str, GpuNode], bool],
                 request_of: Callable[[Action], RewardRequest], restore_time: LearnedSeconds, demand: ServiceDemand,
                 types: Mapping[str, GpuType]) -> None:
        self._nodes = nodes
        self._may_run = may_run
        self._request_of = request_of
        self._restore_time = restore_time
        self._demand = demand
        self._types = types

    def of(self, actions: Sequence[Action]) -> dict[str, float]:
        """A reward action's setup: nothing when an instance of its service is resident, at a DoP it accepts, on
        free GPUs of a node in service that it may run on (it can start without a switch), else the service's
        expected restore."""
        ready = {(slot.service, slot.chunk.size) for node in self._nodes.values() if node.lost is None
                 for slot in node.residency.slots.values() if slot.state is SlotState.RESIDENT
                 and any(free.contains(slot.chunk) for free in node.chunks.free)
                 and self._may_run(slot.service, node)}
        costs = {}
        of: dict[tuple[str, tuple[int, ...]], float] = {}  # many queued actions ask the same
        for action in actions:
            if action.kind is not Kind.REWARD or RESOURCE not in action.demands:
                continue
            key = (self._request_of(action).service, action.demands[RESOURCE].choices)
            if key not in of:
                of[key] = 0.0 if any((key[0], k) in ready for k in key[1]) else self._restore_time.estimate(key[0])
            if of[key]:
                costs[action.id] = of[key]
        return costs

    def expected_s(self, service: str, node: GpuNode, k: int, resident: bool) -> float:
        """Seconds an action of ``service`` on ``k`` of ``node``'s GPUs is expected to take: its restore unless
        resident (scaled by the type's host-to-device rate), plus its run time there (``ServiceDemand``)."""
        kind = node.config.type
        restore = 0.0 if resident else self._restore_time.estimate(service) * restore_factor(
            self._types[kind], self._types[REFERENCE_TYPE])
        return restore + self._demand.gpu_s(service, kind) / k
