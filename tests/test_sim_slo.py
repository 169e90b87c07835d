"""``gpu-slo``: RL tasks as steps with a barrier on a shared pool (``tangram/sim/task_steps.py``), the offered tasks
(``slo_workload.py``), and the scenario's admissions through the service's own planner."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tangram.cli import main
from tangram.sched.profile import DEFAULT_PROFILE
from tangram.sim.assumptions import Assumptions
from tangram.sim.cluster import Cluster, Costs, ServiceModel
from tangram.sim.policies import POLICIES, broker
from tangram.sim.slo_scenario import _admitted
from tangram.sim.slo_workload import SloTaskParams, slo_tasks
from tangram.sim.task_steps import SloTask, StepFeed, attainment, run_steps
from tangram.sim.trace import Call
from tangram.slo.plan import Pool, SloPlan, first_breach

PLAN = SloPlan(slowdown=1.5, service="rm", actions=2, action_s=1.0, other_s=10.0, dedicated_gpus=1)


def _task(name: str, rollouts: list[list[float]], work_s: float = 1.0, train_s: float = 10.0) -> SloTask:
    steps = tuple(tuple(Call("reward", think, work_s, name) for think in step) for step in rollouts)
    return SloTask(name, steps, train_s, replace(PLAN, service=name, actions=len(rollouts[0])))


def _cluster(gpus: int, *services: str) -> Cluster:
    return Cluster(gpu_node_sizes=(gpus,), services=tuple(ServiceModel(s, dops=(1,)) for s in services),
                   costs=Costs(h2d_gb_per_s=16.0, evict_s=0.0))  # a restore takes 1 s


def test_a_step_starts_after_the_last_reward_of_the_one_before_and_its_training():
    task = _task("a", [[5.0, 2.0], [3.0, 3.0]])
    feed = StepFeed([task])
    first = feed.first()
    assert [t.start_s for t in first.trajectories] == [0.0, 0.0]
    assert feed(first.trajectories[1], 4.0) == []  # one of two ended: the step is still open
    following = feed(first.trajectories[0], 7.0)
    assert [t.start_s for t in following] == [17.0, 17.0] and feed.step_s == {"a": [17.0]}
    assert feed(following[0], 21.0) == [] and feed(following[1], 21.5) == []  # the last step: nothing follows
    assert feed.step_s == {"a": [17.0, 14.5]}


def test_steps_on_one_gpu_take_the_slowest_rollout_the_queued_rewards_and_the_training():
    task = _task("a", [[5.0, 2.0], [3.0, 3.0]], work_s=2.0)
    steps = run_steps([task], _cluster(1, "a"), POLICIES["tangram"], "solo")[0]["a"]
    # step 0: a restore from 2 to 3 s, rewards 3-5 and 5-7, training to 17; step 1 from 17: both rewards asked at
    # 20 (resident), 20-22 then 22-24, training to 34
    assert steps == pytest.approx([17.0, 17.0], abs=0.01)


def test_a_task_sharing_the_gpu_is_slower_and_its_attainment_says_so():
    a, b = _task("a", [[1.0] * 2] * 2, work_s=4.0), _task("b", [[1.0] * 2] * 2, work_s=4.0)
    b = replace(b, plan=replace(b.plan, slowdown=1.2))
    shared, stats = run_steps([a, b], _cluster(1, "a", "b"), broker(DEFAULT_PROFILE, slo_plans={"b": b.plan}), "pool")
    alone = run_steps([b], _cluster(1, "b"), POLICIES["tangram"], "solo")[0]["b"]
    # the first steps meet: a's rewards were asked first and go first; b's wait 8 s behind them (and a restore)
    assert shared["a"][0] == alone[0] < shared["b"][0]
    met = attainment(b, shared["b"], alone)
    assert met.slowdowns == tuple(s / d for s, d in zip(shared["b"], alone)) and met.slowdowns[0] > 1.2
    assert met.within == sum(s <= 1.2 for s in met.slowdowns) < 2 and met.fraction == met.within / 2
    # the broker's own tracker saw b's two reward phases (its rewards asked together each step), a's none
    assert stats["slo_windows"] == {"b": [2, stats["slo_windows"]["b"][1]]}


def test_the_offered_tasks_declare_their_worst_case_and_fit_their_dedicated_gpus():
    params = SloTaskParams(candidates=6, steps=2, batches=(16, 64))
    tasks = slo_tasks(params, 7)
    assert tasks == slo_tasks(params, 7) and tasks != slo_tasks(params, 8)
    for task in tasks:
        plan = task.plan
        assert plan.action_s == params.reward_median_s * params.reward_cap and params.slo_low <= plan.slowdown
        assert plan.dedicated_gpus in (1, 2, 4, 8) and plan.efficiency == 0.75
        for step in task.steps:
            assert len(step) == plan.actions and all(call.work_s <= plan.action_s for call in step)
            assert len({call.think_s for call in step}) == 1  # batched rewards: all after the slowest rollout
            assert step[0].think_s >= plan.other_s - params.train_s  # the gap the plan declares is the least


def test_admission_takes_a_task_only_if_no_slo_breaks_and_goes_on_after_a_refusal():
    tasks = slo_tasks(SloTaskParams(candidates=12, steps=1, batches=(256, 1024)), 5)
    pool = Pool(40, {t.name: 0.84 for t in tasks})
    assert len(_admitted(tasks, pool, reserve=False)) == 3  # on the shared bound alone
    admitted = _admitted(tasks, pool)
    names = [t.name for t in admitted]
    assert 0 < len(admitted) < len(tasks) and first_breach({t.name: t.plan for t in admitted}, pool) is None
    for refused in (t for t in tasks if t.name not in names):  # refused against those admitted before it
        before = [t for t in admitted if tasks.index(t) < tasks.index(refused)]
        assert first_breach({t.name: t.plan for t in (*before, refused)}, pool) is not None
    assert names != [t.name for t in tasks[:len(admitted)]] or len(admitted) == len(tasks)


@pytest.mark.slow  # seconds: left out of the fast lane
def test_the_scenario_writes_each_admission_with_its_attainment(tmp_path):
    out_json, out_png = tmp_path / "slo.json", tmp_path / "slo.png"
    assert main(["simulate", "gpu-slo", "--scale", "0.2", "--set", "slo.candidates=8", "--set", "slo.steps=2",
                 "--json", str(out_json), "--plot", str(out_png)]) == 0
    body = json.loads(out_json.read_text())
    points = {p["policy"]: p for p in body["points"]}
    assert set(points) == {"worst-case", "stochastic", "shared", "dedicated", "unchecked"}
    assert points["shared"]["reserved_gpus"] == 0 and points["worst-case"]["reserved_gpus"] <= 40
    assert points["unchecked"]["tasks"] == min(8, SloTaskParams().unchecked * points["dedicated"]["tasks"])
    for label, point in points.items():
        assert point["steps"] == 2 * point["tasks"] and 0 <= point["attainment"] <= 1
        if label != "dedicated":  # the broker's estimate: one window per reward phase, all rewards of a step at once
            assert point["broker_windows"] == point["steps"] and 0 <= point["broker_attainment"] <= 1
        assert point["min_attainment"] <= point["attainment"] or point["tasks"] == 0
    assert points["dedicated"]["max_slowdown"] == 1.0  # the dedicated deployments are the reference
    ratio = next(f for f in body["figures"] if f["name"].startswith("tasks per 40 GPUs: worst-case"))
    assert ratio["ours"] == pytest.approx(points["worst-case"]["tasks"] / points["dedicated"]["tasks"], abs=1e-3)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_slo_group_can_be_set_and_refuses_what_means_nothing():
    from tangram.sim.assumptions import parse

    assert parse(["slo.reward_cap=2"]).slo().reward_cap == 2.0
    assert isinstance(Assumptions().slo(), SloTaskParams)
    for bad in ("slo.reward_cap=0.5", "slo.steps=0", "slo.batches=3"):
        with pytest.raises(ValueError):
            parse([bad])


def test_a_reserved_task_goes_ahead_of_a_queue_asked_before_it_up_to_its_reservation() -> None:
    # a asks for 8 rewards of 4 s at 1 s, b for 2 at 2 s, on 2 GPUs (a restore takes 1 s)
    a = _task("a", [[1.0] * 8], work_s=4.0)
    b = _task("b", [[2.0] * 2], work_s=4.0)
    steps: dict[int, dict[str, list[float]]] = {}
    for gpus in (0, 1, 2):
        reserved = {"b": gpus} if gpus else {}
        steps[gpus] = run_steps([a, b], _cluster(2, "a", "b"),
                                broker(DEFAULT_PROFILE, slo_plans={"b": b.plan}, reserved=reserved),
                                f"reserved {gpus}")[0]
    # unreserved, b's rewards start after all of a's (a's last two end at 1 + 1 + 4 * 4 = 18); training 10 s
    assert steps[0]["b"][0] == pytest.approx(18 + 1 + 4 + 10, abs=0.01)
    # one GPU reserved: each GPU a's first rewards hold frees at 6; b takes one of them for its two rewards in turn
    assert steps[1]["b"][0] == pytest.approx(6 + 1 + 4 + 4 + 10, abs=0.01)
    # two: both of b's rewards start at 6
    assert steps[2]["b"][0] == pytest.approx(6 + 1 + 4 + 10, abs=0.01)
    # what b gains, a pays for: never less than a's time unreserved
    assert steps[2]["a"][0] >= steps[1]["a"][0] >= steps[0]["a"][0]
