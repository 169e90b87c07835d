"""Scheduling-pass benchmark: 2,048 elastic actions (DoP 1-32) over 1,280 cores in 5 nodes.

Replays a closed-loop run on a virtual clock with the real queue, scheduler and counted-units manager: every
completion triggers one pass, exactly as the broker does, and submits the trajectory's next action, so the queue
stays at 2,048. Each pass is timed on the wall clock. The cold first pass (whole queue, idle cluster) is printed
apart from the steady-state passes that follow.

With ``--learn`` every completion is observed (``tangram.sched.dispatch.ended``), the actions belong to 64 suites (one
signature each), and the scheduler plans with the speed-up models it learns (``tangram.sched.speedup``) instead of the
declared profiles alone. What learning adds to a pass is measured in pairs: every pass is also planned, on the same
queue and cluster, by a scheduler whose model keeps the declarations (its plan is dropped), the two in alternating
order, so the machine's noise falls on both alike; ``learning/declared`` is the geometric mean of the median per-pass
ratio in each order.

With ``--resize`` the manager can resize running cpu allocations, so elastic actions run malleable
(``tangram.core.malleable``): each plan is applied as the simulator applies it (shrinks, starts, grows through
``tangram.sched.dispatch``) and a resized action's completion is re-timed from its remaining estimated work.

The collector runs at the broker's threshold (``tangram.service.GC_YOUNG_OBJECTS``), so a pass pays what it pays
in the broker.

    python -m loadtest.bench_scheduler [--actions 2048] [--passes 1000] [--nodes 5] [--cores-per-node 256] [--resize]
                                       [--learn]
"""

from __future__ import annotations

import argparse
import gc
import heapq
import math
import random
import statistics
import time
from collections.abc import Iterable, Sequence
from typing import Any

from managers.counted import CountedUnitsManager
from tangram.core.action import Action, Demand, Elasticity, Kind
from tangram.core.seam import Allocation, ResourceManager
from tangram.sched import dispatch
from tangram.sched.durations import DurationModel
from tangram.sched.queue import FCFSQueue
from tangram.sched.scheduler import Plan, Resize, Scheduler
from tangram.service import GC_YOUNG_OBJECTS

#: suites (signatures) the actions of ``--learn`` belong to
SUITES = 64


def make_action(seq: int, now: float, rng: random.Random) -> Action:
    """A long-tailed test run (lognormal T1, median ~20 s) with sub-linear speed-up up to 32 cores, of one of
    ``SUITES`` signatures."""
    decay = rng.uniform(0.005, 0.03)
    efficiency = tuple((m, max(0.2, 1.0 - decay * (m - 1))) for m in (1, 2, 4, 8, 16, 32))
    action = Action(task="bench", kind=Kind.EXEC,
                    demands={"cpu": Demand.range(1, 32), "memory_mb": Demand.fixed(1024)},
                    elasticity=Elasticity("cpu", efficiency, t1=rng.lognormvariate(3.0, 1.0)),
                    spec={"command": "true"}, signature=f"suite-{seq % SUITES}")
    action.seq = seq
    action.submitted_at = now
    return action


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def planned(scheduler: Scheduler, reference: Scheduler | None, queue: FCFSQueue, running: Iterable[Action],
            now: float, times: list[float], reference_times: list[float]) -> Plan:
    """One pass by ``scheduler`` (timed into ``times``; its plan is applied) and, with a ``reference``, the same
    pass planned by it (timed into ``reference_times``; its plan is dropped), the order alternating pass by pass."""
    held = list(running)
    plan: Plan | None = None
    order = (scheduler, reference) if reference is None or len(times) % 2 else (reference, scheduler)
    for current in order:
        if current is None:
            continue
        started = time.perf_counter()
        outcome = current.schedule(queue, iter(held), now)
        (times if current is scheduler else reference_times).append(time.perf_counter() - started)
        if current is scheduler:
            plan = outcome
    assert plan is not None
    return plan


def paired(times: list[float], reference_times: list[float]) -> dict[str, float]:
    """The declared model's steady-state pass median and, when measured, what learning adds: the median per-pass
    ratio with the learning scheduler first and with it second, and their geometric mean (the second pass of a pair
    runs on caches the first warmed, worth 5-25% here, so neither order alone is the cost)."""
    if not reference_times:
        return {}
    ratios = [t / r for t, r in zip(times, reference_times)]
    learning_first = statistics.median(ratios[1::2])  # ``planned`` runs the learning scheduler first on odd passes
    learning_second = statistics.median(ratios[2::2])
    return {"declared_median_ms": statistics.median(reference_times[1:]) * 1e3,
            "learning_first": learning_first, "learning_second": learning_second,
            "learning/declared": math.sqrt(learning_first * learning_second)}


def ended(durations: DurationModel, action: Action, now: float, learn: bool) -> None:
    """With ``learn``, observe the completion as the broker does (its execution time is what it was expected)."""
    if learn:
        action.execution_s = now - (action.started_at or now)
        dispatch.ended(durations, None, action, now, succeeded=True)


#: the cold pass, and one steady-state pass to report
MIN_PASSES = 2


def run(actions_n: int, passes: int, nodes: int, cores: int, seed: int, depth: int,
        horizon: int, resize: bool = False, learn: bool = False) -> dict[str, float]:
    if passes < MIN_PASSES:
        raise ValueError(f"passes: at least {MIN_PASSES} (the first is the cold one; the steady-state figures need "
                         f"another), got {passes}")
    if resize:
        return run_resizing(actions_n, passes, nodes, cores, seed, depth, horizon, learn)
    rng = random.Random(seed)
    manager = CountedUnitsManager({
        "cpu": {f"node{i}": cores for i in range(nodes)},
        "memory_mb": {f"node{i}": 1 << 20 for i in range(nodes)},
    })
    durations = DurationModel()
    scheduler = Scheduler([manager], durations, depth=depth, horizon=horizon)
    reference = Scheduler([manager], DurationModel(), depth=depth, horizon=horizon) if learn else None
    queue = FCFSQueue()
    for seq in range(actions_n):
        queue.push(make_action(seq, 0.0, rng))
    next_seq = actions_n
    running: dict[str, tuple[Action, Allocation[Any]]] = {}
    completions: list[tuple[float, str]] = []
    now = 0.0
    pass_times: list[float] = []
    reference_times: list[float] = []
    acts: list[float] = []
    while len(pass_times) < passes:
        placements = planned(scheduler, reference, queue, (a for a, _ in running.values()), now, pass_times,
                             reference_times).placements
        for placement in placements:
            action = placement.action
            queue.remove(action.id)
            allocation = manager.allocate(action, placement.units, placement.pools)
            action.units = placement.units
            action.started_at = now
            action.expected_duration_s = durations.duration(action, placement.units["cpu"])
            running[action.id] = (action, allocation)
            heapq.heappush(completions, (now + action.expected_duration_s, action.id))
        if not completions:
            raise RuntimeError("queue stalled: nothing running and nothing scheduled")
        now, action_id = heapq.heappop(completions)
        finished = [action_id]
        while completions and completions[0][0] <= now:
            finished.append(heapq.heappop(completions)[1])
        for action_id in finished:
            action, allocation = running.pop(action_id)
            manager.release(allocation)
            ended(durations, action, now, learn)
            acts.append(now - action.submitted_at)
            queue.push(make_action(next_seq, now, rng))
            next_seq += 1
    steady = pass_times[1:]
    return {
        "passes": len(pass_times),
        "cold_pass_ms": pass_times[0] * 1e3,
        "median_ms": statistics.median(steady) * 1e3,
        "p90_ms": percentile(steady, 0.90) * 1e3,
        "p99_ms": percentile(steady, 0.99) * 1e3,
        "max_ms": max(steady) * 1e3,
        "completed": len(acts),
        "mean_act_s": statistics.fmean(acts),
        "virtual_time_s": now,
        **paired(pass_times, reference_times),
    }


def run_resizing(actions_n: int, passes: int, nodes: int, cores: int, seed: int, depth: int,
                 horizon: int, learn: bool) -> dict[str, float]:
    """``run`` with malleable actions: plans applied as ``tangram.sim.broker_station`` applies them."""
    rng = random.Random(seed)
    manager = CountedUnitsManager({
        "cpu": {f"node{i}": cores for i in range(nodes)},
        "memory_mb": {f"node{i}": 1 << 20 for i in range(nodes)},
    }, resizable=frozenset({"cpu"}))
    owner: dict[str, ResourceManager] = {r: manager for r in manager.resources}
    durations = DurationModel()
    scheduler = Scheduler([manager], durations, depth=depth, horizon=horizon)
    reference = Scheduler([manager], DurationModel(), depth=depth, horizon=horizon) if learn else None
    queue = FCFSQueue()
    for seq in range(actions_n):
        queue.push(make_action(seq, 0.0, rng))
    next_seq = actions_n
    running: dict[str, tuple[Action, list[tuple[ResourceManager, Allocation]]]] = {}
    # (finish, action id, version): a resize pushes a new entry and bumps the version, so older ones are skipped
    completions: list[tuple[float, str, int]] = []
    versions: dict[str, int] = {}
    now = 0.0
    pass_times: list[float] = []
    reference_times: list[float] = []
    apply_times: list[float] = []
    resizes: list[int] = []
    acts: list[float] = []

    def resized(decision: Resize) -> None:
        action = decision.action
        dispatch.resize(owner, running[action.id][1], decision, now)
        held = action.malleable
        assert held is not None
        versions[action.id] += 1
        heapq.heappush(completions, (now + held.remaining_s(now) / held.rate(), action.id, versions[action.id]))

    def pop_live() -> tuple[float, str] | None:
        while completions:
            finish, action_id, version = heapq.heappop(completions)
            if versions.get(action_id) == version:
                return finish, action_id
        return None

    while len(pass_times) < passes:
        plan = planned(scheduler, reference, queue, (a for a, _ in running.values()), now, pass_times,
                       reference_times)
        applying = time.perf_counter()
        resizes.append(len(plan.resizes))
        for decision in plan.shrinks():
            resized(decision)
        for placement in plan.placements:
            action = placement.action
            queue.remove(action.id)
            running[action.id] = (action, dispatch.start(owner, durations, placement, now))
            versions[action.id] = 0
            heapq.heappush(completions, (now + (action.expected_duration_s or 0.0), action.id, 0))
        for decision in plan.grows():
            resized(decision)
        apply_times.append(time.perf_counter() - applying)
        first = pop_live()
        if first is None:
            raise RuntimeError("queue stalled: nothing running and nothing scheduled")
        now, action_id = first
        finished = [action_id]
        del versions[action_id]
        while completions and completions[0][0] <= now:
            entry = pop_live()
            if entry is None:
                break
            if entry[0] > now:  # a live entry past ``now``: put it back, it ends later
                heapq.heappush(completions, (entry[0], entry[1], versions[entry[1]]))
                break
            finished.append(entry[1])
            del versions[entry[1]]
        for action_id in finished:
            action, allocations = running.pop(action_id)
            dispatch.release(allocations)
            ended(durations, action, now, learn)
            acts.append(now - action.submitted_at)
            queue.push(make_action(next_seq, now, rng))
            next_seq += 1
    steady = pass_times[1:]
    return {
        "passes": len(pass_times),
        "cold_pass_ms": pass_times[0] * 1e3,
        "median_ms": statistics.median(steady) * 1e3,
        "p90_ms": percentile(steady, 0.90) * 1e3,
        "p99_ms": percentile(steady, 0.99) * 1e3,
        "max_ms": max(steady) * 1e3,
        "completed": len(acts),
        "mean_act_s": statistics.fmean(acts),
        "virtual_time_s": now,
        "resizes/pass": statistics.fmean(resizes[1:]),
        "resizes_p99": percentile(resizes[1:], 0.99),
        "apply_med_ms": statistics.median(apply_times[1:]) * 1e3,
        **paired(pass_times, reference_times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--actions", type=int, default=2048)
    parser.add_argument("--passes", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--cores-per-node", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--horizon", type=int, default=64)
    parser.add_argument("--resize", action="store_true",
                        help="resizable cpu: malleable actions, shrunk and grown between passes")
    parser.add_argument("--learn", action="store_true", help="observe completions: plan with learned speed-up")
    args = parser.parse_args()
    if args.passes < MIN_PASSES:
        parser.error(f"--passes must be at least {MIN_PASSES}: the first pass is the cold one")
    gc.set_threshold(GC_YOUNG_OBJECTS)
    figures = run(args.actions, args.passes, args.nodes, args.cores_per_node, args.seed, args.depth, args.horizon,
                  args.resize, args.learn)
    print(f"scheduling passes: {args.actions} actions, {args.nodes} nodes x {args.cores_per_node} cores, "
          f"DoP 1-32, depth {args.depth}, horizon {args.horizon}{', resizing' if args.resize else ''}"
          f"{', learning' if args.learn else ''}")
    for name, value in figures.items():
        print(f"  {name:>14}: {value:,.3f}" if isinstance(value, float) else f"  {name:>14}: {value}")


if __name__ == "__main__":
    main()
