"""What idle trajectories are expected to submit next: think times, shares and shapes learned per task."""

from __future__ import annotations

import pytest

from tangram.core.action import Action, Demand, Kind
from tangram.sched import arrivals
from tangram.sched.arrivals import GIVE_UP_THINKS, GIVE_UP_UNLEARNED_S, ArrivalModel


def action(trajectory: str, cpu: int = 1, execution_s: float = 0.5, kind: Kind = Kind.EXEC,
           demands: dict[str, Demand] | None = None) -> Action:
    made = Action(task="t", kind=kind, demands=demands or {"cpu": Demand.fixed(cpu)}, trajectory=trajectory)
    made.execution_s = execution_s
    return made


def test_next_actions_are_expected_after_the_learned_think_time() -> None:
    model = ArrivalModel(alpha=0.5)
    model.ended(action("a"), now=0.0)
    model.submitted(action("a"), now=2.0)  # think 2 s
    model.ended(action("a", execution_s=1.0), now=3.0)  # a 1 s call: its duration is learned
    model.ended(action("b", execution_s=1.0), now=4.0)
    [first, second] = model.expected("cpu", now=4.5, limit=10)
    assert first.in_s == pytest.approx(0.5) and second.in_s == pytest.approx(1.5)  # 3 + 2 - 4.5, 4 + 2 - 4.5
    assert first.units == 1 and first.duration_s == pytest.approx(1.0)
    assert model.expected("cpu", now=4.5, limit=1) == [first]  # soonest first, up to the limit
    model.submitted(action("a"), now=5.0)  # busy again: no longer expected
    assert len(model.expected("cpu", now=5.0, limit=10)) == 1


def test_only_a_tasks_share_of_next_actions_is_expected_on_a_resource() -> None:
    model = ArrivalModel(alpha=1.0)  # the last sample only
    model.ended(action("a"), now=0.0)
    model.submitted(action("a", demands={"api.x": Demand.fixed(1)}, kind=Kind.API), now=1.0)
    model.ended(action("a", demands={"api.x": Demand.fixed(1)}), now=2.0)
    model.submitted(action("a"), now=3.0)  # shares now: cpu 1.0, api.x 0.0
    model.ended(action("a"), now=4.0)
    for name in "bcd":
        model.ended(action(name), now=4.0)
    assert len(model.expected("cpu", now=4.0, limit=10)) == 4
    assert model.expected("api.x", now=4.0, limit=10) == []


def test_trajectories_that_ended_are_not_expected() -> None:
    model = ArrivalModel()
    model.ended(action("a"), now=0.0)
    model.submitted(action("a"), now=1.0)
    for name in "abc":
        model.ended(action(name), now=2.0)
    model.forget("t", "a")
    assert len(model.expected("cpu", now=2.0, limit=10, holds=lambda task, trajectory: trajectory != "b")) == 1
    assert model.expected("cpu", now=2.0 + GIVE_UP_THINKS * 1.0 + 1.0, limit=10) == []  # idle too long: gone


def test_trajectories_idle_past_their_give_up_time_are_dropped_without_a_pass_asking(monkeypatch) -> None:
    """The broker's malleable path never asks for expected arrivals, so ends alone must keep the map bounded:
    by the give-up time (also for tasks that learned nothing, whose one-action trajectories never submit again)
    and by a hard cap."""
    model = ArrivalModel()
    for i in range(100):
        model.ended(action(f"once-{i}"), now=float(i))
    assert len(model.idle) == 100
    model.ended(action("late"), now=50.5 + GIVE_UP_UNLEARNED_S)  # once-0 .. once-50 are past it
    assert list(model.idle) == [("t", f"once-{i}") for i in range(51, 100)] + [("t", "late")]
    monkeypatch.setattr(arrivals, "MAX_IDLE_TRAJECTORIES", 10)
    for i in range(50):
        model.ended(action(f"burst-{i}"), now=1000.0)
    assert list(model.idle) == [("t", f"burst-{i}") for i in range(40, 50)]  # the longest idle went first
