"""Interchangeable units split into pools (nodes): the topology every richer manager starts from.

Used directly by the simulator and the scheduling benchmark, and as the allocation core the CPU manager builds
on. A pool is chosen per action and resource at fit time (the one with the most free units, leaving room to
scale); an action's units of one resource never span pools.

Resources named in ``resizable`` hold malleable allocations (``tangram.core.malleable``): the scheduler lends the units
running elastic actions hold above their floors to queued ones and resizes those actions in place, as the CPU
manager does with cpusets. Only the books change here; nothing runs, so there is nothing to re-pin.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tangram.core.action import Action
from tangram.core.errors import Unprocessable
from tangram.core.malleable import WorkerCost, Workers
from tangram.core.seam import Allocation, Fit, PoolStatus, Resizing, ResourceManager


class CountedFit(Fit):
    def __init__(self, free: dict[str, dict[str, int]]) -> None:
        self._before = free
        self._free = {resource: dict(pools) for resource, pools in free.items()}
        self._placed: dict[str, dict[str, tuple[str, int]]] = {}

    def try_add(self, action: Action, units: Mapping[str, int]) -> bool:
        chosen: dict[str, tuple[str, int]] = {}
        for resource, n in units.items():
            pools = self._free[resource]
            pool = max(pools, key=pools.__getitem__)
            if pools[pool] < n:
                return False
            chosen[resource] = (pool, n)
        for resource, (pool, n) in chosen.items():
            self._free[resource][pool] -= n
        self._placed[action.id] = chosen
        return True

    def remove(self, action: Action) -> None:
        for resource, (pool, n) in self._placed.pop(action.id).items():
            self._free[resource][pool] += n

    def pool_of(self, action: Action, resource: str) -> str:
        return self._placed[action.id][resource][0]

    def lend(self, resource: str, pool: str, units: int) -> None:
        # Both counts: the lent units are placeable now (``free``) and part of the pool's spare that the pass
        # shares among malleable actions (``before``). ``_before`` is this fit's own copy (built by ``fit()``).
        self._before[resource][pool] += units
        self._free[resource][pool] += units

    def free_before(self, resource: str, pool: str) -> int:
        return self._before[resource][pool]

    def pools(self, resource: str) -> Sequence[str]:
        return tuple(self._before[resource])


class CountedUnitsManager(ResourceManager[None]):
    """Resources given as ``{resource: {pool: capacity}}``; executes nothing by itself.

    ``resizable`` names the resources whose running allocations may change size (their elastic actions run
    malleable); none by default, so the paper's moldable scheduling is unchanged."""

    name = "counted"

    def __init__(self, capacity: Mapping[str, Mapping[str, int]], resizable: frozenset[str] = frozenset()) -> None:
        self.capacity = {resource: dict(pools) for resource, pools in capacity.items()}
        self.in_use = {resource: {pool: 0 for pool in pools} for resource, pools in capacity.items()}
        self._resizing = {resource: CountedResizing(self, resource) for resource in resizable}

    @property
    def resources(self) -> Mapping[str, int]:
        return {resource: sum(pools.values()) for resource, pools in self.capacity.items()}

    def largest_pool(self, resource: str) -> int:
        return max(self.capacity[resource].values())

    def validate(self, action: Action) -> None:
        for resource, demand in action.demands.items():
            if resource in self.capacity and demand.min > self.largest_pool(resource):
                raise Unprocessable(f"demand.{resource}",
                                    f"minimum {demand.min} exceeds the largest pool ({self.largest_pool(resource)})")

    def fit(self) -> CountedFit:
        free = {resource: {pool: cap - self.in_use[resource][pool] for pool, cap in pools.items()}
                for resource, pools in self.capacity.items()}
        return CountedFit(free)

    def allocate(self, action: Action, units: Mapping[str, int], pools: Mapping[str, str]) -> Allocation[None]:
        for resource, n in units.items():
            pool = pools[resource]
            if self.in_use[resource][pool] + n > self.capacity[resource][pool]:
                raise RuntimeError(f"over-allocation of {resource} in {pool}: scheduler and manager disagree")
        for resource, n in units.items():
            self.in_use[resource][pools[resource]] += n
        return Allocation(action.id, dict(units), dict(pools), placement={r: {"pool": p} for r, p in pools.items()})

    def resizing(self, resource: str) -> CountedResizing | None:
        return self._resizing.get(resource)

    def release(self, allocation: Allocation[None]) -> None:
        if allocation.released:
            return
        allocation.released = True
        for resource, n in allocation.units.items():
            self.in_use[resource][allocation.pools[resource]] -= n

    def status(self) -> list[PoolStatus]:
        return [PoolStatus(resource, pool, cap, self.in_use[resource][pool])
                for resource, pools in self.capacity.items() for pool, cap in pools.items()]


class CountedResizing(Resizing[None]):
    """Resizes in the books only: counted units run nothing, so there is nothing to move."""

    def __init__(self, manager: CountedUnitsManager, resource: str) -> None:
        self.manager = manager
        self.resource = resource

    def workers(self, action: Action, units: int, expected_s: float, learned: WorkerCost | None = None) -> Workers:
        # Counted units have no worker start-up cost to weigh (the CPU manager's ``workers_for``), so a malleable
        # action may grow to its largest demand, within one pool (its units never span pools).
        return Workers(max(units, min(action.demands[self.resource].max, self.manager.largest_pool(self.resource))))

    def resize(self, allocation: Allocation[None], units: int) -> None:
        resource = self.resource
        if allocation.released:
            raise RuntimeError(f"resize of released allocation {allocation.action_id}")
        if units < 0:
            raise ValueError(f"negative units of {resource}: {units}")
        pool = allocation.pools[resource]
        in_use = self.manager.in_use[resource]
        delta = units - allocation.units[resource]
        if in_use[pool] + delta > self.manager.capacity[resource][pool]:
            raise RuntimeError(f"over-allocation of {resource} in {pool}: scheduler and manager disagree")
        in_use[pool] += delta
        allocation.units[resource] = units

    async def apply(self, allocation: Allocation[None]) -> None:
        """Nothing to move: the books are all there is."""
