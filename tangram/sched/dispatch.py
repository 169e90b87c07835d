"""Starting, resizing and ending actions: the bookkeeping of a pass's decisions and of an action's end, shared by
the broker (asyncio, wall clock) and the simulator (virtual clock), so both apply the scheduler's plan and learn
from ends the same way."""

from __future__ import annotations

from tangram.core.action import Action
from tangram.core.malleable import Malleable
from tangram.core.seam import Allocation, ResourceManager
from tangram.sched.arrivals import ArrivalModel
from tangram.sched.durations import DurationModel
from tangram.sched.scheduler import Placement, Resize, allocate_placement

Allocations = list[tuple[ResourceManager, Allocation]]


def start(owner: dict[str, ResourceManager], durations: DurationModel, placement: Placement,
          now: float) -> Allocations:
    """Allocate a placement and record the start on its action (units, placement, expected duration, and its
    malleable state when it starts malleable). Raises what the allocation raised, with nothing held."""
    action = placement.action
    allocations = allocate_placement(owner, placement)
    action.started_at = now
    action.units = dict(placement.units)
    action.placement = {k: v for _, a in allocations for k, v in a.placement.items()}
    key = action.key_resource
    workers = placement.workers
    modelled = None if workers is None or workers.follows else workers.count  # None: as many as units
    action.expected_duration_s = durations.duration(action, placement.units.get(key) if key else None, modelled)
    if workers is not None and key is not None:
        units = placement.units[key]
        action.malleable = Malleable(resource=key, pool=placement.pools[key], floor=action.demands[key].min,
                                     workers=workers.count, units=units, since=now,
                                     t1_s=durations.t1(action, modelled) or durations.default_s,
                                     profile=durations.profile(action, action.demands[key].up_to(workers.count),
                                                               modelled),
                                     history=[(now, units)], follows=workers.follows,
                                     assumed=not durations.scalable(action))
    return allocations


def resize(owner: dict[str, ResourceManager], allocations: Allocations, decision: Resize, now: float) -> Allocation:
    """Change a running action's units in the owning manager's books and on its record; returns the allocation
    (``apply`` of the resource's ``Resizing`` makes it real)."""
    action, resource = decision.action, decision.resource
    held = action.malleable
    if held is None:
        raise ValueError(f"action {action.id} is not malleable")
    manager = owner[resource]
    resizing = manager.resizing(resource)
    if resizing is None:
        raise ValueError(f"{manager.name} cannot resize {resource!r}")
    allocation = next(a for m, a in allocations if m is manager)
    resizing.resize(allocation, decision.units)
    held.resize(decision.units, now)
    action.units[resource] = decision.units
    action.placement.update(allocation.placement)
    action.expected_duration_s = (now - (action.started_at or now)) + held.remaining_s(now) / held.rate()
    return allocation


def release(allocations: Allocations) -> None:
    for manager, allocation in allocations:
        manager.release(allocation)


def ended(durations: DurationModel, arrivals: ArrivalModel | None, action: Action, now: float,
          succeeded: bool) -> None:
    """Learn from an action's end: its duration (if it succeeded) and its trajectory's idle start."""
    if succeeded:
        durations.observe(action)
    if arrivals is not None:
        arrivals.ended(action, now)
