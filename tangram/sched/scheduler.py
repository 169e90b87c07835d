"""Elastic resource scheduling (§4.2, Algorithm 1) over the managers' standardized interface.

One pass:

1. **Candidates.** Walk the queue in policy order and place each action at its minimum units on the managers'
   scratch fits (topology-aware ``accommodate``). FCFS is kept *per resource type*: once an action cannot be
   placed, every resource it demands is blocked for the rest of the pass, so no later action overtakes it on any
   of those resources, while actions that need none of them (say, only API quota while CPUs are full) still go.
   The refusing fit may waive this (``Fit.holds_back``) when what the action lacks is something later actions do
   not need, such as a new sandbox's memory.
2. **Groups.** Candidates that are scalable (elastic key resource and a known duration) are grouped by key
   resource; the rest are selected at minimum units (Alg. 1 line 6).
3. **Greedy eviction** per group with the approximated objective (Alg. 2): DPArrange per pool of the key resource
   gives the optimum of every FCFS prefix in one table; the remaining queue, and the next actions that idle
   trajectories are expected to submit, are estimated on a completion heap.
   Evict the last member while the objective improves; the first too only while an action holding the resource
   runs (its end triggers a later pass), so a pass on idle units always starts something.
4. **Malleable groups** (the key resource's manager can resize running allocations, ``tangram.core.malleable``): the
   units running malleable actions hold above their floors are lent to step 1, and each pool's spare units are
   shared among its malleable actions, running and starting, by marginal-gain water-filling (the summed
   speed-up); members whose share is a core or more start with it, running ones whose share changed are resized.
   An elastic action of unknown duration whose workers follow its units joins too, from its floor, with gains
   below any estimated action's: it starts as in step 2 and takes only the units nobody estimated gains from.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import islice

from tangram.core.action import Action
from tangram.core.dparrange import DPOperator, DPTable, dp_arrange, dp_arrange_many
from tangram.core.malleable import Malleable, Profile, Workers, deferred, share
from tangram.core.seam import Allocation, Fit, ResourceManager
from tangram.sched.arrivals import Expected
from tangram.sched.durations import DurationModel
from tangram.sched.estimate import INF, SortedUnits, Waiting, estimate, reachable

#: relative gain below which an eviction is not worth it (objectives that differ only by float rounding)
IMPROVEMENT = 1e-9
#: members of one pool greedy eviction may drop before that pool's DP table is filled again, twice as deep: the
#: table's band (``dp_arrange``'s ``shortest``) widens with it, and a pass rarely drops more
EVICTION_DEPTH = 16
#: the completion times of a plan of no members
NONE_PLANNED = SortedUnits([])


@dataclass(slots=True)
class Placement:
    """A scheduling decision: start ``action`` now with these units, in these pools (``workers``: it starts
    malleable on its key resource, with these workers)."""

    action: Action
    units: dict[str, int]
    pools: dict[str, str]
    workers: Workers | None = None


@dataclass(slots=True)
class Resize:
    """A scheduling decision: a running malleable action now holds ``units`` of ``resource``."""

    action: Action
    resource: str
    units: int


@dataclass(slots=True)
class Plan:
    """One pass's decisions, to be applied in this order: shrinks, starts, grows (so freed units are free)."""

    placements: list[Placement]
    resizes: list[Resize]

    def shrinks(self) -> list[Resize]:
        return [r for r in self.resizes if r.units < r.action.units[r.resource]]

    def grows(self) -> list[Resize]:
        return [r for r in self.resizes if r.units > r.action.units[r.resource]]


def allocate_placement(owner: Mapping[str, ResourceManager],
                       placement: Placement) -> list[tuple[ResourceManager, Allocation]]:
    """Turn a placement into each owning manager's allocation; on failure release what was granted and raise."""
    by_manager: dict[int, tuple[ResourceManager, dict[str, int]]] = {}
    for resource, units in placement.units.items():
        manager = owner[resource]
        by_manager.setdefault(id(manager), (manager, {}))[1][resource] = units
    allocations: list[tuple[ResourceManager, Allocation]] = []
    try:
        for manager, granted in by_manager.values():
            allocations.append((manager, manager.allocate(placement.action, granted, placement.pools)))
    except Exception:
        for manager, allocation in allocations:
            manager.release(allocation)
        raise
    return allocations


@dataclass(slots=True)
class _Member:
    action: Action
    pool: str
    rank: int  # position among the group's members of the same pool


class Scheduler:
    def __init__(self, managers: Sequence[ResourceManager], durations: DurationModel, depth: int = 2,
                 horizon: int = 256, share_by_remaining: bool = False) -> None:
        self.managers = list(managers)
        self.share_by_remaining = share_by_remaining  # malleable shares by completion rate (heSRPT-like), not speed-up
        self.durations = durations
        self.depth = depth
        self.horizon = horizon
        self.owner: dict[str, ResourceManager] = {}
        #: per (resource, pool): the spare units and malleable actions of its last share
        self._shared: dict[tuple[str, str], tuple[int, tuple[tuple[str, bool], ...]]] = {}
        for manager in self.managers:
            for resource in manager.resources:
                self.owner[resource] = manager

    def reshare(self) -> None:
        """Share every pool afresh at the next pass: a plan was not carried out in full (a start or a resize
        failed), so the shares recorded for unchanged pools no longer stand."""
        self._shared.clear()

    def schedule(self, queue: Iterable[Action], running: Iterable[Action], now: float,
                 expected: Callable[[str, int], list[Expected]] | None = None) -> Plan:
        """One pass. ``expected(resource, limit)`` gives the next actions idle trajectories are expected to submit
        on ``resource`` (``tangram.sched.arrivals``): the moldable groups' estimate counts them after the queue."""
        fits = {id(m): m.fit() for m in self.managers}
        running = list(running)
        malleable = [(a, held) for a in running if (held := a.malleable) is not None]
        for _, held in malleable:
            if held.units > held.floor:
                fits[id(self.owner[held.resource])].lend(held.resource, held.pool, held.units - held.floor)
        queue = list(queue)
        candidates = self._candidates(queue, fits)
        if not candidates and not malleable:
            return Plan([], [])
        groups: dict[str, list[Action]] = defaultdict(list)
        shared: dict[str, list[Action]] = {held.resource: [] for _, held in malleable}
        placements: list[Placement] = []
        for action in candidates:
            key = action.key_resource
            if key is None or not (self.durations.scalable(action) or self._grows_unknown(action, key)):
                placements.append(self._placement(action, action.min_units(), fits))
            elif self.owner[key].resizing(key) is not None:
                shared.setdefault(key, []).append(action)
            else:
                groups[key].append(action)
        for resource, members in groups.items():
            chosen = self._arrange(resource, members, candidates, queue, running, fits, now, expected)
            for action, units in chosen:
                demand = action.min_units()
                demand[resource] = units
                placements.append(self._placement(action, demand, fits))
        resizes: list[Resize] = []
        for resource, members in shared.items():
            self._share(resource, members, candidates, malleable, fits, now, placements, resizes)
        placements.sort(key=lambda p: p.action.seq)
        return Plan(placements, resizes)

    # -- step 1 -------------------------------------------------------------------------------------------

    def _candidates(self, queue: list[Action], fits: dict[int, Fit]) -> list[Action]:
        """Step 1: the actions that fit at their minimum, in queue order."""
        blocked: set[str] = set()
        everything = set(self.owner)
        candidates: list[Action] = []
        for action in queue:
            names = action.demands.keys()
            if not blocked.isdisjoint(names):
                blocked.update(names)
                continue
            refused_by = self._try_place(action, fits)
            if refused_by is None:
                candidates.append(action)
            elif refused_by.holds_back(action):
                blocked.update(names)
            if blocked >= everything:
                break
        return candidates

    def _try_place(self, action: Action, fits: dict[int, Fit]) -> Fit | None:
        """Place ``action`` at its minimum on every fit it needs; None if placed, else the fit that refused."""
        per_manager: dict[int, dict[str, int]] = defaultdict(dict)
        for resource, demand in action.demands.items():
            per_manager[id(self.owner[resource])][resource] = demand.min
        placed: list[Fit] = []
        for manager_id, units in per_manager.items():
            fit = fits[manager_id]
            if not fit.try_add(action, units):
                for done in placed:
                    done.remove(action)
                return fit
            placed.append(fit)
        return None

    def _grows_unknown(self, action: Action, resource: str) -> bool:
        """Whether an elastic action whose duration is not known yet runs malleable (its profile ``deferred``): only
        where its workers follow its units, so growing into idle units and giving them back costs it nothing."""
        resizing = self.owner[resource].resizing(resource)
        return resizing is not None and resizing.workers(
            action, action.demands[resource].min, self.durations.default_s).follows

    def _placement(self, action: Action, units: dict[str, int], fits: dict[int, Fit]) -> Placement:
        pools = {r: fits[id(self.owner[r])].pool_of(action, r) for r in units}
        return Placement(action, units, pools)

    # -- step 4 -------------------------------------------------------------------------------------------

    def _share(self, resource: str, members: list[Action], candidates: list[Action],
               malleable: list[tuple[Action, Malleable]],
               fits: dict[int, Fit], now: float, placements: list[Placement], resizes: list[Resize]) -> None:
        """Start every member and share each pool's spare units among its malleable actions (water-filling)."""
        manager = self.owner[resource]
        resizing = manager.resizing(resource)
        assert resizing is not None, f"{resource} holds malleable actions, so its manager resizes it"
        fit = fits[id(manager)]
        spare: dict[str, int] = {}
        # a member of unknown duration has its floor from step 1, as any action not shared: only more is shared
        joining = {action.id for action in members if self.durations.scalable(action)}
        for action in candidates:
            if resource in action.demands and action.id not in joining:
                pool = fit.pool_of(action, resource)
                spare[pool] = spare.get(pool, fit.free_before(resource, pool)) - action.demands[resource].min
        pools: dict[str, list[Action]] = defaultdict(list)
        for action, held in malleable:
            if held.resource == resource:
                pools[held.pool].append(action)
        for action in members:
            pools[fit.pool_of(action, resource)].append(action)
        largest = manager.largest_pool(resource)
        for pool, actions in pools.items():
            free = spare.get(pool, fit.free_before(resource, pool))
            # a member that started holds its floor outside ``free`` at the next pass: the same ids with the same
            # free units are then not the same pool
            shape = (free, tuple((action.id, action.malleable is None) for action in actions))
            if self._shared.get((resource, pool)) == shape:
                continue  # nothing changed in this pool since its last share: the shares stand
            self._shared[(resource, pool)] = shape
            profiles = [self._profile(action, resource, largest) for action in actions]
            units = share(free, profiles, partial(self._remaining, actions, now), self.share_by_remaining)
            for action, k in zip(actions, units):
                running_as = action.malleable
                if running_as is None:  # a member: starts now, unless its first units gain less than others'
                    if k == 0:
                        continue
                    demand = action.min_units()
                    demand[resource] = k
                    placement = self._placement(action, demand, fits)
                    expected = self.durations.duration(action, k)
                    placement.workers = resizing.workers(action, k, expected, self.durations.worker_cost(action, k))
                    placements.append(placement)
                elif k != running_as.units:
                    resizes.append(Resize(action, resource, k))

    def _profile(self, action: Action, resource: str, largest: int) -> Profile:
        """A malleable action's speed-up as the sharing sees it: a starting one's from 0 (it may wait, outranked);
        one of unknown duration's from its floor (it starts, as in step 2), deferred beyond it."""
        held = action.malleable
        if held is not None:
            return deferred(held.profile) if held.assumed else held.profile
        counts = action.demands[resource].up_to(largest)
        if not self.durations.scalable(action):
            return deferred(self.durations.profile(action, counts))
        return self.durations.profile(action, (0, *counts))

    def _remaining(self, actions: list[Action], now: float, index: int) -> float:
        """The remaining work on one unit of a malleable action (``actions[index]``): a starting one's whole work."""
        action = actions[index]
        held = action.malleable
        if held is not None:
            return held.remaining_s(now)
        return self.durations.t1(action) or self.durations.default_s

    # -- steps 2-3 ----------------------------------------------------------------------------------------

    def _arrange(self, resource: str, group: list[Action], candidates: list[Action], queue: list[Action],
                 running: list[Action], fits: dict[int, Fit], now: float,
                 expected: Callable[[str, int], list[Expected]] | None) -> list[tuple[Action, int]]:
        """Greedy eviction for one key resource; returns the kept members and their key units."""
        fit = fits[id(self.owner[resource])]
        in_group = {a.id for a in group}
        pool_members: dict[str, list[Action]] = defaultdict(list)
        members: list[_Member] = []
        for action in group:
            pool = fit.pool_of(action, resource)
            members.append(_Member(action, pool, len(pool_members[pool])))
            pool_members[pool].append(action)

        # Units of each pool left to the group once the other candidates there hold their minimum.
        others_by_pool: dict[str, list[Action]] = defaultdict(list)
        others: list[tuple[float, int]] = []
        for action in candidates:
            if action.id not in in_group and resource in action.demands:
                others_by_pool[fit.pool_of(action, resource)].append(action)
                others.append((self.durations.duration(action), action.demands[resource].min))
        free_units: dict[str, int] = {}
        operators: dict[str, DPOperator] = {}
        for pool in pool_members:
            taken = others_by_pool.get(pool, [])
            free_units[pool] = fit.free_before(resource, pool) - sum(a.demands[resource].min for a in taken)
            operators[pool] = fit.dp_operator(resource, pool, taken)

        def options(shortest: dict[str, int]) -> dict[str, list[tuple[tuple[int, ...], tuple[float, ...]]]]:
            """Each pool's members' unit counts and the duration at each, up to what the pool's table for prefixes
            of at least ``shortest[pool]`` members can give one of them (its band: ``dp_arrange``), every pool's
            from one model call."""
            asked: list[Action] = []
            counts: list[tuple[int, ...]] = []
            for pool, least in shortest.items():
                actions, free, operator = pool_members[pool], free_units[pool], operators[pool]
                band = free
                if operator.linear:
                    band = operator.end(free) - sum(a.demands[resource].min for a in actions[:least])
                for action in actions:
                    demand = action.demands[resource]
                    counts.append(demand.up_to(min(free, demand.min + max(0, band))))
                asked += actions
            times = iter(zip(counts, self.durations.durations_many(asked, counts)))
            return {pool: list(islice(times, len(pool_members[pool]))) for pool in shortest}

        tables: dict[str, DPTable] = {}

        def table(pool: str, count: int) -> DPTable:
            """The pool's DP table (every pool's, filled together, at the first call), filled again twice as deep
            when greedy eviction walks past the prefixes it holds."""
            if not tables:
                shortest = {p: max(0, len(actions) - EVICTION_DEPTH) for p, actions in pool_members.items()}
                chosen = options(shortest)
                tables.update(zip(pool_members, dp_arrange_many(
                    [(chosen[p], free_units[p], operators[p], shortest[p]) for p in pool_members])))
            current = tables[pool]
            if count < current.shortest:
                size = len(pool_members[pool])
                deeper = max(0, min(count, size - 2 * (size - current.shortest)))
                current = tables[pool] = dp_arrange(options({pool: deeper})[pool], free_units[pool], operators[pool],
                                                    deeper)
            return current

        base = self._base_units(resource, running, fit, now, others)
        waiting_rest = self._waiting(resource, queue, candidates)
        arrivals: list[Waiting] = []
        if expected is not None and len(waiting_rest) < self.horizon:
            arrivals = [Waiting((e.units,), (e.duration_s,), e.in_s)
                        for e in expected(resource, self.horizon - len(waiting_rest))]
        waiting_rest += arrivals
        # Units the members may leave idle for expected arrivals: none, or part or all of what those ask for (counted
        # units only: a GPU chunk state is not a unit count). The objective picks; the paper's Alg. 1 reserves none.
        reserves = [0]
        if arrivals and all(operator.linear for operator in operators.values()):
            asked = sum(a.counts[0] for a in arrivals)
            reserves = sorted({0, asked // 4, asked // 2, asked})
        plans: dict[tuple[str, int, int], tuple[float, list[int], int, SortedUnits]] = {}

        def plan(pool: str, count: int, reserve: int) -> tuple[float, list[int], int, SortedUnits]:
            """Exact ACT sum, units, units used and completion times of the pool's first ``count`` members, leaving
            ``reserve`` of its free units idle."""
            ident = (pool, count, reserve)
            if ident not in plans:
                limit = None if reserve == 0 else free_units[pool] - reserve
                total, ends = 0.0, NONE_PLANNED
                units: list[int] = []
                if count:
                    current = table(pool, count)
                    total, units = current.best(count, limit)
                    ends = SortedUnits.of(current.durations(units), units)
                plans[ident] = (total, units, sum(units), ends)
            return plans[ident]

        # the members the walk dropped, last first, as the estimate sees them: built as it gets to them
        dropped: list[Waiting] = []

        def objective(t: int, reserve: int) -> float:
            counts = {pool: len(actions) for pool, actions in pool_members.items()}
            for member in members[t:]:
                counts[member.pool] -= 1
            chosen = [plan(pool, count, reserve) for pool, count in counts.items()]
            exact = sum(total for total, _, _, _ in chosen)
            if exact == INF:
                return INF
            while len(dropped) < len(members) - t:
                dropped.append(self._as_waiting(members[len(members) - 1 - len(dropped)].action, resource))
            # the same actions at every t (members, then the first horizon of the rest), so objectives compare
            waiting = dropped[:len(members) - t][::-1] + waiting_rest
            # planned members start now, on idle units; the estimate sees only the units it can reach
            used = sum([used for _, _, used, _ in chosen])
            runs = [(base, used if used <= base.units else 0)] + [(ends, 0) for _, _, _, ends in chosen]
            return exact + estimate(reachable(runs, waiting, self.depth), waiting, self.depth)

        def best_reserve(t: int) -> tuple[float, int]:
            return min((objective(t, reserve), reserve) for reserve in reserves)

        # Evict while the objective improves by more than rounding. The first member goes too only while an action
        # holding this resource runs: its end is a later pass. With none running, "wait" might never end (the
        # estimate pools units the fit could not give), so the first member stays.
        last = 0 if any(action.units.get(resource) for action in running) else 1
        best_t = len(members)
        best_obj, best_res = best_reserve(best_t)
        for t in range(len(members) - 1, last - 1, -1):
            obj, reserve = best_reserve(t)
            if obj >= best_obj - IMPROVEMENT * abs(best_obj):
                break
            best_t, best_obj, best_res = t, obj, reserve

        kept: dict[str, int] = defaultdict(int)
        for member in members[:best_t]:
            kept[member.pool] += 1
        units_of = {pool: plan(pool, count, best_res)[1] for pool, count in kept.items()}
        return [(m.action, units_of[m.pool][m.rank]) for m in members[:best_t]]

    def _base_units(self, resource: str, running: list[Action], fit: Fit, now: float,
                    others: list[tuple[float, int]]) -> SortedUnits:
        """Unit free-times for ``resource``: running actions, other candidates starting now, the idle rest."""
        entries: list[tuple[float, int]] = []
        for action in running:
            units = action.units.get(resource)
            if units:
                finish = (action.started_at or now) + (action.expected_duration_s or self.durations.default_s)
                entries.append((max(0.0, finish - now), units))
        idle = sum(fit.free_before(resource, pool) for pool in fit.pools(resource))
        for duration, units in others:
            entries.append((duration, units))
            idle -= units
        entries.append((0.0, idle))
        return SortedUnits(entries)

    def _waiting(self, resource: str, queue: list[Action], candidates: list[Action]) -> list[Waiting]:
        """Queued non-candidates that need ``resource``, in order, as far as the estimate looks."""
        chosen = {a.id for a in candidates}
        waiting: list[Waiting] = []
        for action in queue:
            if action.id not in chosen and resource in action.demands:
                waiting.append(self._as_waiting(action, resource))
                if len(waiting) >= self.horizon:
                    break
        return waiting

    def _as_waiting(self, action: Action, resource: str) -> Waiting:
        if action.key_resource == resource and self.durations.scalable(action):
            counts = action.demands[resource].choices[: max(1, self.depth)]
            return Waiting(counts, self.durations.durations(action, counts))
        return Waiting((action.demands[resource].min,), (self.durations.duration(action),))

