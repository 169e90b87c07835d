"""The scheduling cycle (``tangram/sched/cycle.py``) driven by hand, as vLLM's scheduler tests drive theirs: submit,
pass, apply, end, assert. Its manager is the real counted one (``managers/basic/manager.py``); no broker, no store, no
clock."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

from managers.basic.manager import BasicManager, BasicResourceConfig
from tangram.core.action import Action, Demand, Kind
from tangram.core.seam import Allocation, CyclePlugins, ResourceManager
from tangram.sched.cycle import Cycle
from tangram.sched.profile import DEFAULT_PROFILE, ElasticArgs, EstimateArgs, HrrsArgs, SchedulerProfile
from tangram.sched.reserved_shares import ReservedShares
from tangram.sched.scheduler import Plan
from tangram.sched.tenants import TaskCaps, Tenancy

ROOT = Path(__file__).resolve().parent.parent
RESOURCE = "lease.slots"


class Log:
    """A watcher and a foresight that write down what they are told, in order."""

    foresees = True

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def submitted(self, action: Action) -> None:
        self.events.append(("submitted", action.id))

    def ended(self, action: Action) -> None:
        self.events.append(("ended", action.id))

    def foresee(self, upcoming: Iterable[Action]) -> None:
        self.events.append(("foresee", [action.id for action in upcoming]))


class Bench:
    """A cycle over ``slots`` counted units, applying each plan as the broker does (starts, in plan order)."""

    def __init__(self, slots: int = 2, reserved: dict[str, int] | None = None) -> None:
        self.manager = BasicManager([BasicResourceConfig(name=RESOURCE, concurrency=slots)], clock=lambda: 0.0)
        self.log = Log()
        shares = ReservedShares(RESOURCE)
        shares.reserve(reserved or {})
        self.cycle = Cycle([self.manager], SchedulerProfile(estimates=EstimateArgs(arrivals=False)),
                           plugins=[CyclePlugins(reserve_order=shares, watchers=(self.log,))], foresight=[self.log])
        self.running: dict[str, tuple[Action, list[tuple[ResourceManager, Allocation]]]] = {}

    def submit(self, name: str, task: str = "t", now: float = 0.0) -> Action:
        action = Action(task=task, kind=Kind.LEASE, demands={RESOURCE: Demand.fixed(1)}, spec={}, id=name,
                        signature="hold")
        self.cycle.submit(action, now)
        return action

    def pass_once(self, now: float = 0.0) -> list[str]:
        """The ids the pass started."""
        def apply(plan: Plan) -> None:
            self.log.events.append(("apply", [placement.action.id for placement in plan.placements]))
            for placement in plan.placements:
                self.running[placement.action.id] = (placement.action, self.cycle.start(placement, now))

        plan = self.cycle.pass_once(now, [action for action, _ in self.running.values()], apply)
        return [placement.action.id for placement in plan.placements]

    def end(self, name: str, now: float, seconds: float) -> None:
        action, allocations = self.running.pop(name)
        for manager, allocation in allocations:
            manager.release(allocation)
        action.execution_s = seconds
        self.cycle.ended(action, now, succeeded=True)


def test_a_pass_starts_in_queue_order_and_foresight_sees_what_is_left_after_the_plan_is_applied() -> None:
    bench = Bench(slots=2)
    for name in ("a", "b", "c"):
        bench.submit(name)
    assert bench.pass_once() == ["a", "b"]
    assert bench.log.events[3:] == [("apply", ["a", "b"]), ("foresee", ["c"])]
    assert [action.id for action in bench.cycle.queue] == ["c"]
    assert bench.pass_once() == []  # both units held


def test_submits_and_ends_reach_the_watchers_and_teach_the_duration_model() -> None:
    bench = Bench(slots=1)
    action = bench.submit("a")
    bench.pass_once()
    assert bench.cycle.durations.t1(action) is None
    bench.end("a", now=4.0, seconds=4.0)
    assert bench.cycle.durations.t1(action) == 4.0
    assert [event for event in bench.log.events if event[0] in ("submitted", "ended")] == [
        ("submitted", "a"), ("ended", "a")]


def test_an_action_backed_off_after_a_failed_allocation_waits_and_the_next_one_takes_its_unit() -> None:
    bench = Bench(slots=1)
    bench.submit("a")
    bench.submit("b")
    delay = bench.cycle.backoff.failed("a", 0.0)
    assert delay is not None
    assert bench.pass_once(now=0.0) == ["b"]
    bench.end("b", now=1.0, seconds=1.0)
    if delay > 1.0:
        assert bench.pass_once(now=1.0) == []
    assert bench.pass_once(now=delay) == ["a"]
    assert not bench.cycle.backoff  # a start forgets the back-off


def test_a_task_at_its_running_cap_waits_while_another_task_goes() -> None:
    bench = Bench(slots=3)
    bench.cycle.ledger.tenancy = Tenancy(tasks={"capped": TaskCaps(max_running=1)})
    for name in ("c1", "c2"):
        bench.submit(name, task="capped")
    bench.submit("o1", task="other")
    started = bench.pass_once()
    for name in started:
        bench.cycle.ledger.hold(bench.running[name][0])
    assert started == ["c1", "o1"]


def test_a_reserved_task_goes_ahead_of_earlier_actions_up_to_its_reservation() -> None:
    bench = Bench(slots=1, reserved={"slo": 1})
    bench.submit("early", task="other")
    bench.submit("owed", task="slo")
    assert bench.pass_once() == ["owed"]


def test_the_cycle_takes_its_plugins_and_their_arguments_from_the_profile() -> None:
    manager = BasicManager([BasicResourceConfig(name=RESOURCE, concurrency=1)], clock=lambda: 0.0)
    default = Cycle([manager], DEFAULT_PROFILE)
    assert default.setup_order is None and default.arrivals is not None  # FCFS, arrivals on
    profile = SchedulerProfile(queue_order_by_resource={RESOURCE: "hrrs", "gpu": "hrrs"},
                               hrrs=HrrsArgs(max_wait_s=30.0, overdue_floor_s=5.0),
                               elastic=ElasticArgs(depth=3, horizon=32, share_by="remaining"),
                               estimates=EstimateArgs(default_duration_s=2.0, ewma_alpha=0.5, arrivals=False))
    cycle = Cycle([manager], profile)
    assert cycle.setup_order is not None and cycle.setup_order.resources == {RESOURCE}  # no manager owns "gpu"
    assert (cycle.setup_order.max_wait_s, cycle.setup_order.overdue_floor_s) == (30.0, 5.0)
    scheduler = cycle.scheduler
    assert (scheduler.depth, scheduler.horizon, scheduler.share_by_remaining) == (3, 32, True)
    assert (cycle.durations.default_s, cycle.durations.alpha, cycle.arrivals) == (2.0, 0.5, None)
    assert Cycle([manager], SchedulerProfile(queue_order="hrrs")).setup_order is not None  # every resource


def test_the_pass_is_composed_once_and_both_the_broker_and_the_simulator_run_it() -> None:
    """Only the cycle calls the scheduler; the broker and the simulator each build one and run its pass."""
    callers = set()
    for package in ("tangram", "managers"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in ("schedule", "pass_once") \
                        and isinstance(node.ctx, ast.Load):
                    callers.add((path.relative_to(ROOT).as_posix(), node.attr))
    assert callers == {("tangram/sched/cycle.py", "schedule"), ("tangram/broker.py", "pass_once"),
                       ("tangram/sim/broker_station.py", "pass_once")}
