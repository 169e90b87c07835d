"""Malleable scheduling over counted units: the cycle's plans, applied as the simulator applies them (shrinks,
starts, grows), keep the manager's books exact and never stall the queue."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from managers.counted import CountedUnitsManager
from tangram.core.action import Action, Demand, Elasticity, Kind
from tangram.core.seam import Allocation, ResourceManager
from tangram.sched import dispatch
from tangram.sched.cycle import Cycle
from tangram.sched.profile import EstimateArgs, SchedulerProfile
from tangram.sched.scheduler import Plan, Resize

POOLS = {"n0": 8, "n1": 8}

Running = dict[str, tuple[Action, list[tuple[ResourceManager, Allocation]]]]


class Harness:
    """A cycle over a resizable counted manager, driven like ``tangram.sim.broker_station``."""

    def __init__(self, pools: dict[str, int] = POOLS) -> None:
        self.pools = pools
        self.manager = CountedUnitsManager({"cpu": pools}, resizable=frozenset({"cpu"}))
        self.cycle = Cycle([self.manager], SchedulerProfile(estimates=EstimateArgs(arrivals=False)))
        self.running: Running = {}
        self.submitted: set[str] = set()
        self.started: set[str] = set()
        self.seq = 0
        self.now = 0.0

    def submit(self, elastic: bool, t1: float, decay: float) -> None:
        self.seq += 1
        if elastic:
            efficiency = tuple((m, max(0.2, 1.0 - decay * (m - 1))) for m in (1, 2, 4, 8))
            action = Action(task="t", kind=Kind.EXEC, demands={"cpu": Demand.range(1, 8)},
                            elasticity=Elasticity("cpu", efficiency, t1=t1))
        else:
            action = Action(task="t", kind=Kind.EXEC, demands={"cpu": Demand.fixed(1)})
        action.seq = self.seq
        action.submitted_at = self.now
        self.cycle.submit(action, self.now)
        self.submitted.add(action.id)

    def complete(self, index: int) -> None:
        if not self.running:
            return
        action_id = sorted(self.running)[index % len(self.running)]
        _, allocations = self.running.pop(action_id)
        dispatch.release(allocations)

    def schedule(self) -> Plan:
        plan = self.cycle.pass_once(self.now, [a for a, _ in self.running.values()], self._apply)
        self.check()
        return plan

    def _apply(self, plan: Plan) -> None:
        for decision in plan.resizes:
            assert decision.action.id in self.running, "resize of an action that does not run"
        for decision in plan.shrinks():
            self._resize(decision)
        for placement in plan.placements:
            action = placement.action
            assert action.id not in self.started, "an action started twice"
            self.running[action.id] = (action, self.cycle.start(placement, self.now))
            self.started.add(action.id)
        for decision in plan.grows():
            self._resize(decision)

    def _resize(self, decision: Resize) -> None:
        _, allocations = self.running[decision.action.id]
        self.cycle.resize(allocations, decision, self.now)

    def check(self) -> None:
        held = dict.fromkeys(self.pools, 0)
        for action, allocations in self.running.values():
            [(_, allocation)] = allocations
            pool = allocation.pools["cpu"]
            assert action.units["cpu"] == allocation.units["cpu"]
            held[pool] += allocation.units["cpu"]
            malleable = action.malleable
            if malleable is not None:
                assert malleable.pool == pool
                assert malleable.units == allocation.units["cpu"]
                assert malleable.floor <= malleable.units <= malleable.workers
                assert malleable.workers <= action.demands["cpu"].max
            else:
                assert allocation.units["cpu"] in action.demands["cpu"].choices
        for pool, capacity in self.pools.items():
            in_use = self.manager.in_use["cpu"][pool]
            assert 0 <= in_use <= capacity
            assert in_use == held[pool]


submit = st.tuples(st.just("submit"), st.booleans(), st.floats(0.5, 60.0), st.floats(0.0, 0.1))
step = st.one_of(
    submit, submit,  # twice as likely: the pools fill up and running actions get shrunk
    st.tuples(st.just("complete"), st.integers(0, 63)),
    st.tuples(st.just("tick"), st.floats(0.0, 5.0)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(step, min_size=1, max_size=80))
def test_resized_books_stay_exact_and_nothing_stalls(steps):
    h = Harness()
    for op, *args in steps:
        if op == "submit":
            h.submit(*args)
        elif op == "complete":
            h.complete(args[0])
        else:
            h.now += args[0]
        h.schedule()  # every event triggers a pass, as in the broker
    # drain: end whatever runs, one at a time; every queued action must start
    for _ in range(10 * len(h.submitted) + 10):
        if not h.running and not len(h.cycle.queue):
            break
        h.now += 1.0
        if h.running:
            h.complete(0)
        plan = h.schedule()
        assert h.running or plan.placements or not len(h.cycle.queue), "queue stalled with nothing running"
    assert not len(h.cycle.queue)
    assert h.started == h.submitted
    assert all(v == 0 for v in h.manager.in_use["cpu"].values())


def test_malleable_actions_shrink_for_queued_rigid_ones_and_grow_back():
    h = Harness()
    h.submit(True, 30.0, 0.0)
    h.submit(True, 30.0, 0.0)
    h.schedule()
    assert sorted(a.units["cpu"] for a, _ in h.running.values()) == [8, 8]  # both pools full
    big = {a.malleable.pool: a for a, _ in h.running.values()}
    assert all(a.malleable.workers == 8 for a in big.values())
    for _ in range(3):
        h.submit(False, 0.0, 0.0)
    h.now = 1.0
    plan = h.schedule()
    assert len(plan.placements) == 3  # on units lent by the running ones, which were shrunk to make room
    assert sum(a.units["cpu"] for a in big.values()) == 13
    assert all(a.malleable.resizes == 1 for a in big.values() if a.units["cpu"] < 8)
    for action_id in [i for i, (a, _) in h.running.items() if a.malleable is None]:
        _, allocations = h.running.pop(action_id)
        dispatch.release(allocations)
    h.now = 2.0
    plan = h.schedule()
    assert plan.resizes  # the shrunk ones grow back into the freed units
    assert [a.units["cpu"] for a in big.values()] == [8, 8]


def test_a_run_started_beside_a_call_grows_when_the_call_ends():
    """At the pass after its start a run's floor is no longer among the pool's spare units. When a one-core call it
    started beside ends, the spare count is the one of its start again, yet the freed core is new: a pool's shares
    were kept when its spare count and its actions' ids were unchanged, and the core idled."""
    h = Harness({"n0": 4})
    h.submit(False, 0.0, 0.0)
    h.schedule()
    [(call_id, _)] = h.running.items()
    h.submit(True, 30.0, 0.0)
    h.now = 1.0
    h.schedule()
    [run] = [a for a, _ in h.running.values() if a.malleable is not None]
    assert run.units["cpu"] == 3
    dispatch.release(h.running.pop(call_id)[1])
    h.now = 2.0
    h.schedule()
    assert run.units["cpu"] == 4


@pytest.mark.parametrize("t1, starts", [(2.0, True), (1000.0, False)])
def test_a_linear_run_gives_its_core_to_a_shorter_run_and_keeps_it_from_a_longer_one(t1, starts):
    """Linear speed-ups: a running run's cores gain what a queued run's would, so remaining work decides. A short
    run starts on every core of its pool but the long run's floor (shortest first, at no cost in throughput); a
    longer one waits and the running ones keep every core."""
    h = Harness()
    h.submit(True, 100.0, 0.0)
    h.submit(True, 100.0, 0.0)
    h.schedule()
    running = [a for a, _ in h.running.values()]
    assert sorted(a.units["cpu"] for a in running) == [8, 8]
    h.submit(True, t1, 0.0)
    h.now = 1.0
    plan = h.schedule()
    assert [p.units["cpu"] for p in plan.placements] == ([7] if starts else [])
    assert sorted(a.units["cpu"] for a in running) == ([1, 8] if starts else [8, 8])


def test_resize_refuses_over_allocation_and_non_resizable_resources():
    manager = CountedUnitsManager({"cpu": {"n0": 4}, "gpu": {"g0": 2}}, resizable=frozenset({"cpu"}))
    action = Action(task="t", kind=Kind.EXEC, demands={"cpu": Demand.range(1, 4), "gpu": Demand.fixed(1)})
    allocation = manager.allocate(action, {"cpu": 2, "gpu": 1}, {"cpu": "n0", "gpu": "g0"})
    cpu = manager.resizing("cpu")
    assert cpu is not None and manager.resizing("gpu") is None
    cpu.resize(allocation, 4)
    assert manager.in_use["cpu"]["n0"] == 4 and allocation.units["cpu"] == 4
    with pytest.raises(RuntimeError):
        cpu.resize(allocation, 5)
    assert manager.in_use["cpu"]["n0"] == 4  # a refused resize changes nothing
    cpu.resize(allocation, 1)
    assert manager.in_use["cpu"]["n0"] == 1
    manager.release(allocation)
    assert manager.in_use == {"cpu": {"n0": 0}, "gpu": {"g0": 0}}
    fit = manager.fit()
    fit.lend("cpu", "n0", 2)
    assert fit.free_before("cpu", "n0") == 6
    assert manager.fit().free_before("cpu", "n0") == 4  # lending touches only that pass's fit
