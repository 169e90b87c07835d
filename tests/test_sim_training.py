"""RL training as consecutive steps (``tangram.sim.training``): a step is its rollout's makespan plus the training
time, steps follow each other on one clock, and Fig. 6's windows account for every call."""

from __future__ import annotations

import json

import pytest

from tangram.cli import main
from tangram.sim import policies
from tangram.sim.cluster import Cluster
from tangram.sim.trace import Call, Trace, Trajectory
from tangram.sim.training import StepParams, step_seed, train

pytestmark = pytest.mark.slow  # ten RL steps simulated


def one_tool_call(seed: int) -> Trace:
    """A step whose one trajectory thinks 2 s, then runs a tool call of ``seed % 1000 + 1`` seconds."""
    work = float(seed % 1000 + 1)
    return Trace("hand", seed, {}, [Trajectory(f"t{seed}", "task", 0.0, (Call("tool", 2.0, work),))])


def test_steps_follow_each_other_rollout_then_training() -> None:
    cluster = Cluster(cpu_nodes=1, cores_per_node=4)
    params = StepParams(steps=3, train_s=10.0, window_s=5.0)
    run = train(one_tool_call, cluster, policies.POLICIES["baseline"], "baseline", params, seed=7)
    # pods: submit at 2 s, the step's one pod binds at once and starts in 2 s, then runs the call
    works = [step_seed(7, k) % 1000 + 1 for k in range(3)]
    assert works == [1, 2, 3]
    overhead = 2.0
    assert run.rollouts_s == pytest.approx([2.0 + overhead + w for w in works])
    # each step's call ends at its step's start (the rollouts and training before it) plus its own finish
    starts = [0.0, run.rollouts_s[0] + 10.0, run.rollouts_s[0] + run.rollouts_s[1] + 20.0]
    assert [end for end, _ in run.calls] == pytest.approx([s + r for s, r in zip(starts, run.rollouts_s)])
    assert run.step_s == pytest.approx(sum(run.rollouts_s) / 3 + 10.0)
    windows = run.windows(params.window_s)
    assert sum(n for _, _, n in windows) == 3  # every call in one window
    assert [t for t, _, _ in windows] == [5.0 * i for i in range(len(windows))]  # contiguous from 0
    assert any(act is None for _, act, _ in windows)  # the training phases: no call ends there
    assert [act for _, act, n in windows if n] == pytest.approx([overhead + w for w in works])


def test_a_trajectorys_critical_path_is_its_calls_back_to_back_each_at_its_fastest() -> None:
    halves = ((1, 1.0), (2, 0.75), (4, 0.5))  # speed-ups 1, 1.5, 2
    test = Call("test", 3.0, 40.0, efficiency=halves)
    trace = Trace("hand", 1, {}, [Trajectory("a", "task", 0.0, (Call("tool", 2.0, 1.0), test)),
                                  Trajectory("b", "task", 5.0, (Call("tool", 1.0, 30.0),))])
    assert test.fastest_s() == pytest.approx(20.0)
    assert trace.trajectories[0].critical_path_s() == pytest.approx(2.0 + 1.0 + 3.0 + 20.0)
    assert trace.critical_path_s() == pytest.approx(36.0)  # b: it starts at 5 s, thinks 1 s, runs 30 s
    assert trace.unqueued_trajectory_act_s() == pytest.approx(((1.0 + 20.0) + 30.0) / 2)  # calls only, no thinking


def test_the_training_scenario_writes_step_durations_and_a_series_per_policy(tmp_path, capsys):
    out_json, out_png = tmp_path / "training.json", tmp_path / "training.png"
    assert main(["simulate", "training", "--scale", "0.2", "--set", "step.steps=2", "--set", "step.train_s=60",
                 "--json", str(out_json), "--plot", str(out_png)]) == 0
    body = json.loads(out_json.read_text())
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert body["assumed"] == {"step.steps": 2, "step.train_s": 60.0}
    names = [f["name"] for f in body["figures"]]
    assert names == [f"{w}: {what}" for w in ("AI coding", "MOPD", "DeepSearch")
                     for what in ("step duration, baseline / broker", "rollout makespan, baseline / broker",
                                  "step duration, baseline / critical path", "rollout makespan, critical path / broker")]
    for point in body["points"]:
        assert point["steps"] == 2 and point["train_s"] == 60.0
        assert point["mean_step_s"] == pytest.approx(sum(point["rollouts_s"]) / 2 + 60.0, rel=1e-3)
        rows = body["series"][f"{('AI coding', 'MOPD', 'DeepSearch')[int(point['x'])]}/{point['policy']}"]
        assert sum(n for _, _, n in rows) == point["calls"]
    figures = {f["name"]: f["ours"] for f in body["figures"]}
    for figure in body["figures"]:
        step = {p["policy"]: p for p in body["points"] if ("AI coding", "MOPD", "DeepSearch")[int(p["x"])]
                == figure["name"].partition(":")[0]}
        key = "mean_step_s" if "step duration" in figure["name"] else "mean_rollout_s"
        if figure["name"].endswith("baseline / broker"):
            assert figure["ours"] == pytest.approx(step["baseline"][key] / step["tangram"][key], abs=1e-3)
        bound = step["tangram"]["mean_critical_path_s"]
        assert bound == step["baseline"]["mean_critical_path_s"], "both policies roll out the same traces"
        if figure["name"].endswith("critical path / broker"):
            assert figure["ours"] == pytest.approx(bound / step["tangram"]["mean_rollout_s"], abs=1e-3)
    for workload in ("AI coding", "MOPD", "DeepSearch"):  # no schedule beats the critical path
        assert 0 < figures[f"{workload}: rollout makespan, critical path / broker"] <= 1.0
        assert (figures[f"{workload}: step duration, baseline / critical path"]
                >= figures[f"{workload}: step duration, baseline / broker"])
    assert "step duration" in capsys.readouterr().out
