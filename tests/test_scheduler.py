"""Algorithm 1 through the manager seam: capacity, FCFS per resource, elasticity and greedy eviction."""

from __future__ import annotations

import random
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from managers.counted import CountedUnitsManager
from tangram.core.action import Action, Demand, Elasticity, Kind
from tangram.sched import scheduler
from tangram.sched.arrivals import Expected
from tangram.sched.durations import DurationModel
from tangram.sched.scheduler import Scheduler

LINEAR = tuple((m, 1.0) for m in (1, 64))


def act(seq: int, demands: dict[str, Demand], elasticity: Elasticity | None = None) -> Action:
    action = Action(task="t", kind=Kind.EXEC, demands=demands, elasticity=elasticity)
    action.seq = seq
    return action


def schedule(manager, queue, depth=2, running=()):
    return Scheduler([manager], DurationModel(), depth=depth).schedule(queue, running, now=0.0).placements


def test_unknown_elasticity_gets_minimum_units():
    manager = CountedUnitsManager({"cpu": {"n0": 16}})
    no_profile = act(1, {"cpu": Demand.range(2, 8)})
    no_duration = act(2, {"cpu": Demand.range(1, 8)}, Elasticity("cpu", LINEAR))  # t1 unknown, none learned
    placements = schedule(manager, [no_profile, no_duration])
    assert {p.action.id: p.units["cpu"] for p in placements} == {no_profile.id: 2, no_duration.id: 1}


def test_lone_elastic_action_scales_up():
    manager = CountedUnitsManager({"cpu": {"n0": 16}})
    action = act(1, {"cpu": Demand.range(1, 8)}, Elasticity("cpu", LINEAR, t1=10.0))
    [placement] = schedule(manager, [action])
    assert placement.units["cpu"] == 8


def test_discrete_choices_are_respected():
    manager = CountedUnitsManager({"gpu": {"n0": 7}})
    action = act(1, {"gpu": Demand((1, 2, 4))}, Elasticity("gpu", LINEAR, t1=10.0))
    [placement] = schedule(manager, [action])
    assert placement.units["gpu"] == 4


def test_waiting_cpu_action_does_not_block_api_only_action_but_blocks_later_cpu_action():
    manager = CountedUnitsManager({"cpu": {"n0": 2}, "api.search": {"default": 5}})
    big = act(1, {"cpu": Demand.fixed(4)})  # 4 > 2 free: waits
    small_cpu = act(2, {"cpu": Demand.fixed(1)})  # would fit, but must not overtake `big` on cpu
    api_only = act(3, {"api.search": Demand.fixed(1)})  # shares nothing with `big`: goes now
    mixed = act(4, {"cpu": Demand.fixed(1), "api.search": Demand.fixed(1)})
    placements = schedule(manager, [big, small_cpu, api_only, mixed])
    assert [p.action for p in placements] == [api_only]


def test_blocking_is_transitive_through_shared_resources():
    manager = CountedUnitsManager({"cpu": {"n0": 1}, "api.a": {"default": 1}})
    first = act(1, {"cpu": Demand.fixed(2)})  # cannot fit: blocks cpu
    second = act(2, {"cpu": Demand.fixed(1), "api.a": Demand.fixed(1)})  # skipped: blocks api.a too
    third = act(3, {"api.a": Demand.fixed(1)})  # must not take api.a ahead of `second`
    assert schedule(manager, [first, second, third]) == []


def test_greedy_eviction_with_depth_prefers_running_one_action_wide():
    # 2 cores, two perfectly elastic 10 s actions. Both on 1 core: ACTs 10 + 10 = 20. Evicting the second
    # lets the first finish at 5 and the second (depth 2: on 2 cores) at 10: 15 < 20.
    manager = CountedUnitsManager({"cpu": {"n0": 2}})
    queue = [act(i, {"cpu": Demand.range(1, 2)}, Elasticity("cpu", LINEAR, t1=10.0)) for i in (1, 2)]
    placements = schedule(manager, queue, depth=2)
    assert [(p.action, p.units["cpu"]) for p in placements] == [(queue[0], 2)]
    # depth 1 estimates the evicted action on 1 core only: 5 + 15 = 20, not better, so both start on 1 core
    placements = schedule(manager, queue, depth=1)
    assert sorted(p.units["cpu"] for p in placements) == [1, 1]


def test_running_actions_shape_the_estimate():
    manager = CountedUnitsManager({"cpu": {"n0": 4}})
    manager.in_use["cpu"]["n0"] = 2
    busy = act(0, {"cpu": Demand.fixed(2)})
    busy.units, busy.started_at, busy.expected_duration_s = {"cpu": 2}, 0.0, 1000.0
    action = act(1, {"cpu": Demand.range(1, 4)}, Elasticity("cpu", LINEAR, t1=8.0))
    [placement] = schedule(manager, [action], running=[busy])
    assert placement.units["cpu"] == 2  # only 2 free; it never waits for the busy ones


def test_expected_arrivals_keep_cores_idle_when_that_pays():
    # 8 idle cores; a test run (T1 8 s, E(4) = 0.9, E(8) = 0.8) alone: all 8 (1.25 s). With four one-core, 1 s calls
    # expected in 0.1 s, 8 cores would make them wait until 1.25 s (ACT 2.15 s each): leaving 4 idle is better
    manager = CountedUnitsManager({"cpu": {"n0": 8}})
    profile = Elasticity("cpu", ((1, 1.0), (4, 0.9), (8, 0.8)), t1=8.0)
    alone = schedule(manager, [act(1, {"cpu": Demand.range(1, 8)}, profile)])
    assert alone[0].units["cpu"] == 8
    soon = [Expected(0.1, 1, 1.0)] * 4
    plan = Scheduler([manager], DurationModel()).schedule([act(2, {"cpu": Demand.range(1, 8)}, profile)], [], 0.0,
                                                          lambda resource, limit: soon[:limit])
    assert plan.placements[0].units["cpu"] == 4


demand_strategy = st.one_of(
    st.integers(1, 6).map(Demand.fixed),
    st.tuples(st.integers(1, 4), st.integers(0, 6)).map(lambda t: Demand.range(t[0], t[0] + t[1])),
    st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=4, unique=True).map(
        lambda c: Demand(tuple(sorted(c)))),
)


@st.composite
def queues(draw):
    actions = []
    for seq in range(draw(st.integers(1, 25))):
        resources = draw(st.lists(st.sampled_from(["cpu", "gpu", "api.x"]), min_size=1, max_size=3, unique=True))
        demands = {r: draw(demand_strategy) for r in resources}
        elasticity = None
        if draw(st.booleans()):
            key = draw(st.sampled_from(resources))
            efficiency = tuple(sorted({(1, 1.0), (8, draw(st.floats(0.1, 1.0)))}))
            elasticity = Elasticity(key, efficiency, t1=draw(st.one_of(st.none(), st.floats(0.1, 100.0))))
        actions.append(act(seq, demands, elasticity))
    return actions


@pytest.mark.slow  # seconds: left out of the fast lane
@settings(max_examples=200, deadline=None)
@given(queue=queues(), depth=st.integers(1, 3),
       busy=st.fixed_dictionaries({"cpu": st.integers(0, 8), "gpu": st.integers(0, 4)}))
def test_a_pass_never_exceeds_capacity_and_honours_demands(queue, depth, busy):
    capacity = {"cpu": {"n0": 8, "n1": 6}, "gpu": {"g0": 8, "g1": 4}, "api.x": {"default": 3}}
    manager = CountedUnitsManager(capacity)
    manager.in_use["cpu"]["n0"] = busy["cpu"]
    manager.in_use["gpu"]["g1"] = busy["gpu"]
    placements = schedule(manager, queue, depth=depth)
    for placement in placements:
        action = placement.action
        assert set(placement.units) == set(action.demands)
        for resource, units in placement.units.items():
            assert units in action.demands[resource].choices
            if action.key_resource != resource or DurationModel().t1(action) is None:
                assert units == action.demands[resource].min
        manager.allocate(action, placement.units, placement.pools)  # raises on over-allocation
    for resource, pools in capacity.items():
        for pool, cap in pools.items():
            assert 0 <= manager.in_use[resource][pool] <= cap


def test_a_queue_longer_than_the_horizon_still_starts_work():
    # Regression: the estimate once cut (members + rest) to the horizon, so each eviction dropped one waiting
    # action from the objective, every eviction "improved" it, and a long queue started nothing.
    manager = CountedUnitsManager({"gpu": {f"n{i}": 8 for i in range(5)}})
    elastic = Elasticity("gpu", ((1, 1.0), (8, 0.7)), t1=20.0)
    queue = [act(i, {"gpu": Demand((1, 2, 4, 8))}, elastic) for i in range(512)]
    placements = Scheduler([manager], DurationModel(), depth=2, horizon=64).schedule(queue, [], now=0.0).placements
    assert sum(p.units["gpu"] for p in placements) == 40  # every unit busy, one action per unit


def test_a_plan_not_carried_out_is_shared_afresh_after_reshare():
    """Unchanged pools keep their last shares, so a start the broker could not carry out (its allocation
    failed) would strand the action; ``reshare`` makes the next pass place it again."""
    manager = CountedUnitsManager({"cpu": {"n": 8}}, resizable=frozenset({"cpu"}))
    scheduler = Scheduler([manager], DurationModel())
    queue = [act(1, {"cpu": Demand.range(1, 8)}, Elasticity("cpu", LINEAR, t1=10.0))]
    [placement] = scheduler.schedule(queue, [], now=0.0).placements
    assert placement.units["cpu"] == 8
    assert scheduler.schedule(queue, [], now=1.0).placements == []  # nothing changed: the share stands
    scheduler.reshare()
    [again] = scheduler.schedule(queue, [], now=2.0).placements
    assert again.action is queue[0] and again.units["cpu"] == 8


def test_greedy_eviction_plans_the_same_whatever_depth_its_tables_start_with():
    """Each pool's DP table holds the prefixes of its last EVICTION_DEPTH members dropped, and is filled again twice
    as deep when the walk goes further: the plan is the one a table holding every prefix gives."""
    deepest = 0
    for seed in range(6):
        rng = random.Random(seed)
        queue = [act(seq, {"cpu": Demand.range(1, 8)},
                     Elasticity("cpu", ((1, 1.0), (8, rng.uniform(0.3, 0.9))), t1=rng.lognormvariate(2.0, 1.0)))
                 for seq in range(30)]
        plans = []
        for depth in (0, 1, 3, 10**6):
            with mock.patch.object(scheduler, "EVICTION_DEPTH", depth):
                manager = CountedUnitsManager({"cpu": {"n0": 16, "n1": 12}})
                plan = Scheduler([manager], DurationModel(), depth=2, horizon=16).schedule(queue, [], now=0.0)
                plans.append([(p.action.seq, p.units, p.pools) for p in plan.placements])
        assert plans[0] == plans[1] == plans[2] == plans[3]
        deepest = max(deepest, 28 - len(plans[0]))  # 28 candidates at one core each; the rest were dropped
    assert deepest >= 4  # the walk went past the shallow tables, so they were filled again
