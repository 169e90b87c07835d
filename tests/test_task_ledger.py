"""The per-task caps as the cycle's first queue filter (``tangram/sched/tenants.py``), with the environment caps of
a manager that offers its environments as a plugin; the broker-level behaviour (429s, ``Retry-After``) is in
``test_tenant_caps.py``."""

from __future__ import annotations

import pytest

from managers.basic.manager import BasicManager, BasicResourceConfig
from tangram.core.action import Action, Demand, Kind
from tangram.core.seam import CyclePlugins
from tangram.sched.cycle import Cycle
from tangram.sched.profile import EstimateArgs, SchedulerProfile
from tangram.sched.tenants import OverCap, TaskCaps, TaskLedger, Tenancy

RESOURCE = "lease.slots"
MIB = 512


class Sandboxes:
    """An environment host: trajectories that hold an environment, per task; a new trajectory needs ``MIB``."""

    def __init__(self) -> None:
        self.open: dict[str, set[str]] = {}

    def environment_demand(self, action: Action) -> int | None:
        trajectory = action.trajectory
        return None if trajectory is None or trajectory in self.open.get(action.task, set()) else MIB

    def task_usage(self, task: str) -> tuple[int, int]:
        count = len(self.open.get(task, ()))
        return count, count * MIB

    def holds_environment(self, task: str, trajectory: str) -> bool:
        return trajectory in self.open.get(task, set())


def action(name: str, task: str = "t", trajectory: str | None = None) -> Action:
    return Action(task=task, kind=Kind.LEASE, demands={RESOURCE: Demand.fixed(1)}, spec={}, id=name,
                  trajectory=trajectory, signature="hold")


def ledger(**caps: int) -> TaskLedger:
    return TaskLedger(Tenancy(tasks={"t": TaskCaps(**caps)}))


def ids(actions: object) -> list[str]:
    return [a.id for a in actions]  # type: ignore[attr-defined]


def test_a_task_without_caps_passes_whole_and_the_filter_is_skipped() -> None:
    queue = [action("a"), action("b")]
    assert not TaskLedger().limited
    assert ids(ledger(max_running=5).admissible(queue, None)) == ["a", "b"]


def test_the_running_cap_counts_what_the_task_holds_and_leaves_its_later_actions_queued() -> None:
    caps = ledger(max_running=2)
    caps.hold(action("held"))
    assert ids(caps.admissible([action("a"), action("b"), action("c", task="other")], None)) == ["a", "c"]
    caps.unhold(action("held"))
    assert ids(caps.admissible([action("a"), action("b")], None)) == ["a", "b"]


def test_one_new_environment_per_trajectory_counts_against_the_environment_cap() -> None:
    host = Sandboxes()
    host.open["t"] = {"old"}
    caps = ledger(max_environments=2)
    queue = [action("a1", trajectory="new"), action("a2", trajectory="new"), action("b1", trajectory="newer"),
             action("o1", trajectory="old")]
    # "old" already holds one of the two; "new" takes the other, twice over; "newer" would be a third
    assert ids(caps.admissible(queue, host)) == ["a1", "a2", "o1"]


def test_the_memory_cap_leaves_out_an_environment_that_would_pass_it() -> None:
    host = Sandboxes()
    caps = ledger(max_memory_mb=MIB + MIB // 2)
    queue = [action("a", trajectory="x"), action("b", trajectory="y"), action("c")]
    assert ids(caps.admissible(queue, host)) == ["a", "c"]  # "c" creates no environment


def test_a_submit_that_would_create_one_environment_too_many_is_refused_whole() -> None:
    host = Sandboxes()
    caps = ledger(max_environments=1)
    caps.queue(action("queued", trajectory="x"))
    with pytest.raises(OverCap) as refused:
        caps.check_submit([action("more", trajectory="x"), action("new", trajectory="y")], host, lambda task: 1)
    assert (refused.value.task, refused.value.extra["cap"]) == ("t", "max_environments")
    caps.check_submit([action("more", trajectory="x")], host, lambda task: 1)  # its trajectory's, not new


def cycle(*plugins: CyclePlugins, slots: int = 4) -> Cycle:
    manager = BasicManager([BasicResourceConfig(name=RESOURCE, concurrency=slots)], clock=lambda: 0.0)
    return Cycle([manager], SchedulerProfile(estimates=EstimateArgs(arrivals=False)), plugins=plugins)


def test_the_cycle_counts_the_environments_its_plugins_offer_and_starts_none_beyond_the_cap() -> None:
    host = Sandboxes()
    capped = cycle(CyclePlugins(environments=host))
    assert capped.environment_host is host
    capped.ledger.tenancy = Tenancy(tasks={"t": TaskCaps(max_environments=1)})
    for name, trajectory in (("a", "x"), ("b", "y"), ("c", "x")):
        capped.submit(action(name, trajectory=trajectory), 0.0)
    plan = capped.pass_once(0.0, [], lambda plan: None)
    assert [p.action.id for p in plan.placements] == ["a", "c"]


def test_without_an_environment_host_the_environment_caps_hold_nothing_back() -> None:
    blind = cycle()
    assert blind.environment_host is None
    blind.ledger.tenancy = Tenancy(tasks={"t": TaskCaps(max_environments=1)})
    for name, trajectory in (("a", "x"), ("b", "y")):
        blind.submit(action(name, trajectory=trajectory), 0.0)
    assert [p.action.id for p in blind.pass_once(0.0, [], lambda plan: None).placements] == ["a", "b"]


def test_two_environment_hosts_are_refused() -> None:
    with pytest.raises(ValueError, match="one environment host at most"):
        cycle(CyclePlugins(environments=Sandboxes()), CyclePlugins(environments=Sandboxes()))
