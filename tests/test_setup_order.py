"""The setup-aware (HRRS) queue order (issue 18): grouping by what is set up, other resources' order kept, and the
starvation bound under adversarial arrivals."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from tangram.core.action import Action
from tangram.parse import parse_action
from tangram.sched.setup_order import SetupAwareOrder

#: the services whose instances are set up (resident); any other needs a restore of RESTORE_S
RESTORE_S = 10.0


def reward(seq: int, service: str, submitted_at: float) -> Action:
    action = parse_action({"task": "t", "kind": "reward", "demand": {"gpu": 1},
                           "spec": {"service": service, "input": {"pairs": [["a", "b"]]}}})
    action.seq, action.submitted_at = seq, submitted_at
    return action


def order_for(resident: set[str], max_wait_s: float = 60.0, expected_s: float = 1.0,
              overdue_floor_s: float | None = None) -> SetupAwareOrder:
    def setup_costs(actions: Sequence[Action]) -> dict[str, float]:
        return {a.id: RESTORE_S for a in actions if a.spec["service"] not in resident}
    return SetupAwareOrder({"gpu"}, lambda action: expected_s, setup_costs, max_wait_s, overdue_floor_s)


def services(actions: list[Action]) -> list[str]:
    return [a.spec.get("service", a.kind.value) for a in actions]


def test_actions_of_the_resident_service_go_first_and_other_resources_keep_their_places() -> None:
    queue = [reward(1, "x", 0.0), reward(2, "y", 0.1), reward(3, "x", 0.2), reward(4, "y", 0.3)]
    tool = parse_action({"task": "t", "kind": "exec", "demand": {"cpu": 1}, "spec": {"command": "true"}})
    tool.seq, tool.submitted_at = 5, 0.05
    queue.insert(1, tool)
    ordered = order_for(resident={"y"}).order(queue, now=1.0)
    assert services(ordered) == ["y", "exec", "y", "x", "x"]  # the exec action keeps its slot
    assert [a.seq for a in ordered if a.kind.value == "reward"] == [2, 4, 1, 3]  # FCFS within a service
    assert services(order_for(resident={"x", "y"}).order(queue, now=1.0))[0] == "x"  # nothing to save: oldest


def test_a_long_wait_outranks_a_setup_saved() -> None:
    """HRRS, not "resident first": the priority grows with the wait, so an old action of another service wins."""
    old, fresh = reward(1, "x", 0.0), reward(2, "y", 99.5)
    assert services(order_for(resident={"y"}, max_wait_s=math.inf).order([old, fresh], now=100.0)) == ["x", "y"]


def test_a_longer_action_is_not_passed_over_for_its_length() -> None:
    """One E for every ranked action (the mean of their expected times), not each one's own: among actions that
    need the same setup the order is FCFS, whatever their lengths. With its own E, the short action (1 s, waited
    1 s: P = 2) would go ahead of the long one (10 s, waited 5 s: P = 1.5). A switch is still handicapped: the
    action needing a restore waits (E + setup) / E times as long as a resident one before it goes first."""
    long, short = reward(1, "y", 95.0), reward(2, "y", 99.0)

    def order(resident: set[str]) -> SetupAwareOrder:
        def setup_costs(actions: Sequence[Action]) -> dict[str, float]:
            return {a.id: RESTORE_S for a in actions if a.spec["service"] not in resident}
        return SetupAwareOrder({"gpu"}, lambda action: 10.0 if action is long else 1.0, setup_costs, math.inf)

    assert [a.seq for a in order({"y"}).order([short, long], now=100.0)] == [1, 2]
    assert [a.seq for a in order(set()).order([short, long], now=100.0)] == [1, 2]
    # both 1 s long, so E = 1: a restore of 10 s needs (1 + 10) / 1 = 11 times the resident action's wait (1 s)
    switching, resident = reward(3, "x", 100.0 - 11.5), reward(4, "y", 99.0)
    assert services(order({"y"}).order([resident, switching], now=100.0)) == ["x", "y"]
    switching.submitted_at = 100.0 - 10.5
    assert services(order({"y"}).order([resident, switching], now=100.0)) == ["y", "x"]


def starts_after(max_wait_s: float, steps: int, overdue_floor_s: float | None = None) -> float | None:
    """One GPU; every 0.1 s two actions of the resident service arrive and the best ranked action starts (one per
    step: the resident service overloads the GPU). Returns how long the lone action of another service waited,
    None if it never started within ``steps``."""
    order = order_for(resident={"y"}, max_wait_s=max_wait_s, expected_s=0.01, overdue_floor_s=overdue_floor_s)
    lone = reward(0, "x", 0.0)
    queue = [lone]
    for step in range(1, steps + 1):
        now = step * 0.1
        queue += [reward(2 * step, "y", now - 0.05), reward(2 * step + 1, "y", now - 0.05)]
        first = order.order(queue, now)[0]
        queue.remove(first)
        if first is lone:
            return now
    return None


@pytest.mark.slow  # seconds: left out of the fast lane
def test_every_action_starts_within_the_bound_whatever_arrives() -> None:
    """Adversarial arrivals: a resident service that overloads the GPU keeps the other one waiting for ever under
    the paper's rule alone (its ratio grows as W / 10 s, the oldest resident one's as W / 0.01 s with W growing as
    fast); with the bound it starts once it has waited ``max_wait_s``, at the first pass after."""
    assert starts_after(max_wait_s=math.inf, steps=2000) is None  # 200 s and counting: starved
    for bound in (1.0, 5.0, 30.0):
        waited = starts_after(max_wait_s=bound, steps=2000)
        assert waited is not None and bound <= waited < bound + 0.1 + 1e-9
    # overdue sooner where the queue is short: never later than the bound
    for floor, bound in ((1.0, 30.0), (5.0, 30.0), (30.0, 30.0)):
        waited = starts_after(max_wait_s=bound, steps=2000, overdue_floor_s=floor)
        assert waited is not None and waited < bound + 0.1 + 1e-9


def test_an_action_is_overdue_after_twice_the_queues_mean_wait_between_the_floor_and_the_bound() -> None:
    order = order_for(resident={"y"}, max_wait_s=60.0, overdue_floor_s=10.0)
    assert order.overdue_after_s([1.0, 3.0, 5.0]) == 10.0  # twice 3 s: the floor
    assert order.overdue_after_s([4.0, 12.0, 20.0]) == 24.0
    assert order.overdue_after_s([30.0, 40.0, 50.0]) == 60.0  # twice 40 s: the bound
    assert order_for(resident={"y"}, max_wait_s=60.0).overdue_after_s([1.0]) == 60.0  # no floor: the bound, fixed
    # x has waited 25 s, y's 5 s: the mean is 10 s, so x is overdue and first; with the fixed 60 s it is not, and y's
    # ratio (1 + 5 / 1) beats x's (1 + 25 / (1 + 10))
    queue = [reward(1, "x", 0.0), reward(2, "y", 20.0), reward(3, "y", 20.0), reward(4, "y", 20.0)]
    assert services(order.order(queue, now=25.0))[0] == "x"
    assert services(order_for(resident={"y"}, max_wait_s=60.0).order(queue, now=25.0))[0] == "y"
