"""One scheduling pass's view of the GPU nodes (the GPU manager's ``Fit``): where each reward action's chunk would
go, which actions wait for a node that holds their service, and the chunk operator of each node for the DP.

It reads the manager through ``FitSubject``, the few things a placement needs, so it does not import the manager.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from managers.gpu.chunk_operator import ChunkOperator
from managers.gpu.chunks import Chunk, after_allocating
from managers.gpu.config import GpuFitArgs
from managers.gpu.confinement import ServiceConfinement
from managers.gpu.delay_wait import DelayWaits
from managers.gpu.disk_tier import DiskTier
from managers.gpu.node import RESOURCE, GpuNode
from managers.gpu.service_demand import ServiceDemand
from managers.gpu.setup_costs import SetupCosts
from managers.gpu.slot import SlotState
from reward_services.requests import RewardRequest
from tangram.core.action import Action
from tangram.core.dparrange import DPOperator
from tangram.core.learned import LearnedSeconds
from tangram.core.seam import Fit


class FitSubject(Protocol):
    """What the fit reads of the GPU manager."""

    #: ``[gpu.fit]``: the typed fit, and whether to wait for a node where the service is resident
    fit_args: GpuFitArgs
    waits: DelayWaits
    restore_time: LearnedSeconds
    disk: DiskTier
    demand: ServiceDemand
    #: the nodes a placement confines each service to
    confinement: ServiceConfinement
    #: an action's expected time on a node, its restore included (the typed fit)
    setup: SetupCosts

    @property
    def nodes(self) -> Mapping[str, GpuNode]: ...

    def reward_request(self, action: Action) -> RewardRequest: ...


#: a node the fit ranks for an action: (expected end on typed nodes, not resident, host copy not in host memory,
#: -free GPUs, smallest fitting level, node name), lowest first
Choice = tuple[float, bool, bool, int, int, str]


class GpuFit(Fit):
    """Scratch copies of every node's chunk allocator for one scheduling pass."""

    def __init__(self, manager: FitSubject) -> None:
        self.manager = manager
        self.before = {name: node.chunks.copy() for name, node in manager.nodes.items()}
        self.free = {name: chunks.copy() for name, chunks in self.before.items()}
        self.placed: dict[str, tuple[str, Chunk]] = {}
        #: actions refused this pass to wait for a node that holds their service: they hold nobody back
        self.deferred: set[str] = set()
        self._best_of: dict[tuple[str, int, tuple[int, ...]], Choice | None] = {}
        #: nodes of more than one type with the typed fit on: where an action is expected to end first comes first
        self.typed = manager.fit_args.typed and len({node.config.type for node in manager.nodes.values()
                                                     if node.lost is None}) > 1
        #: (service, DoP) of the instances resident on nodes in service, read once per pass
        self._resident: set[tuple[str, int]] | None = None
        #: actions refused this pass only because the nodes their service is placed on are full (``place_services``)
        self.confined: set[str] = set()
        #: those nodes: no later action takes a chunk there this pass, so FCFS holds on them
        self.kept: set[str] = set()

    def try_add(self, action: Action, units: Mapping[str, int]) -> bool:
        k = units[RESOURCE]
        service = self.manager.reward_request(action).service
        dops = action.demands[RESOURCE].choices
        best = self._best(service, k, dops)
        if best is None:
            self._confine(action, service, k)
            return False
        patience = self._avoidable_setup(service, best, dops) + self._slower_by(service, k, best)
        if patience <= 0.0:
            self.manager.waits.forget(action.id)
        elif self.manager.waits.worth_waiting(action.id, patience):
            self.deferred.add(action.id)
            return False
        name = best[-1]
        chunk = self.free[name].allocate(k, self.manager.nodes[name].chunk_key(service))
        assert chunk is not None
        self.placed[action.id] = (name, chunk)
        self._best_of.clear()
        return True

    def _best(self, service: str, k: int, dops: tuple[int, ...]) -> Choice | None:
        """Where a chunk of ``k`` for ``service`` goes: a node where it is resident (at one of ``dops``) on a free
        chunk, then one that holds its host copy, then the one with the most free GPUs (then the smallest fitting
        level). On nodes of several types (``typed``), first the node where it is expected to end soonest: its
        restore there unless resident, plus its run time on the node's type. Kept until the fit changes: many
        queued actions of one service ask the same."""
        key = (service, k, dops)
        if key not in self._best_of:
            options = []
            for name, node in self.manager.nodes.items():
                level = self.free[name].smallest_fitting_level(k)
                if service in node.services and level is not None and node.lost is None and name not in self.kept \
                        and self.manager.confinement.may_run(service, node):
                    resident = node.resident_on_free_chunk(service, dops, self.free[name])
                    in_host = node.tier is None or node.tier.holds(service)
                    ends = self.manager.setup.expected_s(service, node, k, resident) if self.typed else 0.0
                    options.append((ends, not resident, not in_host, -self.free[name].free_gpus, level, name))
            self._best_of[key] = min(options, default=None)
        return self._best_of[key]

    def _confine(self, action: Action, service: str, k: int) -> None:
        """An action refused while a node its service is not placed on has room for it waits for its own nodes
        without holding back the actions placed elsewhere: those nodes are kept from later actions instead."""
        if service not in self.manager.confinement.allowed:  # every node is its own: nothing elsewhere to let go ahead
            return
        nodes = self.manager.nodes
        mine = [name for name, node in nodes.items() if self.manager.confinement.may_run(service, node)]
        if len(mine) < len(nodes) and any(self.free[name].smallest_fitting_level(k) is not None
                                          for name, node in nodes.items() if name not in mine
                                          and service in node.services and node.lost is None):
            self.confined.add(action.id)
            if not self.kept.issuperset(mine):
                self.kept.update(mine)
                self._best_of.clear()

    def _avoidable_setup(self, service: str, best: Choice, dops: tuple[int, ...]) -> float:
        """What starting on ``best`` would spend that waiting for a node holding the service (busy now) would
        not: its restore when an instance is resident elsewhere (``wait_for_resident``), its load from disk when
        another node's host memory holds its copy."""
        not_resident, not_in_host = best[1], best[2]
        if not not_resident:
            return 0.0
        seconds = 0.0
        if self.manager.fit_args.wait_for_resident and self._resident_somewhere(service, dops):
            seconds += self.manager.restore_time.estimate(service)
        if not_in_host and self.manager.disk.held(service):
            seconds += self.manager.disk.load_time.estimate(service)
        return seconds

    def _slower_by(self, service: str, k: int, best: Choice) -> float:
        """On typed nodes, how much longer the action would run on ``best`` than on the fastest of the nodes it may
        run on that are busy now, where they are of a faster type: it waits up to that long for one of them (delay
        scheduling across types; without it a scorer takes a free H20, at 0.15x an H100, whenever the H100s are busy
        for a moment)."""
        if not self.typed:
            return 0.0
        manager = self.manager
        here = manager.demand.gpu_s(service, manager.nodes[best[-1]].config.type) / k
        busy = [manager.demand.gpu_s(service, node.config.type) / k for name, node in manager.nodes.items()
                if node.lost is None and service in node.services and manager.confinement.may_run(service, node)
                and self.free[name].smallest_fitting_level(k) is None]
        return max(0.0, here - min(busy, default=here))

    def _resident_somewhere(self, service: str, dops: tuple[int, ...]) -> bool:
        if self._resident is None:
            may_run = self.manager.confinement.may_run
            self._resident = {(slot.service, slot.chunk.size) for node in self.manager.nodes.values()
                              if node.lost is None for slot in node.residency.slots.values()
                              if slot.state is SlotState.RESIDENT and may_run(slot.service, node)}
        return any((service, k) in self._resident for k in dops)

    def holds_back(self, action: Action) -> bool:
        return action.id not in self.deferred and action.id not in self.confined

    def remove(self, action: Action) -> None:
        placed = self.placed.pop(action.id, None)
        if placed is not None:
            self.free[placed[0]].release(placed[1])
            self._best_of.clear()

    def pool_of(self, action: Action, resource: str) -> str:
        return self.placed[action.id][0]

    def free_before(self, resource: str, pool: str) -> int:
        return self.before[pool].free_gpus

    def pools(self, resource: str) -> Sequence[str]:
        return tuple(self.before)

    def dp_operator(self, resource: str, pool: str, others: Sequence[Action]) -> DPOperator:
        counts = self.before[pool].counts()
        for action in others:  # smallest-fit counts do not depend on the order (see chunks.py)
            after = after_allocating(counts, action.demands[RESOURCE].min)
            assert after is not None, "the fit placed every candidate"
            counts = after
        return ChunkOperator(counts)
