"""The SLO plan's response-time bound (``tangram/slo/plan.py``) against values computed by hand."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tangram.core.config_tables import table
from tangram.core.errors import ConfigError
from tangram.slo.plan import (
    Pool,
    SloPlan,
    first_breach,
    least_reservation,
    phase_bound,
    predict,
    reservations,
    reserved_bound,
)

#: two GPUs, a restore of 1 s for either service
POOL = Pool(2, {"a": 1.0, "b": 1.0})


def two_tasks(slo_a: float = 2.0, slo_b: float = 2.0) -> dict[str, SloPlan]:
    """a: 4 actions of at most 2 s, 10 s between phases; b: 2 actions of at most 3 s, 20 s between phases."""
    return {"a": SloPlan(slowdown=slo_a, service="a", actions=4, action_s=2.0, other_s=10.0, dedicated_gpus=1),
            "b": SloPlan(slowdown=slo_b, service="b", actions=2, action_s=3.0, other_s=20.0, dedicated_gpus=1)}


def test_the_fixed_point_for_two_tasks_is_the_hand_computed_one():
    # W_a = 4 (2 + 1) = 12, W_b = 2 (3 + 1) = 8; blocking = max(2 + 1, 3 + 1) = 4; each task's own restore 1.
    # a: R = 5 + 12/2 = 11 -> 5 + (12 + (1 + floor(11/20)) 8)/2 = 15 -> 5 + (12 + 1*8)/2 = 15: stops at 15.
    # b: R = 5 + 8/2 = 9 -> 5 + (8 + 1*12)/2 = 15 -> 5 + (8 + 2*12)/2 = 21 -> 5 + (8 + 3*12)/2 = 27 -> 27.
    plans = two_tasks()
    assert phase_bound("a", plans, POOL) == 15.0
    assert phase_bound("b", plans, POOL) == 27.0
    predictions = predict(plans, POOL)
    # solo: a = 2 + 4*2/1 = 10, b = 3 + 2*3/1 = 9; slowdown (other + R) / (other + solo)
    assert predictions["a"].solo_phase_s == 10.0 and predictions["b"].solo_phase_s == 9.0
    assert predictions["a"].slowdown == pytest.approx(25 / 20)
    assert predictions["b"].slowdown == pytest.approx(47 / 29)
    assert predictions["a"].within and predictions["b"].within
    assert predictions["a"].reserved_gpus == predictions["b"].reserved_gpus == 0  # the shared bound holds both
    assert not predict(two_tasks(slo_b=1.6), POOL, reserve=False)["b"].within


def test_an_overloaded_pool_has_no_bound():
    # each task puts 10 GPU-seconds on one GPU every 1 s of its step: the interference grows with the bound itself
    plans = {name: SloPlan(slowdown=2.0, service="a", actions=10, action_s=1.0, other_s=1.0, dedicated_gpus=1)
             for name in ("x", "y")}
    predictions = predict(plans, Pool(1, {"a": 0.0}))
    assert all(math.isinf(p.phase_s) and math.isinf(p.slowdown) and not p.within for p in predictions.values())
    task, prediction = first_breach(plans, Pool(1, {"a": 0.0})) or ("", None)
    assert task in plans and prediction is not None and math.isinf(prediction.slowdown)


def test_first_breach_names_the_task_worst_off_against_its_slo():
    # with reservations too: each task needs one of the two GPUs at least (below), so neither can be reserved
    assert first_breach(two_tasks(), POOL) is None
    # both break: b at 1.62 against 1.5 (1.08x its SLO) is worse off than a at 1.25 against 1.2 (1.04x) ...
    breach = first_breach(two_tasks(slo_a=1.2, slo_b=1.5), POOL)
    assert breach is not None and breach[0] == "b" and breach[1].slowdown == pytest.approx(47 / 29)
    # ... and better off than a against 1.1 (1.14x)
    breach = first_breach(two_tasks(slo_a=1.1, slo_b=1.5), POOL)
    assert breach is not None and breach[0] == "a" and breach[1].slowdown == pytest.approx(25 / 20)


def test_a_task_alone_on_a_pool_larger_than_its_deployment_is_not_slowed():
    # R = (1 + 0.5) + 0.5 + 8 (1 + 0.5) / 4 = 5 against solo 1 + 8 * 1 / 1 = 9
    plan = SloPlan(slowdown=1.0, service="a", actions=8, action_s=1.0, other_s=5.0, dedicated_gpus=1)
    prediction = predict({"t": plan}, Pool(4, {"a": 0.5}))["t"]
    assert prediction.phase_s == 5.0 and prediction.slowdown == pytest.approx(10 / 14) and prediction.slowdown <= 1
    assert first_breach({"t": plan}, Pool(4, {"a": 0.5})) is None


@pytest.mark.parametrize("field", ["slowdown", "actions", "action_s", "other_s", "dedicated_gpus", "efficiency"])
def test_a_plan_out_of_range_is_refused_naming_the_field(field):
    fields = {"slowdown": 1.5, "service": "a", "actions": 1, "action_s": 1.0, "other_s": 1.0, "dedicated_gpus": 1,
              "efficiency": 1.0}
    assert table(SloPlan, fields, "p") == SloPlan(**fields)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as refused:
        table(SloPlan, {**fields, field: -1}, "p")
    assert refused.value.key == f"p.{field}"


def test_a_declared_mean_and_deviation_plan_a_phase_at_the_quantile_of_its_sum_never_above_the_longest():
    worst = SloPlan(slowdown=1.5, service="a", actions=100, action_s=6.0, other_s=10.0, dedicated_gpus=4)
    assert worst.work_s() == 600.0
    stochastic = replace(worst, action_mean_s=2.0, action_sd_s=1.0)
    assert stochastic.work_s() == pytest.approx(100 * 2.0 + 3.09 * 1.0 * 10)  # 200 + z * sd * sqrt(100)
    assert stochastic.solo_phase_s() == pytest.approx(6.0 + 230.9 / 4)
    # the pool's phase work follows: restores per action on top of the planned work
    assert Pool(4, {"a": 0.5}).phase_gpu_s(stochastic) == pytest.approx(230.9 + 100 * 0.5)
    # one action: the quantile would exceed the longest, which bounds it
    assert replace(stochastic, actions=1, action_sd_s=5.0).work_s() == 6.0


def test_a_task_the_shared_bound_breaks_gets_the_fewest_gpus_that_keep_it_within():
    # b against 1.6: shared 27 s -> 47/29 = 1.62. Reserved: blocking 4 + own restore 1 + its longest action 3 + W_b 8 / g.
    # Its longest phase within 1.6 is 1.6 * 29 - 20 = 26.4 s: one GPU (16 s) does
    plans = two_tasks(slo_b=1.6)
    assert not predict(plans, POOL, reserve=False)["b"].within
    assert reserved_bound("b", plans, POOL, 1) == 16.0 and reserved_bound("b", plans, POOL, 0) == math.inf
    assert least_reservation("b", plans, POOL) == 1
    predictions = predict(plans, POOL)
    assert predictions["b"].reserved_gpus == 1 and predictions["b"].phase_s == 16.0
    assert predictions["b"].slowdown == pytest.approx(36 / 29) and predictions["b"].within
    assert predictions["a"].reserved_gpus == 0 and predictions["a"].phase_s == 15.0  # a keeps the shared bound
    assert reservations(plans, POOL) == {"b": 1} and first_breach(plans, POOL) is None
    # against 1.2 the longest is 14.8 s, so 8 / g <= 6.8: two GPUs (12 s), the whole pool, and a has none
    assert reservations(two_tasks(slo_b=1.2), POOL) == {"b": 2} and first_breach(two_tasks(slo_b=1.2), POOL) is None


def test_reservations_beyond_the_pool_break_the_slo_of_the_task_left_worst_off():
    # a at 1.2 needs two GPUs (12 / g <= 14 - 7 -> 13 s), b at 1.2 two as well: four of two. Each is predicted on what
    # the other leaves it (none), so on the shared bound: a 1.25 against 1.2, b 1.62 against 1.2 -> b
    plans = two_tasks(slo_a=1.2, slo_b=1.2)
    assert least_reservation("a", plans, POOL) == 2 and least_reservation("b", plans, POOL) == 2
    predictions = predict(plans, POOL)
    assert predictions["a"].reserved_gpus == predictions["b"].reserved_gpus == 0
    breach = first_breach(plans, POOL)
    assert breach is not None and breach[0] == "b" and breach[1].slowdown == pytest.approx(47 / 29)
    # b at 1.0: its longest phase is 9 s, 8 / g <= 1 needs eight GPUs: no reservation on two keeps it
    assert least_reservation("b", two_tasks(slo_b=1.0), POOL) is None
    breach = first_breach(two_tasks(slo_b=1.0), POOL)
    assert breach is not None and breach[0] == "b" and breach[1].reserved_gpus == 2  # the best the pool can do
