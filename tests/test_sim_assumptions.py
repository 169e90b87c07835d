"""``--set group.field=value``: what can be changed, what is refused and why, and that a change reaches the runs."""

from __future__ import annotations

import json

import pytest

from tangram.cli import main
from tangram.sim import coding_scenarios
from tangram.sim.assumptions import parse
from tangram.sim.cluster import ApiModel, Costs, HeteroParams, StaticServing

pytestmark = pytest.mark.slow  # whole scenarios simulated per assumption


def test_overrides_are_typed_and_later_items_win():
    assumed = parse(["costs.pod_bind_per_s=200", "mopd.zipf=0", "api.concurrency=384", "costs.api_retries=0",
                     "costs.pod_bind_per_s=100", "static.batch=1"])
    assert assumed.costs() == Costs(pod_bind_per_s=100.0, api_retries=0)
    assert assumed.static() == StaticServing(batch=1)
    assert assumed.mopd(batch=7).zipf == 0.0 and assumed.mopd(batch=7).batch == 7
    assert assumed.api(ApiModel("api.search", quota=5)) == ApiModel("api.search", quota=5, concurrency=384)
    assert assumed.coding(batch=3).test_median_s == 20.0  # untouched groups keep their defaults
    assert parse(["hetero.tflops_factor=2"]).hetero() == HeteroParams(tflops_factor=2.0, hbm_factor=1.0)
    assert parse(["costs.test_runner= xdist"]).costs() == Costs(test_runner="xdist")  # a choice, not a number
    assert assumed.to_json() == {"costs.pod_bind_per_s": 100.0, "costs.api_retries": 0, "mopd.zipf": 0.0,
                                 "api.concurrency": 384, "static.batch": 1}


@pytest.mark.parametrize(("item", "reason"), [
    ("pod_bind_per_s=200", "expected group.field=value"),
    ("costs.pod_bind_per_s", "expected group.field=value"),
    ("gpus.count=3", "unknown group 'gpus'"),
    ("costs.pod_bind=3", "costs has no field 'pod_bind'"),
    ("coding.batch=64", "the scenarios set coding.batch themselves"),
    ("api.period_s=1", "the scenarios set api.period_s themselves"),
    ("costs.env_create_s=-1", "a number of at least 0"),
    ("costs.env_create_s=nan", "a number of at least 0"),
    ("costs.api_retries=1.5", "an integer of at least 0"),
    ("api.concurrency=0", "an integer of at least 1"),
    ("static.batch=0", "an integer of at least 1"),
    ("step.steps=0", "an integer of at least 1"),
    ("step.window_s=0", "a number of at least 1"),
    ("hetero.tflops_factor=0.5", "a number of at least 1"),
    ("costs.test_runner=nose", "one of tangram, xdist"),
])
def test_what_cannot_be_set_is_refused_naming_the_item(item, reason):
    with pytest.raises(ValueError) as refused:
        parse([item])
    assert reason in str(refused.value) and repr(item) in str(refused.value)


def test_a_changed_assumption_reaches_the_runs_it_concerns(tmp_path, capsys, monkeypatch):
    """A faster control plane speeds up the pods and nothing else; uniform teacher popularity shrinks the static
    deployment's queue."""
    monkeypatch.setattr(coding_scenarios, "CODING_BATCHES", (128, 256))  # two batches show it; six take minutes
    runs = {}
    for name, extra in (("assumed", []), ("fast-pods", ["--set", "costs.pod_bind_per_s=1000",
                                                       "--set", "costs.pod_start_s=0.5"])):
        out = tmp_path / f"{name}.json"
        assert main(["simulate", "coding-batch", "--scale", "0.2", "--json", str(out), *extra]) == 0
        runs[name] = json.loads(out.read_text())
    assert runs["assumed"]["assumed"] == {}
    assert runs["fast-pods"]["assumed"] == {"costs.pod_bind_per_s": 1000.0, "costs.pod_start_s": 0.5}
    assert "assumptions changed: costs.pod_bind_per_s = 1000.0" in capsys.readouterr().out

    def acts(body, policy):
        return [p["mean_trajectory_act_s"] for p in body["points"] if p["policy"] == policy]

    assert len(acts(runs["assumed"], "baseline")) == 2
    assert all(fast < slow for fast, slow in zip(acts(runs["fast-pods"], "baseline"), acts(runs["assumed"], "baseline")))
    for policy in ("tangram", "pods-ideal"):
        assert acts(runs["fast-pods"], policy) == acts(runs["assumed"], policy)

    static = {}
    for name, extra in (("zipf", []), ("uniform", ["--set", "mopd.zipf=0"])):
        out = tmp_path / f"gpu-{name}.json"
        assert main(["simulate", "gpu-batch", "--json", str(out), *extra]) == 0
        static[name] = acts(json.loads(out.read_text()), "baseline")
    assert static["uniform"][-1] < static["zipf"][-1]  # batch 2,048: no teacher a third of the calls
