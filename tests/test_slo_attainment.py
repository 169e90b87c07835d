"""Reward phases and SLO windows (``tangram/slo/attainment.py``), on actions whose times are set by hand."""

from __future__ import annotations

import math

import pytest

from tangram.core.action import Action, Demand, Kind
from tangram.slo.attainment import SloAttainment
from tangram.slo.plan import SloPlan

#: tolerates 1.2x; 10 s between phases; compared with one dedicated GPU
PLAN = SloPlan(slowdown=1.2, service="judge", actions=4, action_s=2.0, other_s=10.0, dedicated_gpus=1)


def tracker(**plans: SloPlan) -> SloAttainment:
    slo = SloAttainment(lambda action: action.spec["service"], "gpu")
    slo.plan(plans or {"t": PLAN})
    return slo


def reward(at: float, task: str = "t", service: str = "judge", kind: Kind = Kind.REWARD) -> Action:
    action = Action(task=task, kind=kind, demands={"gpu": Demand((1,))}, spec={"service": service})
    action.submitted_at = at
    return action


def end(slo: SloAttainment, action: Action, at: float, execution_s: float, restore_s: float | None = None,
        gpus: int = 1) -> None:
    action.finished_at, action.execution_s, action.restore_s = at, execution_s, restore_s
    action.units = {"gpu": gpus}
    slo.ended(action)


def test_a_phase_is_one_window_from_its_first_submit_until_none_is_queued_or_running():
    slo = tracker()
    first, second = reward(100.0), reward(100.5)
    slo.submitted(first)
    slo.submitted(second)
    end(slo, first, 102.0, 2.0)
    assert slo.tasks["t"].windows == 0  # the second is still out: the phase is open
    end(slo, second, 104.0, 1.0)
    # observed 4 s; solo: longest 2 + (2 + 1) GPU-s / 1 GPU = 5 s; 10 + 4 <= 1.2 (10 + 5)
    attained = slo.tasks["t"]
    assert (attained.windows, attained.within, attained.fraction) == (1, 1, 1.0)
    assert attained.last_slowdown == pytest.approx(14 / 15)

    late = reward(200.0)  # a new phase
    slo.submitted(late)
    end(slo, late, 220.0, 1.0)  # 20 s observed against a solo 2 s: 30 > 1.2 * 12
    assert (attained.windows, attained.within, attained.fraction) == (2, 1, 0.5)
    assert attained.last_slowdown == pytest.approx(30 / 12)


def test_restores_are_not_execution_and_wider_actions_weigh_their_gpus():
    slo = tracker(t=SloPlan(slowdown=1.0, service="judge", actions=2, action_s=5.0, other_s=0.0, dedicated_gpus=2))
    wide, narrow = reward(0.0), reward(0.0)
    slo.submitted(wide)
    slo.submitted(narrow)
    end(slo, wide, 4.0, 4.0, restore_s=1.0, gpus=2)  # 3 s on 2 GPUs
    end(slo, narrow, 4.0, 2.0)  # 2 s on 1 GPU
    # solo = 3 + (3*2 + 2*1) / 2 = 7 against 4 observed
    assert slo.tasks["t"].last_slowdown == pytest.approx(4 / 7) and slo.tasks["t"].within == 1


def test_other_tasks_services_and_kinds_and_unseen_actions_are_not_counted():
    slo = tracker()
    ignored = [reward(0.0, task="unplanned"), reward(0.0, service="other"), reward(0.0, kind=Kind.EXEC)]
    for action in ignored:
        slo.submitted(action)
        end(slo, action, 1.0, 1.0)
    end(slo, reward(0.0), 1.0, 1.0)  # recovered from the store: never seen submitted
    assert slo.tasks["t"].windows == 0 and set(slo.tasks) == {"t"}


def test_a_phase_with_nothing_executed_that_took_time_is_unbounded():
    slo = tracker(t=SloPlan(slowdown=1.5, service="judge", actions=1, action_s=1.0, other_s=0.0, dedicated_gpus=1))
    timed_out = reward(0.0)
    slo.submitted(timed_out)
    timed_out.finished_at = 3.0  # ended while queued: no execution, no units
    slo.ended(timed_out)
    assert slo.tasks["t"].within == 0 and math.isinf(slo.tasks["t"].last_slowdown or 0.0)


def test_a_changed_plan_drops_the_open_phase_and_an_unplanned_task_is_forgotten():
    slo = tracker()
    before = reward(0.0)
    slo.submitted(before)
    slo.plan({"t": SloPlan(slowdown=2.0, service="judge", actions=1, action_s=1.0, other_s=1.0, dedicated_gpus=1)})
    end(slo, before, 1.0, 1.0)  # planned otherwise: not a window
    assert slo.tasks["t"].windows == 0
    after = reward(2.0)
    slo.submitted(after)
    end(slo, after, 3.0, 1.0)
    assert slo.tasks["t"].windows == 1
    slo.plan({})
    assert slo.tasks == {}
